"""Watching a batched generation's routing, token by token: :class:`RouteFrame`.

Scope: what the server's live expert view shows. A request submitted to the
:class:`~czyx.inference.batch.Scheduler` with ``watch=True`` receives, before
each :class:`~czyx.inference.batch.Token` of a decode step, one
:class:`RouteFrame`: for the token that step fed, per layer, the experts it
routed to (the real routing of the step, not a replay), whether each was held
in a slot (a hit), brought in by a prefetch not yet used, or read on demand
(a miss), which experts the cache held, and the step's bytes read and cache
counters.

Cost: nothing for requests that do not watch. The scheduler keeps a count of
watching sequences and looks at it once per step; only a step with a watcher
installs a :class:`StepWatch` as the decoder's route recorder (the hook
``czyx profile`` uses), which copies the watched rows' routes per layer.

Rows: :func:`~czyx.inference.batch.forward_batch` tells the watch which
sequences each pass covers (:meth:`StepWatch.segment`): the C pass puts every
one-token chunk first, in order (its waves' first groups), the numpy pass
lays out each sequence's tokens contiguously. Prompt chunks are not watched:
a frame is a decode token's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from czyx.inference.cache import RESIDENT_HIT, RESIDENT_MISS, RESIDENT_PREFETCHED

__all__ = [
    "RESIDENT_HIT",
    "RESIDENT_MISS",
    "RESIDENT_PREFETCHED",
    "RouteFrame",
    "StepWatch",
]


@dataclass(frozen=True)
class RouteFrame:
    """Event: the routing of one decode token of a watched sequence.

    Attributes
    ----------
    index
        The generated token fed (0: the first generated token).
    token
        Its id.
    layers
        ``int [L]``: the layers that routed (in order).
    experts
        ``int [L, top_k]``: the experts each layer chose, in the router's order.
    weights
        ``float32 [L, top_k]``: their routing weights.
    state
        ``int8 [L, top_k]``: :data:`RESIDENT_HIT`, :data:`RESIDENT_PREFETCHED` or
        :data:`RESIDENT_MISS`, as the cache stood when the layer routed.
    resident
        ``bool [L, n_experts]``: the experts the cache held when the layer routed.
    step_sequences, step_tokens
        Sequences and tokens of the step (the batch shares its reads).
    bytes_read, hits, misses
        The cache's bytes read and lookups during the step (every sequence's).
    seconds
        The step's forward time.
    """

    index: int
    token: int
    layers: np.ndarray
    experts: np.ndarray
    weights: np.ndarray
    state: np.ndarray
    resident: np.ndarray
    step_sequences: int
    step_tokens: int
    bytes_read: int
    hits: int
    misses: int
    seconds: float


class StepWatch:
    """The route recorder of one step with watched sequences.

    Parameters
    ----------
    cache
        The step's expert cache (its :meth:`~inference.cache.ExpertCache.residency`).
    sizes
        Tokens of each chunk of the step, in the step's order.
    watched
        The chunk indices whose routes to keep (decode chunks of watching sequences).
    """

    def __init__(self, cache, sizes: Sequence[int], watched: Sequence[int]) -> None:
        self.cache = cache
        self.sizes = list(sizes)
        self.watched = frozenset(watched)
        self._rows: list[tuple[int, int]] = []  # (chunk, row) of the current pass
        self.kept: dict[int, list[tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]]
        self.kept = {j: [] for j in watched}

    def segment(self, chunks: Sequence[int], c_rows: bool) -> None:
        """The next pass covers ``chunks`` (indices into the step): with ``c_rows`` the C
        pass's row order (one-token chunks first, in order), else the numpy pass's
        (each chunk's tokens contiguous, in order)."""
        rows: list[tuple[int, int]] = []
        r = 0
        for j in chunks:
            n = self.sizes[j]
            if c_rows and n != 1:
                continue  # (after every one-token chunk: never a watched row)
            if j in self.watched and n == 1:
                rows.append((j, r))
            r += n
        self._rows = rows

    def record(self, layer: int, idx: np.ndarray, w: np.ndarray) -> None:
        """A layer's routes ``idx [rows, k]`` (the decoder's recorder hook)."""
        if not self._rows:
            return
        cache = self.cache
        resident = cache.table[layer] >= 0
        for j, r in self._rows:
            experts = np.array(idx[r], np.int64)
            state = cache.residency(layer, experts)
            self.kept[j].append((layer, experts, np.array(w[r], np.float32), state, resident))

    def frame(self, j: int, index: int, token: int, **step) -> RouteFrame:
        """Chunk ``j``'s frame (``step``: the step-wide fields of :class:`RouteFrame`)."""
        kept = self.kept[j]
        k = kept[0][1].size if kept else 0
        n_experts = self.cache.table.shape[1]

        def stack(col: int, dtype, shape) -> np.ndarray:
            return np.array([e[col] for e in kept], dtype).reshape(shape)

        return RouteFrame(
            index=index,
            token=token,
            layers=np.array([e[0] for e in kept], np.int64),
            experts=stack(1, np.int64, (len(kept), k)),
            weights=stack(2, np.float32, (len(kept), k)),
            state=stack(3, np.int8, (len(kept), k)),
            resident=stack(4, bool, (len(kept), n_experts)),
            **step,
        )
