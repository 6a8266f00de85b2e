"""Routing profiles: how often each (layer, expert) was chosen, and the hot list they give.

Scope: counting the router's top-k choices while the engine runs (the
decoder adds one ``bincount`` per sparse layer and forward pass), saving and
loading the counts as JSON, and ordering them into the hot list the slot
cache prewarms (most used first); and :class:`RouteRecorder`, which records
every token's selections and weights so ``czyx profile`` can write a
routing trace (:mod:`inference.trace`, the format the locality analysis
reads). A profile loads from either file: counts JSON or a trace ``.npz``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from czyx.inference.errors import InferenceError


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
    def from_trace(cls, trace: Any, n_layers: int, n_experts: int) -> RoutingProfile:
        """Counts of a routing trace, on the model's ``n_layers x n_experts`` grid."""
        if trace.n_experts != n_experts or max(trace.moe_layers, default=-1) >= n_layers:
            raise ProfileError(
                f"routing trace of {trace.n_layers} MoE layers x {trace.n_experts} experts "
                f"does not fit a model of {n_layers} layers x {n_experts} experts"
            )
        counts = np.zeros((n_layers, n_experts), np.int64)
        for j, layer in enumerate(trace.moe_layers):
            counts[layer] = np.bincount(trace.experts[:, j].ravel(), minlength=n_experts)
        return cls(counts)

    @classmethod
    def load(cls, path: str | os.PathLike, n_layers: int, n_experts: int) -> RoutingProfile:
        """Read a profile (counts JSON, or a routing trace ``.npz``), checking it
        matches the model's ``n_layers x n_experts``."""
        if os.fspath(path).endswith(".npz"):
            from czyx.inference.trace import RoutingTrace

            return cls.from_trace(RoutingTrace.load(path), n_layers, n_experts)
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


class RouteRecorder:
    """Records each token's top-k selections and weights, per sparse layer.

    The decoder calls :meth:`record` once per sparse layer and forward pass
    when a recorder is attached (``engine.model.recorder``); :meth:`trace`
    assembles the documented trace (``[T, L, k]``, one segment per
    :meth:`new_segment`).
    """

    def __init__(self, sparse_layers: tuple[bool, ...], n_experts: int, top_k: int) -> None:
        self.moe_layers = tuple(i for i, s in enumerate(sparse_layers) if s)
        self._col = {layer: j for j, layer in enumerate(self.moe_layers)}
        self.n_experts = n_experts
        self.top_k = top_k
        from czyx.inference.trace import index_dtype

        self._index_dtype = index_dtype(n_experts)
        self._idx: list[list[np.ndarray]] = [[] for _ in self.moe_layers]
        self._w: list[list[np.ndarray]] = [[] for _ in self.moe_layers]
        self._segments: list[np.ndarray] = []
        self._segment = -1

    def new_segment(self, n_tokens: int) -> None:
        """The next ``n_tokens`` tokens form one sequence (a fresh KV cache)."""
        self._segment += 1
        self._segments.append(np.full(n_tokens, self._segment, np.int32))

    def record(self, layer: int, idx: np.ndarray, weights: np.ndarray) -> None:
        """One forward pass of ``layer``: ``idx``/``weights`` are ``[T, k]``."""
        j = self._col[layer]
        self._idx[j].append(idx.astype(self._index_dtype))
        self._w[j].append(weights.astype(np.float32))

    def trace(self, model_id: str, text_sha256: str, weights_kind: str) -> Any:
        """The :class:`inference.trace.RoutingTrace` of everything recorded."""
        from czyx.inference.trace import RoutingTrace

        if not self._segments or not self._idx or not self._idx[0]:
            raise ProfileError("nothing was recorded: run at least one forward pass")
        experts = np.stack([np.concatenate(parts) for parts in self._idx], axis=1)
        weights = np.stack([np.concatenate(parts) for parts in self._w], axis=1)
        segments = np.concatenate(self._segments)
        if segments.shape[0] != experts.shape[0]:
            raise ProfileError(
                f"recorded {experts.shape[0]} tokens but segments cover {segments.shape[0]}"
            )
        return RoutingTrace(
            experts=experts,
            weights=weights,
            segments=segments,
            model_id=model_id,
            text_sha256=text_sha256,
            n_experts=self.n_experts,
            moe_layers=self.moe_layers,
            weights_kind=weights_kind,
        )
