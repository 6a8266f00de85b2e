"""The store's one expert-read interface: ``submit`` / ``done`` / ``wait`` / ``check``.

Scope: reading a consumer's experts into an arena of caller-owned slots,
asynchronously, verified. An engine decides *what* to read and *when*
(which expert, into which slot, at which priority); this module decides
*how*: which I/O path, which reader kind, the queue order, the checksum.
Every engine reads experts through it (the numpy engine's transfer planner,
the torch consumer in the tests); nothing outside the store opens a block
file, reopens a descriptor or hashes an extent.

Reader kinds, behind the same four calls:

- ``"native"``: the native pool's C threads (:mod:`czyx.store.io.readpool`),
  which never take the GIL; a completion costs the engine nothing while it
  computes. The C readers hash each extent as they read it (where the
  store's checksum has a C entry point); :meth:`ExpertReads.check` compares
  it with the recorded checksum before first use.
- ``"threads"``: Python reader threads running the same reads (and the
  checksum) through a :class:`~czyx.store.io.iopaths.TransferSource`; used
  when the C build is missing, when asked for, and for extents without a
  file behind them (the consumer's own ``read_expert``: in-memory test
  consumers, quantized-in-memory models).

Queue order (both kinds): lower ``priority`` first, then submission order;
a prefetch (``demand=False``) waits while any demand read is outstanding
(the device's bandwidth is shared, and an engine blocked on a demand read
gains nothing from a concurrent speculative one).

A read no reader has started when the engine waits on it runs in the
waiting thread (a blocked engine gains nothing from a hand-off). Bytes are
never substituted: a short read, an I/O error, a replaced block file
(:class:`~czyx.store.io.iopaths.StaleSourceError`) or a checksum mismatch is
raised by :meth:`ExpertReads.check`, and the slot then holds nothing usable.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from czyx.errors import CzyxError
from czyx.store.consumer import ExpertExtent
from czyx.store.core.checksum import checksum
from czyx.store.errors import ChecksumError, ShortReadError, StoreError
from czyx.store.io import readpool
from czyx.store.io.iopaths import TransferSource, default_io_path, open_source

NATIVE = "native"
THREADS = "threads"
READER_KINDS = (NATIVE, THREADS)

#: The source name X-Ray reports for a read through the consumer's ``read_expert``.
CONSUMER_SOURCE = "consumer"


class ExpertExtentError(StoreError, ValueError):
    """An expert has no extent, or its extent does not fit the destination slot."""


class ExpertRead:
    """One read of one expert into one slot: the handle :meth:`ExpertReads.submit` returns.

    Times are ``time.monotonic_ns`` values (``None`` until they happen);
    ``checksum_result`` is ``"pending"``, ``"ok"``, ``"mismatch"`` or
    ``"consumer"`` (verified by the consumer's ``read_expert``). The fields
    are final once :meth:`ExpertReads.done` is True.
    """

    __slots__ = (
        "block",
        "checksum",
        "checksum_result",
        "claim",
        "cls",
        "completed_bytes",
        "demand",
        "error",
        "event",
        "layer",
        "nbytes",
        "offset",
        "pool",
        "read_hash",
        "seq",
        "slot",
        "source",
        "staging_copy_bytes",
        "t_complete",
        "t_first_byte",
        "t_start",
        "verified",
    )

    def __init__(self, layer: int, cls: int, slot: int, ext: ExpertExtent, demand: bool) -> None:
        self.layer = layer
        self.cls = cls
        self.slot = slot
        self.block = ext.block
        self.offset = ext.offset
        self.nbytes = ext.length
        self.checksum = ext.checksum
        self.demand = demand
        self.source = CONSUMER_SOURCE
        self.completed_bytes = 0
        self.staging_copy_bytes = 0
        self.checksum_result = "pending"
        self.error: BaseException | None = None
        self.t_start: int | None = None
        self.t_first_byte: int | None = None
        self.t_complete: int | None = None
        self.verified = False
        self.read_hash: int | None = None  # the native reader's checksum of the bytes
        # Python readers: the completion event and the claim (taken by whoever runs it).
        self.event: threading.Event | None = None
        self.claim: threading.Lock | None = None
        # Native reads: the pool and the job's sequence number.
        self.pool: readpool.ReadPool | None = None
        self.seq = -1


class ExpertReads:
    """Asynchronous, verified expert reads into a fixed arena of slots.

    Parameters
    ----------
    slots
        The destination slot views (``uint8``, equal sizes); at most one
        read in flight per slot.
    extent
        ``extent(layer, cls) -> ExpertExtent``: the consumer's resolution
        (portal checks included; its refusals propagate as raised).
    files
        Open descriptors of the consumer's block files, indexed by
        ``ExpertExtent.block``; the consumer keeps them open while this
        object lives. Each is reopened once through the chosen I/O path, and
        re-checked for replacement on every read. Empty: every extent is read
        through ``read_expert``.
    read_expert
        ``read_expert(layer, cls, dest)``: the consumer's own verified read,
        for extents with ``block < 0`` (no file behind them).
    readers
        Reader threads (>= 1).
    native
        Reader kind: None, the native C pool whenever it is built; True,
        require it (:class:`~czyx.store.io.readpool.ReadPoolUnavailableError`
        otherwise); False, Python threads.
    io
        An I/O path name (:data:`czyx.store.io.iopaths.PATHS`); None: the one
        ``czyx bench io`` measured fastest here, else buffered ``pread``.
    """

    #: The native readers hash each extent they read (False: :meth:`check` hashes it on
    #: the consumer's thread at first use; ``bench/bench_prefetch.py`` compares the two).
    hash_in_readers = True

    def __init__(
        self,
        slots: Sequence[np.ndarray],
        extent: Callable[[int, int], ExpertExtent],
        *,
        files: Sequence[int] = (),
        read_expert: Callable[[int, int, np.ndarray], None] | None = None,
        readers: int = 2,
        native: bool | None = None,
        io: str | None = None,
    ) -> None:
        if readers < 1:
            raise ValueError(f"readers: {readers} < 1")
        self.slots = list(slots)
        self.slot_nbytes = int(self.slots[0].size) if self.slots else 0
        self._extent = extent
        self._files = list(files)
        self._read_expert = read_expert
        self.readers = int(readers)
        self.io = io or default_io_path()
        if native and not readpool.available():
            raise readpool.ReadPoolUnavailableError(
                "native=True, but store._iopaths is not built (python setup.py build_ext --inplace)"
            )
        self.pool: readpool.ReadPool | None = None
        if native is not False and readpool.available() and self.slots and self._files:
            self.pool = readpool.ReadPool(len(self.slots), self.readers)
            self.pool.set_buffers(self.slots)
        #: The block files opened so far (on first use: an engine restricted by a
        #: portal opens nothing it never reads).
        self.sources: list[TransferSource | None] = [None] * len(self._files)
        self._pool_src: list[int] = [-1] * len(self._files)
        # Python readers (started on first use): demand reads overtake queued prefetches.
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._demand_lock = threading.Lock()
        self._demands = 0
        self._no_demand = threading.Event()
        self._no_demand.set()
        self._threads: list[threading.Thread] = []
        self._tid = 0
        self._closed = False

    @property
    def kind(self) -> str:
        """``"native"`` when file reads run on the C pool, else ``"threads"``."""
        return NATIVE if self.pool is not None else THREADS

    @property
    def python_threads(self) -> int:
        """Python reader threads started so far (0 while every read ran natively)."""
        return len(self._threads)

    def opened_sources(self) -> list[TransferSource]:
        """The block files opened so far, in first-use order of their index."""
        return [s for s in self.sources if s is not None]

    # ------------------------------------------------------------------ submit

    def _source(self, block: int) -> int:
        """Open block ``block`` through the I/O path (once); its index in the pool or -1."""
        if not 0 <= block < len(self._files):
            raise ExpertExtentError(f"block file {block} is not one of the consumer's")
        if self.sources[block] is None:
            # The consumer's descriptor, reopened: the same file even if renamed since; the
            # path is re-checked for replacement on every read.
            source = open_source(self.io, f"/proc/self/fd/{self._files[block]}")
            self.sources[block] = source
            if self.pool is not None and readpool.supports(source):
                self._pool_src[block] = self.pool.add_source(source)
        return self._pool_src[block]

    def submit(
        self, layer: int, cls: int, slot: int, *, priority: int = 0, demand: bool = True
    ) -> ExpertRead:
        """Start reading expert ``(layer, cls)`` into ``slot``; returns its :class:`ExpertRead`.

        The caller guarantees that ``slot`` is free (no read in flight into
        it, nobody using its bytes). ``cls`` is the router byte.

        Raises
        ------
        ExpertExtentError
            The consumer has no extent for it, or the extent does not fit a slot.
        CzyxError
            The consumer's refusal (a portal denial, audited by the portal).
        """
        try:
            ext = self._extent(layer, cls)
        except CzyxError:
            raise
        except (LookupError, ValueError) as exc:
            raise ExpertExtentError(f"expert (layer {layer}, {cls}) has no extent: {exc}") from exc
        n = int(ext.length)
        if n <= 0 or n > self.slot_nbytes:
            raise ExpertExtentError(
                f"expert (layer {layer}, {cls}): extent of {n} bytes does not fit a "
                f"{self.slot_nbytes}-byte slot"
            )
        r = ExpertRead(layer, cls, slot, ext, demand)
        if not self._files:
            # No files handed over (a wrapper consumer, an in-memory one): every extent
            # is read through the consumer's own verified read_expert.
            r.block = -1
        psrc = -1
        if r.block >= 0:
            psrc = self._source(ext.block)
            r.source = self.sources[ext.block].name
        elif self._read_expert is None:
            raise ExpertExtentError(
                f"expert (layer {layer}, {cls}) has no block file and the consumer no read_expert"
            )
        if psrc >= 0:
            hash_len = r.nbytes if self.hash_in_readers and self.pool.hashes else 0
            r.seq = self.pool.submit(
                slot, psrc, ext.offset, n, priority=priority, demand=demand, hash_len=hash_len
            )
            r.pool = self.pool
            return r
        r.event = threading.Event()
        r.claim = threading.Lock()
        if not self._threads:
            self._start_threads()
        if demand:
            with self._demand_lock:
                self._demands += 1
                self._no_demand.clear()
        self._tid += 1
        self._queue.put((priority, self._tid, r))
        return r

    # ------------------------------------------------------------------ completion

    def done(self, r: ExpertRead) -> bool:
        """Whether ``r``'s reader finished (successfully or not); never blocks."""
        if r.pool is not None:
            if r.t_complete is None and r.pool.done(r.slot, r.seq):
                self._collect(r)
            return r.t_complete is not None
        return r.event.is_set()

    def wait(self, r: ExpertRead) -> bool:
        """Block until ``r``'s reader finished; True if this call had to block.

        A read no reader has started runs here, in the calling thread. Not a
        verification: :meth:`check` is.
        """
        if r.pool is not None:
            if r.t_complete is not None:
                return False
            blocked = False
            if not r.pool.done(r.slot, r.seq):
                r.pool.wait(r.slot)  # without the GIL; an unstarted read runs here
                blocked = True
            self._collect(r)
            return blocked
        if r.event.is_set():
            return False
        if r.claim.acquire(False):  # no reader has started it: run it here
            self._execute(r)
        r.event.wait()
        return True

    def check(self, r: ExpertRead) -> None:
        """Verify a finished read (once) and raise its typed error, if any.

        Raises
        ------
        ShortReadError, ReadIOError, StaleSourceError, ChecksumError
            The slot's bytes are not the expert's and must not be used.
        """
        if r.error is None and not r.verified:
            r.verified = True
            if r.pool is not None:  # (a Python reader verified in _run)
                r.error = self._check_sum(r)
        if r.error is not None:
            raise r.error

    def _collect(self, r: ExpertRead) -> None:
        """Copy a finished native read's results (times, bytes, read error) into ``r``."""
        timing = r.pool.timing(r.slot)
        r.t_start = timing.start_ns or None
        r.t_first_byte = timing.first_ns
        r.t_complete = timing.done_ns or time.monotonic_ns()
        r.completed_bytes = min(timing.nbytes, r.nbytes)
        r.read_hash = r.pool.hashed(r.slot)
        if self.sources[r.block].staging_copy:
            r.staging_copy_bytes = timing.nbytes
        try:
            r.pool.check(r.slot)
        except BaseException as exc:
            r.error = exc

    def _check_sum(self, r: ExpertRead) -> ChecksumError | None:
        """Compare the slot's bytes with the extent's recorded checksum; record the result.

        The native reader's hash of them where it took one (the bytes are unchanged since:
        nothing writes a slot while its transfer is unused), else hashed here."""
        got = r.read_hash
        if got is None:
            got = checksum(self.slots[r.slot][: r.nbytes])
        if got == r.checksum:
            r.checksum_result = "ok"
            return None
        r.checksum_result = "mismatch"
        return ChecksumError(
            f"{self.sources[r.block].identity.path}: expert (layer {r.layer}, {r.cls}) at "
            f"offset {r.offset}: checksum {got:016x} != recorded {r.checksum:016x}"
        )

    # ------------------------------------------------------------------ Python readers

    def _start_threads(self) -> None:
        self._threads = [
            threading.Thread(target=self._worker, name=f"czyx-reader-{i}", daemon=True)
            for i in range(self.readers)
        ]
        for th in self._threads:
            th.start()

    def _worker(self) -> None:
        while True:
            _, _, r = self._queue.get()
            if r is None:
                return
            if not r.demand:
                # Bounded: a demand read nobody waits for must not park the readers.
                self._no_demand.wait(0.1)
            if r.claim.acquire(False):  # else the engine already ran it
                self._execute(r)

    def _execute(self, r: ExpertRead) -> None:
        """Run ``r`` once (by a reader, or by an engine that stopped waiting for one)."""
        try:
            self._run(r)
        except BaseException as exc:  # recorded, raised to the engine by check()
            r.error = exc
            if r.t_complete is None:
                r.t_complete = time.monotonic_ns()
        finally:
            r.verified = True
            if r.demand:
                with self._demand_lock:
                    self._demands -= 1
                    if not self._demands:
                        self._no_demand.set()
            r.event.set()

    def _run(self, r: ExpertRead) -> None:
        dest = self.slots[r.slot]
        r.t_start = time.monotonic_ns()
        if r.block < 0:
            self._read_expert(r.layer, r.cls, dest)
            r.t_complete = r.t_first_byte = time.monotonic_ns()
            r.staging_copy_bytes = r.nbytes  # unknown path: declared as a copy
            r.completed_bytes = r.nbytes
            r.checksum_result = "consumer"
            return
        source = self.sources[r.block]
        timing = source.read_into(r.offset, r.nbytes, dest)
        r.t_first_byte = timing.first_ns
        r.completed_bytes = min(timing.nbytes, r.nbytes)
        if source.staging_copy:
            r.staging_copy_bytes = timing.nbytes
        source.check_identity()
        error = self._check_sum(r)
        r.t_complete = time.monotonic_ns()
        if error is not None:
            raise error

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Stop the readers and close the block files (idempotent).

        The caller waits for the reads it needs first; queued native reads
        are dropped, queued Python reads are finished.
        """
        if self._closed:
            return
        self._closed = True
        for i, _ in enumerate(self._threads):
            self._queue.put((1 << 30, -1 - i, None))
        for th in self._threads:
            th.join()
        self._threads = []
        if self.pool is not None:
            self.pool.close()
        for s in self.sources:
            if s is not None:
                with contextlib.suppress(OSError):
                    s.close()

    def __enter__(self) -> ExpertReads:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # No __del__: owners close it (the planner does in its own close); the native
    # pool and the sources free themselves when collected.


def pread_expert(fd: int, path: object, ext: ExpertExtent, slot: np.ndarray) -> None:
    """Buffered, verified read of extent ``ext`` of the file ``fd`` into ``slot``.

    The plain ``read_expert`` of single-file consumers (the synthetic models):
    one ``preadv``, then the extent's checksum. ``path`` only names the file in
    errors.

    Raises
    ------
    ShortReadError
        The file ended before the extent did.
    ChecksumError
        The bytes read do not match the extent's checksum.
    """
    got = os.preadv(fd, [memoryview(slot)[: ext.length]], ext.offset)
    if got != ext.length:
        raise ShortReadError(str(path), ext.offset, ext.length, got)
    if checksum(slot[: ext.length]) != ext.checksum:
        raise ChecksumError(f"{path}: checksum mismatch at offset {ext.offset}")


class BlockFileExperts:
    """Mixin for a consumer whose extents index open block-file descriptors.

    The consumer gives :meth:`expert_fds` (``ExpertExtent.block`` indexes it)
    and ``expert_extent`` / ``read_expert``; this gives it the store's
    expert-read interface over those files.
    """

    def expert_fds(self) -> list[int]:
        """Open descriptors of the block files, indexed by ``ExpertExtent.block``."""
        raise NotImplementedError

    def open_expert_reads(
        self,
        slots: Sequence[np.ndarray],
        *,
        readers: int = 2,
        native: bool | None = None,
        io: str | None = None,
    ) -> ExpertReads:
        """The expert-read interface onto this consumer's block files (see ``ExpertReads``)."""
        return ExpertReads(
            slots,
            self.expert_extent,  # type: ignore[attr-defined]
            files=self.expert_fds(),
            read_expert=getattr(self, "read_expert", None),
            readers=readers,
            native=native,
            io=io,
        )


def open_expert_reads(
    consumer: object,
    slots: Sequence[np.ndarray],
    *,
    readers: int = 2,
    native: bool | None = None,
    io: str | None = None,
) -> ExpertReads:
    """The expert-read interface onto ``consumer`` (a :class:`ModelConsumer`).

    A consumer with block files offers ``open_expert_reads(slots, ...)``
    itself (it knows its descriptors); any other consumer is read through
    its ``read_expert`` on Python reader threads, behind the same calls.
    """
    opener = getattr(consumer, "open_expert_reads", None)
    if opener is not None:
        return opener(slots, readers=readers, native=native, io=io)
    return ExpertReads(
        slots,
        consumer.expert_extent,  # type: ignore[attr-defined]
        read_expert=consumer.read_expert,  # type: ignore[attr-defined]
        readers=readers,
        native=native,
        io=io,
    )


__all__ = [
    "CONSUMER_SOURCE",
    "NATIVE",
    "READER_KINDS",
    "THREADS",
    "BlockFileExperts",
    "ExpertExtentError",
    "ExpertRead",
    "ExpertReads",
    "open_expert_reads",
]
