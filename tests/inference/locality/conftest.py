"""Small hand-made traces shared by the locality tests."""

from __future__ import annotations

import numpy as np

from czyx.inference.trace import RoutingTrace


def make_trace(experts: list, n_experts: int, segments: list | None = None) -> RoutingTrace:
    """A trace from a nested list ``[T][L][k]`` of expert ids."""
    e = np.asarray(experts, dtype=np.uint8)
    if e.ndim == 2:
        e = e[:, None, :]
    seg = np.zeros(len(e), np.int32) if segments is None else np.asarray(segments, np.int32)
    return RoutingTrace(
        experts=e,
        weights=np.full(e.shape, 1.0 / e.shape[2], np.float32),
        segments=seg,
        model_id="hand",
        text_sha256="",
        n_experts=n_experts,
    )


def random_trace(t: int, n_layers: int, n_experts: int, k: int, seed: int) -> RoutingTrace:
    """Uniformly random distinct selections, two segments."""
    rng = np.random.default_rng(seed)
    e = np.argsort(rng.random((t, n_layers, n_experts)), axis=2)[:, :, :k]
    seg = (np.arange(t) >= t // 2).astype(np.int32)
    return make_trace(e.tolist(), n_experts, seg.tolist())
