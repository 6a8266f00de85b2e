"""The transfer planner: asynchronous expert reads into their final slots, fail closed.

Scope: a small pool of reader threads, one :class:`Transfer` record with a
completion event per read, the slot-lifetime rules that decide whether a
slot may become a destination, deadlines, and the bookkeeping X-Ray reports
(:mod:`inference.xray`). Which experts to fetch and which slot to evict is
the cache's business (:mod:`inference.streaming`); the planner only refuses
what would be unsafe.

Lifecycle of a transfer:

1. :meth:`TransferPlanner.submit` checks that the destination slot's owner is
   proven dead: not live for the owner (held by the layer being computed, or
   pinned: the ``live`` mask the cache shares), no transfer in flight into
   it, and the extent fits the slot. Otherwise it raises
   :class:`SlotLiveError` / :class:`InvalidExtentError` and touches nothing.
2. A reader thread reads the extent straight into the slot through a
   :class:`~store.iopaths.TransferSource` (no staging buffer of ours), checks
   the source file's identity (:class:`~store.iopaths.StaleSourceError`),
   stamps the times and marks the transfer complete. By default the readers
   are the native pool's C threads (:mod:`store.readpool`), which never take
   the GIL: a completion costs the consumer nothing while it computes, and
   the job's state in C is the completion event. Without the C build (or
   for consumers without files) Python threads run the same reads and set a
   ``threading.Event``.
3. :meth:`TransferPlanner.wait` is the consumer's dependency: if no reader
   has started the transfer yet, the consumer runs it itself (a blocked
   consumer gains nothing from a thread hand-off); otherwise it blocks on
   the completion, then verifies the extent's checksum
   (:class:`~store.errors.ChecksumError`) and raises the transfer's error if
   it has one; only a verified transfer returns. A completion after the deadline (a
   prefetch's default deadline is its first use; a demand read has none
   unless given) is a counted stall, or :class:`DeadlineMissedError` in
   strict mode. Bytes are never substituted either way.

Consumers without a file behind their extents (``ExpertExtent.fd < 0``, the
in-memory test consumers) are read through ``consumer.read_expert`` on the
same threads; that call verifies by its own contract.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from czyx.errors import CzyxError
from czyx.inference.errors import InferenceError, SlotInUseError
from czyx.store.consumer import ModelConsumer
from czyx.store.core.checksum import checksum
from czyx.store.errors import ChecksumError
from czyx.store.io import readpool
from czyx.store.io.iopaths import TransferSource, default_io_path, open_source

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


class Transfer:
    """One read of one expert into one slot, and everything X-Ray reports about it.

    Times are ``time.monotonic_ns`` values (``None`` until they happen).
    A Python reader writes them before :attr:`event` is set, and the consumer
    reads them after it. A native read (:attr:`pool` set) writes nothing here:
    the planner copies its results from the pool once it is done.
    """

    __slots__ = (
        "checksum_result",
        "claim",
        "completed_bytes",
        "deadline_ns",
        "error",
        "event",
        "evict_reason",
        "evicted",
        "expert",
        "exposed_ns",
        "id",
        "kind",
        "layer",
        "pool",
        "requested_bytes",
        "seq",
        "slot",
        "source",
        "staging_copy_bytes",
        "stalled",
        "t_complete",
        "t_first_byte",
        "t_first_use",
        "t_request",
        "t_start",
        "used",
        "verified",
    )

    def __init__(
        self, tid: int, layer: int, expert: int, slot: int, kind: str, nbytes: int, source: str
    ) -> None:
        self.id = tid
        self.layer = layer
        self.expert = expert
        self.slot = slot
        self.kind = kind
        self.requested_bytes = nbytes
        self.completed_bytes = 0
        self.source = source
        self.staging_copy_bytes = 0
        # Python readers only (a native read completes in C): set by the planner.
        self.event: threading.Event | None = None
        self.claim: threading.Lock | None = None  # taken by whoever runs the read
        self.error: BaseException | None = None
        self.checksum_result = "pending"
        self.t_request = time.monotonic_ns()
        self.t_start: int | None = None
        self.t_first_byte: int | None = None
        self.t_complete: int | None = None
        self.t_first_use: int | None = None
        self.deadline_ns: int | None = None
        self.exposed_ns = 0
        self.stalled = False
        self.used = False
        self.evicted: tuple[int, int] | None = None
        self.evict_reason = "empty"
        self.pool: readpool.ReadPool | None = None  # set for a native read
        self.seq = -1
        self.verified = False

    @property
    def done(self) -> bool:
        """Whether the reader finished (successfully or not)."""
        if self.pool is not None:
            return self.t_complete is not None or self.pool.done(self.slot, self.seq)
        return self.event.is_set()


class TransferPlanner:
    """Reader threads, completion events and slot-lifetime checks over an arena of slots.

    Parameters
    ----------
    consumer
        The opened model: extents are resolved once here through
        ``expert_extent`` into ``[layer, expert]`` tables (arithmetic on the
        hot path afterwards).
    slots
        The destination slot views (``uint8``, equal sizes).
    live
        A boolean mask over the slots that the owner keeps current: True
        while a slot's owner is live (held by the current layer, or pinned).
        Shared by reference; the planner only reads it.
    io
        A :data:`store.iopaths.PATHS` name; default: the measured winner
        (:func:`store.iopaths.default_io_path`).
    threads
        Reader threads (>= 1).
    native
        Run file reads on the native pool's C threads (:mod:`store.readpool`);
        None: whenever it is built. False: Python reader threads.
    strict_deadlines
        Raise :class:`DeadlineMissedError` instead of counting a stall.
    xray
        An :class:`inference.xray.XRay` that receives every transfer.
    """

    def __init__(
        self,
        consumer: ModelConsumer,
        slots: Sequence[np.ndarray],
        live: np.ndarray,
        *,
        io: str | None = None,
        threads: int = 2,
        native: bool | None = None,
        strict_deadlines: bool = False,
        xray: XRay | None = None,
    ) -> None:
        if threads < 1:
            raise ValueError(f"threads: {threads} < 1")
        info = consumer.info
        self.consumer = consumer
        self.slots = list(slots)
        self.slot_nbytes = int(self.slots[0].size) if self.slots else 0
        if len(live) != len(self.slots):
            raise ValueError(f"live mask has {len(live)} entries for {len(self.slots)} slots")
        self.live = live
        self.io = io or default_io_path()
        self.n_threads = int(threads)
        self.strict = strict_deadlines
        self.xray = xray
        self.n_experts = int(info.n_experts)
        self.inflight: list[Transfer | None] = [None] * len(self.slots)
        self._n_inflight = 0  # entries of inflight that are not None (reap skips when 0)
        self.stalls = 0
        self._tid = 0
        self._resolve_extents(consumer)
        # Demand reads overtake queued prefetches: (priority, id, transfer). And a
        # prefetch waits while any demand read is outstanding: the device's bandwidth
        # is shared, and a consumer blocked on a demand read gains nothing from a
        # concurrent speculative one.
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._demand_lock = threading.Lock()
        self._demands = 0
        self._no_demand = threading.Event()
        self._no_demand.set()
        self._threads: list[threading.Thread] = []  # Python readers, started when needed
        self._closed = False
        if native and not readpool.available():
            raise readpool.ReadPoolUnavailableError(
                "native=True, but store._iopaths is not built (python setup.py build_ext --inplace)"
            )
        self.pool: readpool.ReadPool | None = None
        if native is not False and readpool.available() and self.slots:
            self.pool = readpool.ReadPool(len(self.slots), self.n_threads)
            self.pool.set_buffers(self.slots)
        self._pool_src: list[int] = []  # per source: its index in the native pool, or -1

    def _start_python_readers(self) -> None:
        self._threads = [
            threading.Thread(target=self._worker, name=f"czyx-reader-{i}", daemon=True)
            for i in range(self.n_threads)
        ]
        for th in self._threads:
            th.start()

    # ------------------------------------------------------------------ plan time

    def _resolve_extents(self, consumer: ModelConsumer) -> None:
        """Allocate the ``[layer, expert]`` tables of offset, length, checksum and source.

        Entries are resolved on first use (:meth:`_resolve`), not here: asking
        the consumer for every extent up front would make a portal-restricted
        consumer refuse, and audit, every class the run never touches.
        Source index -3: not resolved yet; -1: no file (read through
        ``consumer.read_expert``); >= 0: an index into :attr:`sources`.
        """
        nl, ne = int(consumer.info.n_layers), self.n_experts
        self.offset = np.zeros((nl, ne), np.int64)
        self.length = np.zeros((nl, ne), np.int64)
        self.sums = np.zeros((nl, ne), np.uint64)
        self.src = np.full((nl, ne), -3, np.int32)
        self.sources: list[TransferSource] = []
        self._by_fd: dict[int, int] = {}

    def _resolve(self, layer: int, expert: int) -> int:
        """Resolve one extent through the consumer (once); returns its source index.

        The consumer's own refusals (a portal denial, a dense layer) propagate
        as raised; other lookup failures become :class:`InvalidExtentError`.
        """
        try:
            ext = self.consumer.expert_extent(layer, expert)
        except CzyxError:
            raise
        except (LookupError, ValueError) as exc:
            raise InvalidExtentError(
                f"expert (layer {layer}, {expert}) has no extent: {exc}"
            ) from exc
        self.length[layer, expert] = ext.length
        if ext.fd < 0:
            self.src[layer, expert] = -1
            return -1
        src = self._by_fd.get(ext.fd)
        if src is None:
            # Reopen the consumer's descriptor (the same file, even if renamed since)
            # through the chosen path; the path is re-checked for replacement per read.
            src = len(self.sources)
            source = open_source(self.io, f"/proc/self/fd/{ext.fd}")
            self.sources.append(source)
            pooled = self.pool is not None and readpool.supports(source)
            self._pool_src.append(self.pool.add_source(source) if pooled else -1)
            self._by_fd[ext.fd] = src
        self.offset[layer, expert] = ext.offset
        self.sums[layer, expert] = ext.checksum
        self.src[layer, expert] = src
        return src

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
        if not (0 <= layer < self.src.shape[0] and 0 <= expert < self.n_experts):
            raise InvalidExtentError(f"expert (layer {layer}, {expert}) outside the model")
        src = int(self.src[layer, expert])
        if src == -3:
            src = self._resolve(layer, expert)
        n = int(self.length[layer, expert])
        if n <= 0 or n > self.slot_nbytes:
            raise InvalidExtentError(
                f"expert (layer {layer}, {expert}): extent of {n} bytes does not fit a "
                f"{self.slot_nbytes}-byte slot"
            )
        self._tid += 1
        name = self.sources[src].name if src >= 0 else "consumer"
        t = Transfer(self._tid, layer, expert, slot, kind, n, name)
        t.deadline_ns = deadline_ns
        t.evicted = evicted
        t.evict_reason = evict_reason
        self.inflight[slot] = t
        self._n_inflight += 1
        if self.xray is not None:
            self.xray.add(t)
        if priority is None:
            priority = 0 if kind == DEMAND else 1
        psrc = self._pool_src[src] if src >= 0 else -1
        if psrc >= 0:
            try:
                t.seq = self.pool.submit(
                    slot,
                    psrc,
                    int(self.offset[layer, expert]),
                    n,
                    priority=priority,
                    demand=kind == DEMAND,
                )
            except BaseException:
                self.inflight[slot] = None
                self._n_inflight -= 1
                raise
            t.pool = self.pool
            return t
        t.event = threading.Event()
        t.claim = threading.Lock()
        if not self._threads:
            self._start_python_readers()
        if kind == DEMAND:
            with self._demand_lock:
                self._demands += 1
                self._no_demand.clear()
        self._queue.put((priority, t.id, t))
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
        if t.pool is not None:
            blocked = False
            if t.t_complete is None:
                if not t.pool.done(t.slot, t.seq):
                    # Blocks without the GIL; a read no reader has started runs here.
                    t.pool.wait(t.slot)
                    blocked = True
                self._collect(t)
            if t.error is None and not t.verified:
                self._verify(t)
            if first:
                # Blocked: the wait until the bytes were usable, verification included (as a
                # Python reader's checksum is inside the event wait). Complete before first
                # use: hidden, unless the C completion stamp is after the first use.
                now = time.monotonic_ns()
                t.exposed_ns = (
                    now - t.t_first_use if blocked else max(0, t.t_complete - t.t_first_use)
                )
        elif not t.event.is_set():
            t0 = time.monotonic_ns()
            if t.claim.acquire(False):
                # No reader has started it: run it here rather than pay a thread
                # hand-off while blocked (the bytes and checks are the same).
                self._execute(t)
            t.event.wait()
            if first:
                t.exposed_ns = time.monotonic_ns() - t0
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

    def _collect(self, t: Transfer) -> None:
        """Copy a finished native read's results (times, bytes, read error) into ``t``."""
        timing = t.pool.timing(t.slot)
        t.t_start = timing.start_ns or t.t_request
        t.t_first_byte = timing.first_ns
        t.t_complete = timing.done_ns or time.monotonic_ns()
        t.completed_bytes = min(timing.nbytes, t.requested_bytes)
        if self.sources[int(self.src[t.layer, t.expert])].staging_copy:
            t.staging_copy_bytes = timing.nbytes
        try:
            t.pool.check(t.slot)
        except BaseException as exc:
            t.error = exc

    def _check_sum(self, t: Transfer) -> ChecksumError | None:
        """Compare ``t``'s slot bytes with the extent's recorded checksum; record the result."""
        layer, e = t.layer, t.expert
        got = checksum(self.slots[t.slot][: t.requested_bytes])
        want = int(self.sums[layer, e])
        if got == want:
            t.checksum_result = "ok"
            return None
        t.checksum_result = "mismatch"
        path = self.sources[int(self.src[layer, e])].identity.path
        return ChecksumError(
            f"{path}: expert (layer {layer}, {e}) at offset "
            f"{int(self.offset[layer, e])}: checksum {got:016x} != recorded {want:016x}"
        )

    def _verify(self, t: Transfer) -> None:
        """Verify a native read before its first use (the C readers do not hash)."""
        t.verified = True
        t.error = self._check_sum(t)

    def _finished(self, t: Transfer) -> bool:
        if t.pool is not None:
            if t.t_complete is None and t.pool.done(t.slot, t.seq):
                self._collect(t)
            return t.t_complete is not None
        return t.event.is_set()

    def reap(self) -> list[Transfer]:
        """Retire every finished transfer; returns them (the owner updates its state).

        A native read's read errors are known here; its checksum is verified
        at first use (:meth:`wait`), so a prefetch nobody uses costs no hash.
        """
        done: list[Transfer] = []
        if not self._n_inflight:
            return done
        for t in self.inflight:
            if t is not None and self._finished(t):
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
                if t.pool is not None:
                    if t.t_complete is None:
                        t.pool.wait(t.slot)  # a read no reader has started runs here
                        self._collect(t)
                else:
                    if t.claim.acquire(False):  # not started by a reader: run it here
                        self._execute(t)
                    t.event.wait()
                self._retire(t)

    # ------------------------------------------------------------------ readers

    def _worker(self) -> None:
        while True:
            _, _, t = self._queue.get()
            if t is None:
                return
            if t.kind != DEMAND:
                # Bounded: a demand read nobody waits for must not park the readers.
                self._no_demand.wait(0.1)
            if t.claim.acquire(False):  # else the consumer already ran it
                self._execute(t)

    def _execute(self, t: Transfer) -> None:
        """Run ``t`` once (by a reader, or by a consumer that stopped waiting for one)."""
        try:
            self._run(t)
        except BaseException as exc:  # recorded, raised to the consumer by wait()
            t.error = exc
            if t.t_complete is None:
                t.t_complete = time.monotonic_ns()
        finally:
            if t.kind == DEMAND:
                with self._demand_lock:
                    self._demands -= 1
                    if not self._demands:
                        self._no_demand.set()
            t.event.set()

    def _run(self, t: Transfer) -> None:
        layer, e = t.layer, t.expert
        dest = self.slots[t.slot]
        src = int(self.src[layer, e])
        t.t_start = time.monotonic_ns()
        if src < 0:
            self.consumer.read_expert(layer, e, dest)
            t.t_complete = t.t_first_byte = time.monotonic_ns()
            t.staging_copy_bytes = t.requested_bytes  # unknown path: declared as a copy
            t.completed_bytes = t.requested_bytes
            t.checksum_result = "consumer"
            return
        source = self.sources[src]
        n = t.requested_bytes
        timing = source.read_into(int(self.offset[layer, e]), n, dest)
        t.t_first_byte = timing.first_ns
        t.completed_bytes = min(timing.nbytes, n)
        if source.staging_copy:
            t.staging_copy_bytes = timing.nbytes
        source.check_identity()
        error = self._check_sum(t)
        t.t_complete = time.monotonic_ns()
        if error is not None:
            raise error

    def close(self) -> None:
        """Finish in-flight reads, stop the threads and close the sources (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.drain()
        for i, _ in enumerate(self._threads):
            self._queue.put((1 << 30, -1 - i, None))
        for th in self._threads:
            th.join()
        self._threads = []
        if self.pool is not None:
            self.pool.close()
        for s in self.sources:
            with contextlib.suppress(OSError):
                s.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
