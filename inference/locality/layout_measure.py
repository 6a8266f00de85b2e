"""How a physical layout serves a token's expert fetches: runs, seeks, bytes.

Scope: given slot indices ``[L, E]`` (:mod:`.curves_shim`), a trace and
optionally the hit mask of a cache replay (:mod:`.replay`), count for each
fetch group the contiguous runs of slots it must read. Fetches are grouped
the way the engine issues them: ``window=1`` is one group per token and
layer (the engine knows a layer's experts only after its router ran);
``window=2`` adds one layer of look-ahead (layers ``(0, 1), (2, 3), ...``
read together, as a prefetcher that predicted the next layer would); ``window
= L`` is the unrealistic all-layers-at-once bound, reported as such.

Definitions: a *run* is a maximal set of the group's slots that are
consecutive (or, with ``max_gap = g``, separated by at most ``g`` unneeded
slots, which are then read too); *seeks* are runs; the *mean run length* is
needed experts per run; *bytes* are slots read times the expert stride.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from czyx.inference.locality.errors import LocalityError
from czyx.inference.trace import RoutingTrace


@dataclass(frozen=True)
class LayoutMeasure:
    """Fetch cost of one layout on one trace.

    Attributes
    ----------
    mean_run_length : float
        Needed experts per contiguous read (1.0: every expert its own seek).
    seeks_per_token : float
        Contiguous reads per token.
    experts_per_token : float
        Needed (missed) experts per token.
    slots_read_per_token : float
        Slots read per token, gap slots included (equals experts_per_token
        when ``max_gap == 0``).
    """

    mean_run_length: float
    seeks_per_token: float
    experts_per_token: float
    slots_read_per_token: float

    def bytes_per_token(self, expert_bytes: int) -> float:
        """Bytes read per token for an expert stride of ``expert_bytes``."""
        return self.slots_read_per_token * expert_bytes


def measure_layout(
    trace: RoutingTrace,
    slots: np.ndarray,
    *,
    hits: np.ndarray | None = None,
    window: int = 1,
    max_gap: int = 0,
) -> LayoutMeasure:
    """Runs, seeks and slots read per token for ``slots`` on ``trace``.

    Parameters
    ----------
    trace : RoutingTrace
        The routing to serve.
    slots : np.ndarray
        ``[L, E]`` slot index of each (layer, router index).
    hits : np.ndarray, optional
        bool ``[T*L*k]`` (replay order): requests served by the cache, which
        need no read. Without it every request is read (no cache).
    window : int
        Layers per fetch group (1: per layer; 2: one layer of look-ahead).
    max_gap : int
        Unneeded slots a single read may span.

    Returns
    -------
    LayoutMeasure
    """
    T, L, k = trace.experts.shape
    if slots.shape != (L, trace.n_experts):
        raise LocalityError(f"slots shape {slots.shape}, expected {(L, trace.n_experts)}")
    if window < 1:
        raise LocalityError(f"window must be >= 1, got {window}")
    pos = np.take_along_axis(
        np.broadcast_to(slots[None], (T, L, trace.n_experts)),
        trace.experts.astype(np.int64),
        axis=2,
    )  # [T, L, k]
    need = np.ones((T, L, k), dtype=bool) if hits is None else ~hits.reshape(T, L, k)
    n_groups = -(-L // window)
    pad = n_groups * window - L
    if pad:
        pos = np.concatenate([pos, np.zeros((T, pad, k), np.int64)], axis=1)
        need = np.concatenate([need, np.zeros((T, pad, k), bool)], axis=1)
    big = np.iinfo(np.int64).max
    g = np.where(need, pos, big).reshape(T * n_groups, window * k)
    g.sort(axis=1)
    valid = g != big
    d = np.diff(g, axis=1)
    cont = valid[:, 1:] & (d <= 1 + max_gap)  # continues the previous run
    n_items = int(valid.sum())
    n_runs = n_items - int(cont.sum())
    slots_read = n_items + int(np.where(cont, d - 1, 0).sum())
    return LayoutMeasure(
        mean_run_length=n_items / n_runs if n_runs else float("nan"),
        seeks_per_token=n_runs / T,
        experts_per_token=n_items / T,
        slots_read_per_token=slots_read / T,
    )
