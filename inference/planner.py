"""The transfer planner: when and where expert reads go, and whether they may; fail closed.

Scope: the slot-lifetime rules that decide whether a slot may become a
destination, one :class:`Transfer` record per read with its deadline, and
the bookkeeping X-Ray reports (:mod:`czyx.inference.xray`). Which experts
to fetch and which slot to evict is the cache's business
(:mod:`czyx.inference.streaming`); *how* an expert is read (I/O path, reader
kind, queue order, checksum) is the store's
(:class:`czyx.store.io.experts.ExpertReads`); the planner only refuses what
would be unsafe and keeps the record.

Lifecycle of a transfer:

1. :meth:`TransferPlanner.submit` checks that the destination slot's owner is
   proven dead: not live for the owner (held by the layer being computed, or
   pinned: the ``live`` mask the cache shares), no transfer in flight into
   it, and the extent fits the slot. Otherwise it raises
   :class:`SlotLiveError` / :class:`InvalidExtentError` and touches nothing.
   Then it hands the read to the store (``submit(layer, cls, slot, priority)``).
2. The store's readers (the native C pool, or Python threads) read the
   extent straight into the slot and stamp the times.
3. :meth:`TransferPlanner.wait` is the consumer's dependency: it waits for the
   store's read (``wait``; a read no reader has started runs in the waiting
   thread), then has it verified (``check``: checksum, short read, stale
   block file, I/O error, each a typed store error); only a verified
   transfer returns. A completion after the deadline (a prefetch's default
   deadline is its first use; a demand read has none unless given) is a
   counted stall, or :class:`DeadlineMissedError` in strict mode. Bytes are
   never substituted either way.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from czyx.inference.errors import InferenceError, SlotInUseError
from czyx.store.consumer import ModelConsumer
from czyx.store.io.experts import ExpertExtentError, ExpertRead, ExpertReads, open_expert_reads

if TYPE_CHECKING:
    from czyx.inference.xray import XRay

DEMAND = "demand"
PREFETCH = "prefetch"


class PlannerError(InferenceError):
    """Base of the planner's refusals."""


class SlotLiveError(PlannerError, SlotInUseError):
    """A transfer was aimed at a slot whose owner is still live (held, pinned or in flight)."""


class InvalidExtentError(PlannerError, ValueError):
    """A transfer's source extent or destination slot is invalid (unknown, or does not fit)."""


class DeadlineMissedError(PlannerError):
    """Strict mode: a transfer completed after its deadline (its bytes are not used)."""


def _read_fact(name: str, doc: str) -> property:
    """A read-only property of :class:`Transfer` that is its store read's ``name``."""
    return property(lambda t: getattr(t.read, name), doc=doc)


class Transfer:
    """One read of one expert into one slot, and everything X-Ray reports about it.

    Times are ``time.monotonic_ns`` values (``None`` until they happen). The
    read's own facts (start, first byte, completion, bytes, checksum result,
    source) are the store's :class:`~czyx.store.io.experts.ExpertRead`'s; the
    planner adds the request, first use, deadline and eviction it decided.
    """

    __slots__ = (
        "_error",
        "deadline_ns",
        "evict_reason",
        "evicted",
        "expert",
        "exposed_ns",
        "id",
        "kind",
        "layer",
        "read",
        "reads",
        "slot",
        "stalled",
        "t_first_use",
        "t_request",
        "tier",
        "used",
    )

    def __init__(
        self, tid: int, layer: int, expert: int, slot: int, kind: str, reads: ExpertReads
    ) -> None:
        self.id = tid
        self.layer = layer
        self.expert = expert
        self.slot = slot
        self.kind = kind
        self.reads = reads
        self.read: ExpertRead | None = None  # set once the store accepted the read
        self._error: BaseException | None = None
        self.t_request = time.monotonic_ns()
        self.t_first_use: int | None = None
        self.deadline_ns: int | None = None
        self.exposed_ns = 0
        self.stalled = False
        self.used = False
        self.evicted: tuple[int, int] | None = None
        self.evict_reason = "empty"
        #: The precision tier the expert was read at (a tiered cache sets it; else None).
        self.tier: int | None = None

    @property
    def error(self) -> BaseException | None:
        """The transfer's error: its read's (I/O, stale file, checksum) or a missed deadline."""
        if self._error is not None:
            return self._error
        return self.read.error if self.read is not None else None

    @error.setter
    def error(self, exc: BaseException | None) -> None:
        self._error = exc

    @property
    def done(self) -> bool:
        """Whether the reader finished (successfully or not)."""
        return self.reads.done(self.read)

    @property
    def native(self) -> bool:
        """Whether the store ran this read on its native C pool."""
        return self.read.pool is not None

    @property
    def t_start(self) -> int | None:
        """When a reader started the read."""
        return self.read.t_start or (self.t_request if self.read.t_complete else None)

    # The read's own facts, as the store's ExpertRead records them.
    source = _read_fact("source", "The I/O path the bytes came through (``consumer``: its own).")
    requested_bytes = _read_fact("nbytes", "The extent's length.")
    completed_bytes = _read_fact("completed_bytes", "Bytes the reader delivered.")
    staging_copy_bytes = _read_fact(
        "staging_copy_bytes", "Bytes that passed through the page cache and were copied."
    )
    checksum_result = _read_fact(
        "checksum_result", "``pending``, ``ok``, ``mismatch`` or ``consumer``."
    )
    t_first_byte = _read_fact("t_first_byte", "When the first bytes arrived (None: not seen).")
    t_complete = _read_fact("t_complete", "When the read finished.")


class TransferPlanner:
    """Slot-lifetime checks, deadlines and transfer records over an arena of slots.

    Parameters
    ----------
    consumer
        The opened model; its experts are read through the store's
        expert-read interface (:func:`czyx.store.io.experts.open_expert_reads`).
    slots
        The destination slot views (``uint8``, equal sizes).
    live
        A boolean mask over the slots that the owner keeps current: True
        while a slot's owner is live (held by the current layer, or pinned).
        Shared by reference; the planner only reads it.
    io
        A :data:`czyx.store.io.iopaths.PATHS` name; default: the measured winner,
        else buffered ``pread`` (:func:`czyx.store.io.iopaths.default_io_path`; the
        streaming cache names its path).
    readers
        Reader threads (>= 1).
    native
        Reader kind: None, the store's native C pool whenever it is built;
        False, Python threads.
    strict_deadlines
        Raise :class:`DeadlineMissedError` instead of counting a stall.
    xray
        An :class:`czyx.inference.xray.XRay` that receives every transfer.
    """

    def __init__(
        self,
        consumer: ModelConsumer,
        slots: Sequence[np.ndarray],
        live: np.ndarray,
        *,
        io: str | None = None,
        readers: int = 2,
        native: bool | None = None,
        strict_deadlines: bool = False,
        xray: XRay | None = None,
    ) -> None:
        if readers < 1:
            raise ValueError(f"readers: {readers} < 1")
        info = consumer.info
        self.consumer = consumer
        self.slots = list(slots)
        self.slot_nbytes = int(self.slots[0].size) if self.slots else 0
        if len(live) != len(self.slots):
            raise ValueError(f"live mask has {len(live)} entries for {len(self.slots)} slots")
        self.live = live
        self.strict = strict_deadlines
        self.xray = xray
        self.n_layers = int(info.n_layers)
        self.n_experts = int(info.n_experts)
        self.inflight: list[Transfer | None] = [None] * len(self.slots)
        self._n_inflight = 0  # entries of inflight that are not None (reap skips when 0)
        self.stalls = 0
        self._tid = 0
        self._closed = False
        #: The store's expert reads into these slots: the only read path.
        self.reads: ExpertReads = open_expert_reads(
            consumer, self.slots, readers=readers, native=native, io=io
        )

    # ------------------------------------------------------------------ submit / wait

    def check_destination(self, slot: int) -> None:
        """Raise :class:`SlotLiveError` unless ``slot``'s owner is proven dead."""
        if not 0 <= slot < len(self.slots):
            raise InvalidExtentError(f"slot {slot} outside the arena of {len(self.slots)} slots")
        t = self.inflight[slot]
        if t is not None:
            raise SlotLiveError(
                f"slot {slot}: transfer {t.id} (layer {t.layer} expert {t.expert}) is still "
                "in flight into it"
            )
        if self.live[slot]:
            raise SlotLiveError(f"slot {slot}: its owner is still live (held by a layer or pinned)")

    def submit(
        self,
        layer: int,
        expert: int,
        slot: int,
        *,
        kind: str = DEMAND,
        deadline_ns: int | None = None,
        evicted: tuple[int, int] | None = None,
        evict_reason: str = "empty",
        priority: int | None = None,
    ) -> Transfer:
        """Start reading expert ``(layer, expert)`` into ``slot``; returns its :class:`Transfer`.

        Queued transfers start in ``priority`` order (default: 0 for demand,
        1 for prefetch; lower first), then in submission order.

        Raises
        ------
        SlotLiveError
            The slot's owner is live or a transfer is in flight into it.
        InvalidExtentError
            No such expert, or its extent does not fit a slot.
        CzyxError
            The consumer's refusal to resolve the extent (a portal denial).
        """
        self.check_destination(slot)
        if not (0 <= layer < self.n_layers and 0 <= expert < self.n_experts):
            raise InvalidExtentError(f"expert (layer {layer}, {expert}) outside the model")
        if priority is None:
            priority = 0 if kind == DEMAND else 1
        t = Transfer(self._tid + 1, layer, expert, slot, kind, self.reads)
        try:
            t.read = self.reads.submit(
                layer, expert, slot, priority=priority, demand=kind == DEMAND
            )
        except ExpertExtentError as exc:
            raise InvalidExtentError(str(exc)) from exc
        self._tid += 1
        t.deadline_ns = deadline_ns
        t.evicted = evicted
        t.evict_reason = evict_reason
        self.inflight[slot] = t
        self._n_inflight += 1
        if self.xray is not None:
            self.xray.add(t)
        return t

    def wait(self, t: Transfer) -> None:
        """Block until ``t`` is complete and verified; the consumer's dependency.

        The first call records the first use and the exposed wait. Raises the
        transfer's error (short read, stale source, checksum, I/O) or, in
        strict mode, :class:`DeadlineMissedError`; the slot is then free
        again and holds nothing usable.
        """
        first = t.t_first_use is None
        if first:
            t.t_first_use = time.monotonic_ns()
        blocked = self.reads.wait(t.read)
        with contextlib.suppress(BaseException):
            self.reads.check(t.read)  # records the read's typed error, raised below
        if first:
            # Blocked: the wait until the bytes were usable, verification included.
            # Complete before first use: hidden, unless completion is after the first use.
            now = time.monotonic_ns()
            t.exposed_ns = now - t.t_first_use if blocked else max(0, t.t_complete - t.t_first_use)
        self._retire(t)
        if t.error is not None:
            raise t.error
        if first:
            t.used = True
            # A prefetch is due at its first use; a demand read is requested at its first
            # use (always exposed, reported as such), so only an explicit deadline applies.
            deadline = t.deadline_ns
            if deadline is None and t.kind == PREFETCH:
                deadline = t.t_first_use
            if deadline is not None and t.t_complete is not None and t.t_complete > deadline:
                t.stalled = True
                self.stalls += 1
                if self.strict:
                    t.error = DeadlineMissedError(
                        f"transfer {t.id} (layer {t.layer} expert {t.expert}) completed "
                        f"{(t.t_complete - deadline) / 1e3:.0f} us after its deadline"
                    )
                    raise t.error

    def reap(self) -> list[Transfer]:
        """Retire every finished transfer; returns them (the owner updates its state).

        A native read's read errors are known here (``Transfer.read.error``);
        its checksum is compared at first use (:meth:`wait`): the native readers
        hash as they read, other readers' prefetches nobody uses are not hashed.
        """
        done: list[Transfer] = []
        if not self._n_inflight:
            return done
        for t in self.inflight:
            if t is not None and self.reads.done(t.read):
                self._retire(t)
                done.append(t)
        return done

    def _retire(self, t: Transfer) -> None:
        if self.inflight[t.slot] is t:
            self.inflight[t.slot] = None
            self._n_inflight -= 1

    def drain(self) -> None:
        """Wait for every transfer in flight to finish (not a use: nothing is marked used)."""
        for t in list(self.inflight):
            if t is not None:
                self.reads.wait(t.read)
                self._retire(t)

    def close(self) -> None:
        """Finish in-flight reads, stop the store's readers (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.drain()
        self.reads.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
