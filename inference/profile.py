"""Routing profiles: how often each (layer, expert) was chosen, and the hot list they give.

Scope: counting the router's top-k choices while the engine runs (the
decoder adds one ``bincount`` per sparse layer and forward pass), saving and
loading the counts as JSON, and ordering them into the hot list the slot
cache prewarms (most used first).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from inference.errors import InferenceError


class ProfileError(InferenceError):
    """A routing profile file is malformed or belongs to another model shape."""


@dataclass(frozen=True)
class RoutingProfile:
    """Counts of top-k selections, ``counts[layer, expert]``."""

    counts: np.ndarray

    @property
    def n_layers(self) -> int:
        """Layers profiled."""
        return int(self.counts.shape[0])

    @property
    def n_experts(self) -> int:
        """Experts per layer."""
        return int(self.counts.shape[1])

    def hot_list(self, limit: int | None = None) -> list[tuple[int, int]]:
        """``(layer, expert)`` pairs ever chosen, most chosen first (ties: lower layer, expert)."""
        flat = self.counts.ravel()
        order = np.lexsort((np.arange(flat.size), -flat))
        order = order[flat[order] > 0]
        if limit is not None:
            order = order[:limit]
        return [(int(i) // self.n_experts, int(i) % self.n_experts) for i in order]

    def save(self, path: str | os.PathLike) -> None:
        """Write the profile as JSON."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"format": "czyx-routing-profile-1", "counts": self.counts.tolist()}, f)

    @classmethod
    def load(cls, path: str | os.PathLike, n_layers: int, n_experts: int) -> RoutingProfile:
        """Read a profile, checking it matches the model's ``n_layers x n_experts``."""
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
            counts = np.asarray(doc["counts"], dtype=np.int64)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ProfileError(f"routing profile {os.fspath(path)!r} is unreadable: {exc}") from exc
        if doc.get("format") != "czyx-routing-profile-1":
            raise ProfileError(f"routing profile {os.fspath(path)!r}: unknown format field")
        if counts.shape != (n_layers, n_experts) or (counts < 0).any():
            raise ProfileError(
                f"routing profile {os.fspath(path)!r} has counts of shape {counts.shape}; "
                f"the model has {n_layers} layers x {n_experts} experts"
            )
        return cls(counts)
