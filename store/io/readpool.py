"""The native read pool: reader threads in C that never hold Python's GIL.

Scope: :class:`ReadPool`, the Python face of ``czyx_pool_*`` (``readpool.c``,
compiled into :mod:`store._iopaths`). One job per destination slot; a job
reads an extent of a registered :class:`~store.iopaths.TransferSource`
(``pread``, ``direct``, ``mmap`` or ``io_uring``) straight into the slot,
re-checks the source file's identity, and is marked done in C. Python code
runs only to submit and to collect a result, never on the reader threads,
so the consumer computing in Python and the readers do not take turns at
the GIL. (With Python reader threads each completion needs the GIL, which a
consumer running small numpy operations holds most of the time.)

The extent's checksum is not verified here: :meth:`ReadPool.result` returns
the bytes' timing and the caller verifies before use
(:class:`inference.planner.TransferPlanner` does, at first use). A read
submitted with a ``hash_len`` is hashed by the reader thread that read it
(the store's checksum, :func:`~czyx.store.core.checksum.native_checksum`), so
that verification compares :meth:`ReadPool.hashed` instead of passing over
the extent on the consumer's thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np

from czyx.store.core.checksum import native_checksum
from czyx.store.errors import ReadIOError, ShortReadError, StoreError
from czyx.store.io.iopaths import (
    DirectSource,
    IoUringSource,
    MmapSource,
    PreadSource,
    ReadTiming,
    StaleSourceError,
    TransferSource,
)

try:
    from czyx.store.io import _iopaths as _c
except ImportError:  # not built: the planner falls back to Python reader threads
    _c = None

QUEUED, RUNNING, DONE = 1, 2, 3
_KIND = {PreadSource: 0, DirectSource: 0, MmapSource: 1, IoUringSource: 2}
# readpool.c's identity codes: the open file was rewritten, or the path names another
# file or none. The source's own check then raises with the facts in its message.
_STALE = (-100001, -100002, -100003)

#: Hooks called with every new pool (fault-injection tests pause them: a slow device).
on_new_pool: list[Callable[[ReadPool], None]] = []


class ReadPoolUnavailableError(StoreError):
    """The native pool is not built (``python setup.py build_ext --inplace``)."""


def available() -> bool:
    """Whether the native pool is built."""
    return _c is not None


def supports(source: TransferSource) -> bool:
    """Whether the pool can run reads of ``source`` (the four C transfer paths)."""
    return _c is not None and type(source) in _KIND


class ReadPool:
    """``threads`` C reader threads serving ``n_jobs`` job slots.

    Parameters
    ----------
    n_jobs
        Job indices ``0..n_jobs-1`` (the planner's destination slots: at most
        one read in flight per slot).
    threads
        Reader threads.

    Raises
    ------
    ReadPoolUnavailableError
        The C module is not built.
    """

    def __init__(self, n_jobs: int, threads: int) -> None:
        if _c is None:
            raise ReadPoolUnavailableError("store._iopaths is not built")
        if n_jobs < 1 or threads < 1:
            raise ValueError(f"n_jobs {n_jobs} and threads {threads} must be >= 1")
        err = _c.ffi.new("int *")
        pool = _c.lib.czyx_pool_new(n_jobs, threads, 1, err)
        if pool == _c.ffi.NULL:
            raise OSError(err[0], f"native read pool: cannot start {threads} threads")
        self._pool = pool
        hash_fn = native_checksum()
        #: Whether reads submitted with a ``hash_len`` are hashed by the readers.
        self.hashes = hash_fn is not None
        if self.hashes:
            _c.lib.czyx_pool_set_hash(pool, _c.ffi.cast("void *", hash_fn))
        self.n_jobs = int(n_jobs)
        self.threads = int(threads)
        self.sources: list[TransferSource] = []
        self._bufs: list[object] = [None] * self.n_jobs  # keeps each destination alive
        self._jobs = [_c.lib.czyx_pool_job(pool, j) for j in range(self.n_jobs)]
        self._wanted = np.zeros(self.n_jobs, np.int64)
        # Registered destinations (set_buffers): pointer, address and size per job.
        self._ptr: list[object] | None = None
        self._addr: list[int] = []
        self._size: list[int] = []
        for hook in on_new_pool:
            hook(self)

    def add_source(self, source: TransferSource) -> int:
        """Register ``source``; returns its index for :meth:`submit`."""
        kind = _KIND.get(type(source))
        if kind is None:
            raise ValueError(f"the native pool cannot read a {type(source).__name__}")
        ident = source.identity
        direct = bool(source.direct)
        base = getattr(source, "_base", None) if kind == 1 else None
        idx = _c.lib.czyx_pool_add_source(
            self._pool,
            kind,
            source._dfd if direct else source._fd,
            int(direct),
            source.align,
            source._fd,
            base if base is not None else _c.ffi.NULL,
            getattr(source, "_size", 0) if kind == 1 else 0,
            ident.dev,
            ident.ino,
            ident.size,
            ident.mtime_ns,
            ident.path.encode(),
        )
        if idx < 0:
            raise OSError(-idx, f"native read pool: cannot register {source.path}")
        self.sources.append(source)
        return int(idx)

    def set_buffers(self, buffers: list[np.ndarray]) -> None:
        """Register each job's destination once (the planner's slots): ``submit`` then
        needs no buffer and does its alignment checks by arithmetic.

        Raises
        ------
        ValueError
            Not one writable, contiguous 1-D uint8 array per job.
        """
        if len(buffers) != self.n_jobs:
            raise ValueError(f"{len(buffers)} buffers for {self.n_jobs} jobs")
        for b in buffers:
            if not isinstance(b, np.ndarray) or b.dtype != np.uint8 or b.ndim != 1:
                raise ValueError("buffers: each must be a 1-D uint8 numpy array")
            if not b.flags.writeable or not b.flags.c_contiguous:
                raise ValueError("buffers: each must be writable and contiguous")
        self._bufs = list(buffers)  # kept alive while the pool may write into them
        self._ptr = [_c.ffi.from_buffer(b) for b in buffers]
        self._addr = [b.__array_interface__["data"][0] for b in buffers]
        self._size = [b.size for b in buffers]

    def submit(
        self,
        job: int,
        src: int,
        offset: int,
        length: int,
        dest: np.ndarray | None = None,
        *,
        priority: int = 0,
        demand: bool = True,
        hash_len: int = 0,
    ) -> int:
        """Queue a read of ``length`` bytes at ``offset`` of source ``src`` into ``dest``.

        ``dest`` None: the job's registered buffer (:meth:`set_buffers`).
        ``hash_len`` > 0 (at most ``length``): the reader also hashes the first
        ``hash_len`` bytes read (:meth:`hashed`), where the pool :attr:`hashes`.
        Direct paths read ``length`` rounded up to the alignment, as
        :meth:`TransferSource.read_into` does. Returns the job's sequence number.

        Raises
        ------
        AlignmentError, ValueError
            The destination breaks the source's contract.
        StoreError
            The job is still queued or running.
        """
        source = self.sources[src]
        if dest is not None:
            n = source._check_request(offset, length, dest)
            buf = _c.ffi.from_buffer(dest)
        elif self._ptr is not None:
            n = source.check_extent(offset, length, self._addr[job], self._size[job])
            buf = self._ptr[job]
        else:
            raise ValueError(f"job {job}: no destination given and none registered")
        rc = _c.lib.czyx_pool_submit(
            self._pool, job, src, offset, n, buf, priority, demand, hash_len
        )
        if rc:
            raise StoreError(f"native read pool: job {job} cannot be submitted (rc {rc})")
        if dest is not None:
            self._bufs[job] = buf
        self._wanted[job] = length
        return int(self._jobs[job].seq)

    def done(self, job: int, seq: int) -> bool:
        """Whether submission ``seq`` of ``job`` has finished (or was superseded)."""
        j = self._jobs[job]
        return j.seq != seq or _c.lib.czyx_pool_state(self._pool, job) == DONE

    def wait(self, job: int) -> bool:
        """Block (without the GIL) until ``job`` is done; True if this thread ran it."""
        rc = _c.lib.czyx_pool_wait(self._pool, job)
        if rc < 0:
            raise StoreError(f"native read pool: job {job} was never submitted")
        return rc == 1

    def timing(self, job: int) -> ReadTiming:
        """The finished ``job``'s times and bytes read, whatever its outcome (0: never)."""
        j = self._jobs[job]
        return ReadTiming(
            int(j.t_start_ns), int(j.t_first_ns) or None, int(j.t_done_ns), int(j.done)
        )

    def hashed(self, job: int) -> int | None:
        """The checksum the reader took of the finished ``job``'s bytes, or None (not asked,
        no hash function, or the read failed: :meth:`check` says how)."""
        j = self._jobs[job]
        return int(j.hash) if j.hash_len > 0 else None

    def check(self, job: int) -> None:
        """Raise the finished ``job``'s typed error, if it has one.

        Raises
        ------
        ShortReadError, ReadIOError, StaleSourceError
        """
        j = self._jobs[job]
        src = self.sources[j.src]
        err, done, wanted = int(j.err), int(j.done), int(self._wanted[job])
        # The order of TransferSource.read_into: an I/O error, a short read, then identity.
        if err and err not in _STALE:
            raise ReadIOError(-err, src.path, int(j.offset), int(j.length))
        if done < wanted:
            raise ShortReadError(src.path, int(j.offset), wanted, done)
        if err:
            src.check_identity()  # raises with the facts (sizes, inodes) in its message
            raise StaleSourceError(f"{src.path}: stale: the file changed during the read")

    def result(self, job: int) -> ReadTiming:
        """The finished ``job``'s timing, or its typed error (:meth:`check`)."""
        self.check(job)
        return self.timing(job)

    def pause(self, paused: bool) -> None:
        """Hold queued reads (True) or release them (False); a waiter on a held read blocks."""
        if self._pool is not None:
            _c.lib.czyx_pool_pause(self._pool, int(paused))

    def close(self) -> None:
        """Stop the threads (after the reads they are running) and free the pool (idempotent).

        Reads still queued are dropped; callers wait for what they need first.
        """
        pool, self._pool = getattr(self, "_pool", None), None
        if pool is not None:
            _c.lib.czyx_pool_free(pool)
            self._bufs = [None] * self.n_jobs
            self._ptr = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
