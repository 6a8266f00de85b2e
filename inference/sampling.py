"""Next-token choice from logits: greedy, temperature, top-k, top-p; seeded.

The order is transformers' (temperature, then top-k, then top-p); the random
stream is a numpy ``Generator(PCG64(seed))``, so a seed reproduces a run.
OpenAI's presence and frequency penalties come first, on the logits: each token
the sampler chose so far is lowered by ``frequency_penalty`` times its count,
plus ``presence_penalty`` once (greedy choice included).
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
    presence_penalty: float = 0.0  # off
    frequency_penalty: float = 0.0  # off

    def __post_init__(self) -> None:
        if not self.temperature >= 0 or self.temperature == float("inf"):  # (NaN too)
            raise SamplingError(f"temperature {self.temperature} is not a finite number >= 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not np.isfinite(getattr(self, name)):
                raise SamplingError(f"{name} {getattr(self, name)} is not a finite number")
        if self.top_k < 0:
            raise SamplingError(f"top_k {self.top_k} is negative")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p {self.top_p} is not in (0, 1]")


class Sampler:
    """Stateful sampler (it owns the random stream)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.rng = np.random.Generator(np.random.PCG64(params.seed))
        self._penalize = params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        self._counts: dict[int, int] = {}  # token -> times chosen (with penalties only)

    def penalized(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` less the presence and frequency penalties of the tokens chosen so
        far: a copy, or ``logits`` itself when nothing is penalized."""
        if not self._counts:
            return logits
        p, n = self.params, len(self._counts)
        ids = np.fromiter(self._counts.keys(), np.int64, n)
        times = np.fromiter(self._counts.values(), np.float64, n)
        out = logits.copy()
        out[ids] -= (times * p.frequency_penalty + p.presence_penalty).astype(out.dtype)
        return out

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
        """The next token id (counted, where penalties are on)."""
        z = self.penalized(logits)
        if self.params.temperature == 0.0:
            tok = int(np.argmax(z))
        else:
            probs = self.probabilities(z)
            tok = int(self.rng.choice(probs.size, p=probs))
        if self._penalize:
            self._counts[tok] = self._counts.get(tok, 0) + 1
        return tok

    def verify(self, logits: np.ndarray, draft: int) -> tuple[int, bool]:
        """The next token id given a drafted one: ``(token, whether it is the draft)``.

        Speculative sampling's rule for a draft proposed with certainty (every
        drafter here proposes one token, not a distribution): accept ``draft``
        with probability ``min(1, p(draft) / 1) = p(draft)``, else draw from
        ``max(0, p - onehot(draft))`` normalised, which is ``p`` without the
        draft. The token is then distributed exactly as :meth:`__call__`'s
        (``p(draft)`` for the draft, ``(1 - p(draft)) p(t) / (1 - p(draft))`` for
        any other ``t``). Greedy: the argmax, accepted where it is the draft, so
        the tokens are :meth:`__call__`'s. Counted as :meth:`__call__` counts.
        """
        z = self.penalized(logits)
        if self.params.temperature == 0.0:
            tok = int(np.argmax(z))
        else:
            probs = self.probabilities(z)
            if not 0 <= draft < probs.size:
                raise SamplingError(f"drafted token {draft} is outside the vocabulary")
            p = float(probs[draft])
            if self.rng.random() < p:
                tok = draft
            else:
                rest = probs.copy()
                rest[draft] = 0.0
                rest /= rest.sum()  # (> 0: p < 1 here, since the draw was >= p)
                tok = int(self.rng.choice(rest.size, p=rest))
        if self._penalize:
            self._counts[tok] = self._counts.get(tok, 0) + 1
        return tok, tok == draft
