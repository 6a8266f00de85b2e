"""The streaming expert cache: the slot cache with planned, asynchronous, verified reads.

Scope: :class:`StreamingExpertCache`, an :class:`~inference.cache.ExpertCache`
whose misses go through the :class:`~inference.planner.TransferPlanner`
(reader threads, completion events, fail-closed slot lifetimes) and which
prefetches experts by two predictions:

- look-ahead: layer L+1's router applied to layer L's routed hidden state
  predicts L+1's top-k, read into dead slots while layer L's experts and
  L+1's attention compute;
- early routing: when the residual stream ``h`` enters layer L (before its
  attention), L's own router applied to ``norm(h)`` predicts L's top-k
  (the attention's update is what it misses), read while the attention
  computes. It is the only prediction for the first sparse layer of each
  token, which no earlier layer of that token can make.

Ordering inside :meth:`StreamingExpertCache.acquire` (why it is safe):

1. the layer's resident and in-flight experts are all marked held before
   any miss picks a victim, so no miss (and nothing below) can evict an
   expert the same call needs;
2. demand reads are queued first (FIFO: they reach the readers before any
   prefetch), then the prefetch recorded by :meth:`lookahead` for the next
   layer, into victims chosen among slots that are neither held, pinned nor
   in flight;
3. the consumer waits on each of its transfers' completion events; only
   verified bytes are returned, and a failed transfer unmaps its slot
   before the error propagates.

Bytes are exactly what the store holds whichever path brought them, so the
outputs equal the fully resident run's for any thread count (tested).

A budget that holds every routed expert (``czyx run``'s default) never
evicts, so each expert is read at most once: once every expert an acquire
asks for is resident and verified, that acquire is a table read (no hold,
no policy touch, no planner round-trip), and a layer whose last acquire was
such a read is not predicted (nothing is left to hide) until one of its
acquires has to read again. Warm, that engine pays nothing for streaming.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from czyx.inference.cache import (
    RESIDENT_HIT,
    RESIDENT_MISS,
    RESIDENT_PREFETCHED,
    EvictionPolicy,
    ExpertCache,
)
from czyx.inference.errors import SlotInUseError
from czyx.inference.kernels.fused import have_czk
from czyx.inference.kernels.linear import mm_t
from czyx.inference.options import renamed
from czyx.inference.planner import DEMAND, PREFETCH, Transfer, TransferPlanner
from czyx.store.consumer import ModelConsumer
from czyx.store.io.iopaths import default_io_path

if TYPE_CHECKING:
    from czyx.inference.kernels.fused import DecodeKernels
    from czyx.inference.xray import XRay


@dataclass(frozen=True)
class StreamOptions:
    """Deprecated: the streaming half of :class:`~czyx.inference.options.EngineOptions`.

    Kept so ``Engine(stream=StreamOptions(...))`` keeps working (with a
    DeprecationWarning); new code passes ``Engine(options=EngineOptions(...))``.

    Attributes
    ----------
    io
        I/O path (:data:`store.iopaths.PATHS`); None: the one ``czyx bench io``
        measured fastest, else buffered ``pread``.
    readers
        Reader threads.
    prefetch
        Look-ahead prefetch (off by default: then every read is a demand
        read, so misses equal reads; ``czyx run`` turns it on).
    lookahead
        Sparse layers predicted ahead.
    width
        Predicted experts read per token and layer (None: top-k).
    early
        Also predict each sparse layer from the residual stream entering it
        (before its attention); on by default with ``prefetch``.
    strict_deadlines
        A late transfer raises instead of counting a stall.
    """

    io: str | None = None
    readers: int = 2
    prefetch: bool = False
    lookahead: int = 1
    width: int | None = None
    early: bool = True
    strict_deadlines: bool = False


class StreamingExpertCache(ExpertCache):
    """An expert slot cache whose reads are planned transfers with look-ahead.

    Parameters
    ----------
    consumer, budget_bytes, top_k, n_sparse_experts, policy
        As :class:`~inference.cache.ExpertCache`.
    io
        I/O path name (:data:`czyx.store.io.iopaths.PATHS`); None:
        :func:`~czyx.store.io.iopaths.default_io_path` (the measured winner, else
        buffered ``pread``; the engine names ``direct`` for a model bigger than memory).
    readers
        Reader threads.
    prefetch
        Issue look-ahead reads (False: synchronous streaming through the same
        planner, the baseline prefetch is measured against).
    prefetch_evicts
        A prediction may evict a resident expert (False: predictions fill free
        slots only, and are not computed once none is left).
    prefetch_slots
        Slots of the budget set aside for predictions once the cache is full (0:
        none). A prediction is read into the one of them holding the oldest unused
        prediction, so a wrong guess evicts nothing the cache keeps; a prediction
        that an acquire uses joins the cache, and the policy's victim (evicted as a
        miss would have evicted it) becomes the prediction slot in its place (that
        eviction is in the cache's counters; X-Ray's transfer records name the
        evictions of reads).
    lookahead
        How many sparse layers ahead to predict (each with its own router on
        the current hidden state): deeper grows the overlap window and lowers
        the recall. 0: no look-ahead (early routing alone, when ``early``).
    width
        How many of each token's predicted experts to read (default: top-k).
    early
        Early routing: predict each sparse layer from the residual stream
        entering it (:meth:`preroute`), as well as by look-ahead.
    strict_deadlines
        A late transfer raises instead of counting a stall.
    native
        Reader kind (:class:`~inference.planner.TransferPlanner`): None, the
        native C pool when built; False, Python threads.
    xray
        An :class:`inference.xray.XRay` to record into.
    """

    def __init__(
        self,
        consumer: ModelConsumer,
        budget_bytes: int,
        top_k: int,
        n_sparse_experts: int | None = None,
        policy: str | EvictionPolicy = "lru",
        *,
        io: str | None = None,
        readers: int = 2,
        prefetch: bool = True,
        prefetch_evicts: bool = False,
        prefetch_slots: int = 0,
        lookahead: int = 1,
        width: int | None = None,
        early: bool = True,
        strict_deadlines: bool = False,
        native: bool | None = None,
        xray: XRay | None = None,
        **deprecated: int | None,
    ) -> None:
        if deprecated:  # threads / lookahead_depth / prefetch_width
            given = {"readers": readers, "lookahead": lookahead, "width": width}
            new = renamed(deprecated, stacklevel=2)
            unknown = set(new) - set(given)
            if unknown:
                raise TypeError(f"unexpected keyword arguments: {sorted(unknown)}")
            readers = int(new.get("readers", readers))
            lookahead = int(new.get("lookahead", lookahead))
            width = new.get("width", width)
        super().__init__(consumer, budget_bytes, top_k, n_sparse_experts, policy)
        # The budget is allocated up front: touch every page now, so a transfer's
        # time is I/O, not first-touch faults (zeroing huge pages) of the arena.
        self.arena[:, ::4096] = 0
        self.prefetch_enabled = prefetch
        self.prefetch_evicts = bool(prefetch_evicts)
        n_stage = int(prefetch_slots)
        if n_stage < 0 or n_stage > self.n_slots - top_k:
            raise ValueError(
                f"prefetch_slots: {n_stage} is not in 0..{self.n_slots - top_k} (the slots "
                f"beside one layer's top-{top_k})"
            )
        if self.never_evicts or not prefetch:
            n_stage = 0  # nothing a prediction could evict, or no predictions
        #: Slots holding predictions not yet used (:class:`StreamingExpertCache`'s
        #: ``prefetch_slots``); the demand path fills and evicts the others.
        self.prefetch_slots = n_stage
        self._regular = self.n_slots - n_stage
        self.staged = np.zeros(self.n_slots, bool)
        self.staged[self._regular :] = True
        self._unstaged = ~self.staged
        self._staged_at = np.zeros(self.n_slots, np.int64)  # 0: empty, else when staged
        self._stage_clock = 0
        self._stage_score = np.empty(self.n_slots, np.int64)
        self._promote: list[int] = []  # the current acquire's staged hits
        #: Predictions an acquire used that joined the cache, and unused ones overwritten.
        self.promotions = self.stage_dropped = 0
        # Under a budget that holds every expert each is read at most once, so a layer's
        # predictions only matter while it is still reading: a layer is "settled" by an
        # acquire whose experts were all resident and verified, and predicted again after
        # one that had to read (or wait). A partial budget predicts every layer always.
        self._reading = [True] * self.n_layers
        if lookahead < 0 or (lookahead == 0 and not early):
            raise ValueError(f"lookahead: {lookahead} (0 only with early routing, else >= 1)")
        #: Sparse layers predicted ahead (the ``lookahead`` option).
        self.depth = int(lookahead)
        # Predicted experts read per token and layer: fewer than top-k trades recall
        # for precision, which pays when reads, not compute, bound the step.
        width = top_k if width is None else int(width)
        if not 1 <= width <= top_k:
            raise ValueError(f"width: {width} is not in 1..{top_k}")
        self.width = width
        self.early = bool(early)
        self.xray = xray
        self.inflight = np.zeros(self.n_slots, bool)
        self._mask = np.zeros(self.n_slots, bool)
        self._xfer: list[Transfer | None] = [None] * self.n_slots
        #: The I/O path the experts are read by.
        self.io = io = io if io is not None else default_io_path()
        if xray is not None and not xray.io_path:
            xray.io_path = io
        self.planner = TransferPlanner(
            consumer,
            self._slot_views,
            self.blocked,
            io=io,
            readers=readers,
            native=native,
            strict_deadlines=strict_deadlines,
            xray=xray,
        )
        self.routers: list[np.ndarray | None] = []
        self._early_routers: list[np.ndarray | None] = []
        self._next_sparse: list[int] = []
        self._pending: list[tuple[int, np.ndarray]] = []
        # Predicted experts per layer since its last acquire (recall accounting and the
        # distinct set to read): a mask, so neither needs a sort or a set operation.
        self._predicted = np.zeros(self.table.shape, bool)
        self._has_prediction = np.zeros(self.table.shape[0], bool)
        self._route_mask: np.ndarray | None = None
        self.prefetches = self.prefetch_hits = 0
        self.predicted_total = self.predicted_correct = 0
        self._kernels: weakref.WeakMethod | None = None
        self._logit_rows = np.empty(self.table.shape[1], np.float32)
        self._waits: list[Transfer] = []  # the current acquire's transfers to wait for
        self._pending_at: dict[int, Transfer] = {}  # position -> transfer, until waited
        self._slot_pos = np.zeros(self.n_slots, np.int64)  # slot -> position in the acquire
        self._positions = np.arange(max(self.n_slots, top_k), dtype=np.int64)

    # ------------------------------------------------------------------ look-ahead

    def set_routers(
        self,
        routers: Sequence[np.ndarray | None],
        norms: Sequence[np.ndarray | None] | None = None,
    ) -> None:
        """Give the per-layer routers ``[E, H]`` (None for dense layers) and their norms.

        ``norms`` are the weights ``[H]`` of the RMS norm each router's input
        goes through (the pre-MLP norm); with them, early routing is possible.
        """
        self.routers = list(routers)
        # router @ rms_norm(h, w) = (router * w) @ h / rms(h): the 1/rms(h) factor is
        # positive per token, so the top-k of (router * w) @ h is the router's on norm(h)
        # and the early prediction is one product with the folded matrix.
        self._early_routers = [None] * len(self.routers)
        if norms is not None:
            for i, (r, w) in enumerate(zip(self.routers, norms, strict=True)):
                if r is not None and w is not None and isinstance(r, np.ndarray):
                    self._early_routers[i] = np.ascontiguousarray(r * np.asarray(w, r.dtype))
        nxt, following = [-1] * len(self.routers), -1
        for i in range(len(self.routers) - 1, -1, -1):
            nxt[i] = following
            if self.routers[i] is not None:
                following = i
        self._next_sparse = nxt

    def lookahead(self, layer: int, x: np.ndarray) -> None:
        """Layer ``layer`` routed on ``x`` ``[T, H]``: predict the next sparse layer's experts.

        The prediction (its router on this hidden state, top-k per token) is
        read into dead slots by the next :meth:`acquire`, after that call has
        protected the slots its own layer needs.
        """
        if not self._may_prefetch() or layer >= len(self._next_sparse):
            return
        nxt, checked = layer, False
        for _ in range(self.depth):
            nxt = self._next_sparse[nxt]
            if nxt < 0:
                return
            if not self._reading[nxt]:
                continue  # settled: every expert it used lately was resident
            if not checked:
                if not self._predictable(x.shape[0]):
                    return
                checked = True
            self._pending.append((nxt, self._predict(nxt, self._logits(self.routers[nxt], x))))

    def preroute(self, layer: int, h: np.ndarray) -> None:
        """The residual stream ``h`` ``[T, H]`` enters ``layer``: read its predicted experts now.

        Early routing: the layer's router on the (unattended) residual stream.
        The reads are issued at once, at a higher priority than look-ahead
        reads for later layers, and overlap the layer's attention.
        """
        if not (self.early and self._may_prefetch()) or layer >= len(self._early_routers):
            return
        if not self._reading[layer]:
            return  # settled (a budget that holds every expert): nothing left to hide
        folded = self._early_routers[layer]
        if folded is None or not self._predictable(h.shape[0]):
            return
        self._reap()
        self._pending.append((layer, self._predict(layer, self._logits(folded, h))))
        self._issue_prefetch(base_priority=1)

    def _may_prefetch(self) -> bool:
        """Whether a prediction may be read now: prefetch is on and a slot may take it
        (any unheld one when predictions may evict, a prediction slot, else one never
        filled)."""
        return self.prefetch_enabled and (
            self.prefetch_evicts or self.prefetch_slots > 0 or self._n_filled < self._regular
        )

    def set_kernels(self, kernels: Callable[[], DecodeKernels] | None) -> None:
        """Compute a single token's predictions with the decoder's C kernels.

        ``kernels()`` returns them (made on first use). Without them a
        prediction is a numpy product, whose BLAS threads spin on after it on
        the cores the readers and the decode kernels need (on two cores that
        slowed decode more than the predictions' reads saved).
        """
        # Weakly: the decoder holds this cache, and a strong reference back would keep both
        # (and the arena's reserved bytes) alive until a garbage collection.
        self._kernels = None if kernels is None else weakref.WeakMethod(kernels)

    def _logits(self, router: np.ndarray, x: np.ndarray) -> np.ndarray:
        """``x @ router.T``: router logits ``[T, E]`` (the router may be packed)."""
        kernels = None if self._kernels is None or x.shape[0] != 1 else self._kernels()
        if kernels is None:
            return mm_t(x, router)  # for float32, x @ router.T
        out = self._logit_rows[: router.shape[0]]
        kernels().matvec(router, np.ascontiguousarray(x[0], np.float32), out)
        return out[None]

    def _predictable(self, n_tokens: int) -> bool:
        """Whether a batch's predictions fit beside the experts its layer holds.

        A prefill batch predicts nearly every expert of a layer; read into a
        small budget, those reads evict one another and the layer's own
        experts before use (more exposed I/O and slower decode for the same
        bytes read: ``bench/RATIONALE.md``, measured with ``czyx demo``), so a
        batch prefetches only when its predictions fit the unpinned slots
        beside one token's top-k (a single token always may: its reads stop
        at the first slot that is not dead).
        """
        width = self.width
        return n_tokens * width <= max(self.max_acquire - self.top_k, width)

    def set_route_mask(self, mask: np.ndarray | None) -> None:
        """Keep predictions inside ``mask[layer, expert]`` (a scoped portal's experts).

        Demand reads follow the masked router already; predictions come from
        the unmasked routers, and a prefetch outside the grant would be a read
        the portal refuses.
        """
        self._route_mask = None if mask is None else np.asarray(mask, bool)

    def _predict(self, layer: int, logits: np.ndarray) -> np.ndarray:
        """The distinct top-``width`` experts of ``logits`` ``[T, E]``, recorded.

        Returns every expert predicted for ``layer`` since its last acquire
        (those already read are resident or in flight, and skipped).
        """
        if self._route_mask is not None:
            logits = np.where(self._route_mask[layer], logits, np.float32(-np.inf))
        k = min(self.width, logits.shape[1])
        mask = self._predicted[layer]
        if k == 1:
            mask[logits.argmax(axis=1)] = True
        else:
            mask[np.argpartition(-logits, k - 1, axis=1)[:, :k]] = True
        if self._route_mask is not None:
            mask &= self._route_mask[layer]  # fewer permitted experts than the width
        self._has_prediction[layer] = True
        return np.flatnonzero(mask)

    def _issue_prefetch(self, base_priority: int = 2) -> None:
        """Read the pending predictions into dead slots, nearest layer first.

        Predicted experts already resident are held while the victims are
        chosen, so one prediction never evicts another that is already in.
        """
        pending, self._pending = self._pending, []
        table = self.table
        missing = [pred[table[layer, pred] < 0] for layer, pred in pending]
        if not any(len(m) for m in missing):
            return  # every prediction is resident or on its way: the common case
        blocked, held = self.blocked, []
        try:
            for layer, pred in pending:
                for s in table[layer, pred].tolist():
                    if s >= 0 and not blocked[s]:
                        blocked[s] = True
                        held.append(s)
            for depth, ((layer, _), miss) in enumerate(zip(pending, missing)):
                row = table[layer]
                for e in miss.tolist():
                    if row[e] >= 0:
                        continue  # claimed above for an earlier entry of the same layer
                    if self._n_filled < self._regular or self.prefetch_evicts:
                        s = self._victim()
                    elif self.prefetch_slots:
                        s = self._stage_slot()
                    else:
                        return  # no free slot left, and a prediction may not evict
                    if s < 0:
                        return  # no dead slot: prefetch is optional, demand will fetch it
                    self._claim(layer, e, s, PREFETCH, priority=base_priority + depth)
                    self.prefetches += 1
        finally:
            blocked[held] = False

    # ------------------------------------------------------------------ the hot path

    def acquire(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """Make ``experts`` of ``layer`` resident and verified; hold them until :meth:`release`.

        A miss that finds every unheld slot in flight waits for those
        transfers to complete (they are never overwritten while live).

        Raises
        ------
        SlotInUseError
            A miss found every slot pinned or held.
        ShortReadError, ReadIOError, ChecksumError, StaleSourceError, DeadlineMissedError
            A transfer this layer depends on failed (its slot is unmapped first).
        """
        out, pending = self.acquire_streamed(layer, experts)
        try:
            for j in pending:
                self.wait_ready(j)
        except BaseException:
            self.release()
            raise
        return out

    def acquire_streamed(self, layer: int, experts: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """As :meth:`acquire`, returning once every read is issued, not when it is done.

        Returns the slots and the positions whose transfers (demand reads, or
        prefetches not yet used) the caller must :meth:`wait_ready` for before
        reading their slots, in request order: computing the resident experts
        first hides those reads (the pipeline at the granularity of one
        expert). A failed wait unmaps its slot and raises; the caller releases.
        """
        self._waits.clear()
        if self._pending_at:
            self._pending_at = {}  # an earlier call's positions that were never waited for
        if self.never_evicts and not self._pending:
            out = self._acquire_ready(layer, experts)
            if out is not None:
                # Resident and verified, nothing to issue: no hold, no planner round-trip.
                if self._has_prediction[layer]:
                    self._score_prediction(layer, experts)
                self._reading[layer] = False
                return out, []
            self._reading[layer] = True
        self._reap()
        if self._has_prediction[layer]:
            self._score_prediction(layer, experts)
        waits = self._waits

        # (without prediction slots a hit costs no lookup for them)
        staged = self.staged if self.prefetch_slots else None
        promote = self._promote
        promote.clear()

        def on_hit(s: int) -> None:  # resident or in flight: wait for an unused transfer
            if staged is not None and staged[s]:
                promote.append(s)
            t = self._xfer[s]
            if t is not None and not t.used:
                waits.append(t)
                if t.kind == PREFETCH:
                    self.prefetch_hits += 1

        def fill(layer: int, e: int) -> int:
            s = self._victim()
            if s < 0 and self.inflight.any():
                self._settle()  # in-flight slots become evictable once complete
                s = self._victim()
            if s < 0:
                raise SlotInUseError(
                    f"no evictable slot for layer {layer} expert {e}: all "
                    f"{self.n_slots} slots are pinned or held"
                )
            waits.append(self._claim(layer, e, s, DEMAND))
            self.misses += 1
            return s

        try:
            # The shared rule (ExpertCache._hold_layer): hits, resident or in flight, are
            # all held before any miss picks a victim.
            self._hold_layer(layer, experts, fill, on_hit)
            for s in promote:  # after the layer's experts are held: none is a victim
                self._join(s)
            self._issue_prefetch()
        except BaseException:
            self.release()
            raise
        out = self._out[: len(experts)]
        if not waits:
            return out, []
        # The position of each awaited transfer's slot: in-flight hits first, then the misses,
        # in the order this call met them.
        slot_pos = self._slot_pos
        slot_pos[out] = self._positions[: len(out)]
        pending = [int(slot_pos[t.slot]) for t in waits]
        self._pending_at = dict(zip(pending, waits, strict=True))
        return out, pending

    def wait_ready(self, j: int) -> None:
        """Wait until position ``j`` of the last :meth:`acquire_streamed` is read and verified.

        Raises the transfer's typed error (its slot unmapped first).
        """
        t = self._pending_at.pop(j, None)
        if t is not None:
            self._wait(t)

    def residency(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """As :meth:`ExpertCache.residency`, telling apart the experts an unused prefetch
        brought in (or is bringing in): :data:`~inference.cache.RESIDENT_PREFETCHED`."""
        row, xfer = self.table[layer], self._xfer
        out = np.empty(len(experts), np.int8)
        for j, e in enumerate(np.asarray(experts).tolist()):  # (top-k of them: a loop)
            s = int(row[e])
            t = xfer[s] if s >= 0 else None
            if s < 0:
                out[j] = RESIDENT_MISS
            elif t is not None and not t.used and t.kind == PREFETCH:
                out[j] = RESIDENT_PREFETCHED
            else:
                out[j] = RESIDENT_HIT
        return out

    def _score_prediction(self, layer: int, experts: np.ndarray) -> None:
        """Count how many of ``experts`` were predicted for ``layer`` (recall); clear it."""
        mask = self._predicted[layer]
        self.predicted_total += len(experts)
        self.predicted_correct += int(mask[experts].sum())
        mask[:] = False
        self._has_prediction[layer] = False

    def _victim(self) -> int:
        """The slot a miss (or an evicting prediction) takes: a never-filled one, else the
        policy's choice among those neither held, in flight nor holding a prediction."""
        if self._n_filled < self._regular:
            return self._n_filled
        np.logical_or(self.blocked, self.inflight, out=self._mask)
        if self.prefetch_slots:
            self._mask |= self.staged
        return self.policy.victim(self._mask)

    def _stage_slot(self) -> int:
        """The prediction slot a new prediction takes: an empty one, else the one holding
        the oldest prediction no acquire has used (-1: all held or in flight)."""
        score = self._stage_score
        np.copyto(score, self._staged_at)
        np.logical_or(self.blocked, self.inflight, out=self._mask)
        self._mask |= self._unstaged
        np.putmask(score, self._mask, np.iinfo(np.int64).max)
        s = int(score.argmin())
        return -1 if self._mask[s] else s

    def _join(self, s: int) -> None:
        """Prediction slot ``s`` was used: it joins the cache, and the policy's victim among
        the other slots (its expert evicted, as a miss would have) becomes a prediction
        slot. Nothing changes when every other slot is held or in flight."""
        v = self._victim()
        if v < 0:
            return
        if self._unmap(v) >= 0:
            self.evictions += 1
        self._xfer[v] = None
        if v == self._n_filled:
            self._n_filled += 1  # (a never-filled slot: the cache was not full yet)
        self.staged[s], self.staged[v] = False, True
        self._unstaged[s], self._unstaged[v] = True, False
        self._staged_at[v] = 0
        self.promotions += 1

    def _claim(
        self, layer: int, expert: int, s: int, kind: str, priority: int | None = None
    ) -> Transfer:
        """Evict slot ``s``'s owner (proven dead by the planner) and read ``expert`` into it."""
        evicted, reason = None, "empty"
        if s == self._n_filled and s < self._regular:
            self._n_filled += 1
        staged = self.prefetch_slots > 0 and bool(self.staged[s])
        if staged:
            self._stage_clock += 1
            self._staged_at[s] = self._stage_clock
        old = self._unmap(s)  # unowned while written: a failed read leaves no mapping
        if old >= 0:
            evicted = (old // self.n_experts, old % self.n_experts)
            if staged:  # an unused prediction: not a cache eviction
                self.stage_dropped += 1
                reason = "unused prediction"
            else:
                self.evictions += 1
                reason = self.policy.name
        self._xfer[s] = None
        nbytes = self._filled_at(s, layer, expert)  # the tier's views, before the read
        t = self.planner.submit(
            layer, expert, s, kind=kind, evicted=evicted, evict_reason=reason, priority=priority
        )
        t.tier = int(self.slot_tier[s])
        key = layer * self.n_experts + expert
        self.inflight[s] = True
        self.owner[s] = key
        self.table[layer, expert] = s
        self._xfer[s] = t
        filled = getattr(self.policy, "filled", None)
        if filled is not None:
            filled(s, key)
        if kind == PREFETCH:
            self.policy.touch(s)  # a fresh prefetch is not the first victim of the next one
        self.bytes_read += nbytes
        return t

    def _wait(self, t: Transfer) -> None:
        try:
            self.planner.wait(t)
        except BaseException:
            self._drop(t)
            raise
        finally:
            self.inflight[t.slot] = self.planner.inflight[t.slot] is not None
            self.read_seconds += t.exposed_ns / 1e9
        if self.never_evicts and self._xfer[t.slot] is t:
            self._ready[t.layer][t.expert] = t.slot  # verified: the fast path may use it

    def _drop(self, t: Transfer) -> None:
        """Unmap a failed transfer's slot (if it still belongs to that transfer)."""
        if self._xfer[t.slot] is t:
            self._unmap(t.slot)
            self._xfer[t.slot] = None

    def _settle(self) -> None:
        """Wait for every transfer in flight (not a use), then retire them."""
        pending = [t for t in self.planner.inflight if t is not None]
        self.planner.drain()
        for t in pending:
            self.inflight[t.slot] = False
            if t.error is not None:
                self._drop(t)

    def _reap(self) -> None:
        for t in self.planner.reap():
            self.inflight[t.slot] = False
            if t.error is not None:
                self._drop(t)

    # ------------------------------------------------------------------ residency

    def prewarm(self, hot) -> int:
        """Load a hot list (as the base class), through the planner, waiting for each."""
        loaded: list[int] = []
        for layer, expert in hot:
            if self.table[layer, expert] >= 0:
                continue
            if self._n_filled >= self._regular:
                break
            t = self._claim(layer, expert, self._n_filled, DEMAND)
            self._wait(t)
            self.misses += 1
            loaded.append(t.slot)
        for s in reversed(loaded):  # the first entries are touched last: evicted last
            self.policy.touch(s)
        return len(loaded)

    def close(self) -> None:
        """Finish in-flight reads, stop the readers, drop the arena."""
        self.planner.close()
        super().close()


def attach(model, cache: StreamingExpertCache) -> None:
    """Connect a decoder to a streaming cache's look-ahead.

    Gives the cache the decoder's routers and sets the decoder's hooks: when
    the residual stream enters layer L (``layer_hook``) the cache reads L's
    predicted experts (early routing), and when layer L routes on its hidden
    state ``x`` (``route_hook``) the cache first records its prediction for
    the next sparse layer (issued by the next
    :meth:`StreamingExpertCache.acquire`, after L's own slots are held). The
    decoder's arithmetic is untouched: the hooks only observe.
    """
    cache.set_routers(
        [getattr(lw, "router", None) for lw in model.layers],
        [getattr(lw, "post_attn_norm", None) for lw in model.layers],
    )
    if have_czk() and callable(getattr(model, "kernels", None)):
        cache.set_kernels(model.kernels)
    model.layer_hook = cache.preroute
    model.route_hook = cache.lookahead
