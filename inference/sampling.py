"""Next-token choice from logits: greedy, temperature, top-k, top-p; seeded.

The order is transformers' (temperature, then top-k, then top-p); the random
stream is a numpy ``Generator(PCG64(seed))``, so a seed reproduces a run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from czyx.inference.errors import SamplingError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. ``temperature == 0`` means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1.0: no nucleus cut
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise SamplingError(f"temperature {self.temperature} is negative")
        if self.top_k < 0:
            raise SamplingError(f"top_k {self.top_k} is negative")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p {self.top_p} is not in (0, 1]")


class Sampler:
    """Stateful sampler (it owns the random stream)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.rng = np.random.Generator(np.random.PCG64(params.seed))

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """The distribution sampling draws from, after temperature, top-k and top-p."""
        p = self.params
        z = logits.astype(np.float64) / max(p.temperature, 1e-12)
        if p.top_k and p.top_k < z.size:
            kth = np.partition(z, -p.top_k)[-p.top_k]
            z = np.where(z < kth, -np.inf, z)
        z = z - z.max()
        probs = np.exp(z)
        probs /= probs.sum()
        if p.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cum = np.cumsum(probs[order])
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            keep = int(np.searchsorted(cum, p.top_p) + 1)
            mask = np.zeros_like(probs, dtype=bool)
            mask[order[:keep]] = True
            probs = np.where(mask, probs, 0.0)
            probs /= probs.sum()
        return probs

    def __call__(self, logits: np.ndarray) -> int:
        """The next token id."""
        if self.params.temperature == 0.0:
            return int(np.argmax(logits))
        probs = self.probabilities(logits)
        return int(self.rng.choice(probs.size, p=probs))
