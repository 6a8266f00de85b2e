"""Transfer sources: one interface over the Linux I/O paths that fill a slot from a file.

Scope: :class:`TransferSource` (``read_into(offset, length, dest)``, a batch
``read_many``, an identity check, timing of every transfer) and its four
implementations, selected by name:

``"pread"``
    buffered ``pread`` (page cache, then a copy into the slot);
``"mmap"``
    the file mapped once, ``madvise(MADV_WILLNEED)`` over the extent, then a
    copy into the slot (the copy is the declared staging step of this path);
``"direct"``
    ``O_DIRECT`` ``pread`` straight into the (aligned) slot;
``"io_uring"``
    ``IORING_OP_READ`` on an ``O_DIRECT`` descriptor through the raw system
    calls, ``queue_depth`` requests in flight for a batch. Where the kernel
    refuses (``ENOSYS``: too old; ``EPERM``: disabled by
    ``kernel.io_uring_disabled`` or a seccomp filter) :func:`probe_io_uring`
    says so and opening the source raises :class:`IOPathUnavailableError`
    with that reason.

Which path is fastest is measured (``czyx bench io``), recorded in a small
JSON config (:func:`save_io_config`) and read by the engine
(:func:`default_io_path`). With none recorded, reads are buffered, but where the
caller's slots are the only cache the experts can have (a model bigger than the
memory left): ``O_DIRECT`` where the files allow it.

Contracts (fail closed): a transfer fills ``dest[:length]`` completely or
raises (:class:`~store.errors.ShortReadError`,
:class:`~store.errors.ReadIOError`); a direct path refuses a misaligned
offset or destination (:class:`AlignmentError`) instead of silently going
through the page cache; :meth:`TransferSource.check_identity` refuses a file
that was replaced, grown, truncated or rewritten since the source was opened
(:class:`StaleSourceError`). Reading a mapping past end of file would raise
SIGBUS, so the mmap path checks the current size before each copy.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from czyx.store.errors import BlockFileError, ReadIOError, ShortReadError, StoreError
from czyx.store.io.fdowner import FdOwner, close_fds

try:
    from czyx.store.io import _iopaths as _c
except ImportError as _exc:  # not built in place: Python fallbacks, io_uring unavailable
    _c = None
    _C_ERROR: str | None = str(_exc)
else:
    _C_ERROR = None

PATHS = ("pread", "mmap", "direct", "io_uring")
_warned = False


def _warn_fallback() -> None:
    global _warned
    if _c is None and not _warned:
        _warned = True
        warnings.warn(
            f"store: C transfer kernels unavailable ({_C_ERROR}); pread, mmap and direct "
            "use slower Python loops and io_uring is unavailable. Build them with "
            "`python setup.py build_ext --inplace`.",
            RuntimeWarning,
            stacklevel=3,
        )


DIRECT_ALIGN = 4096
CONFIG_ENV = "CZYX_IO_CONFIG"


class IOPathUnavailableError(StoreError):
    """The requested I/O path cannot run here (the reason names the kernel or build fact)."""


class AlignmentError(StoreError, ValueError):
    """A direct transfer's offset, length or destination address breaks the alignment contract."""


class StaleSourceError(BlockFileError):
    """The file behind a source changed since it was opened (replaced, resized or rewritten)."""


@dataclass(frozen=True)
class ReadTiming:
    """When a transfer's bytes arrived (``time.monotonic_ns`` clock).

    ``first_ns`` is when the first read returned data (equal to ``done_ns``
    when one system call carried the whole extent); ``None`` when no byte
    arrived or the path cannot observe it.
    """

    start_ns: int
    first_ns: int | None
    done_ns: int
    nbytes: int


@dataclass(frozen=True)
class SourceIdentity:
    """What a source remembers about its file at open: any change makes it stale."""

    path: str
    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of_fd(cls, path: str, fd: int) -> SourceIdentity:
        """The identity of the open file ``fd`` (named ``path``)."""
        st = os.fstat(fd)
        return cls(path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def probe_io_uring(entries: int = 8) -> tuple[bool, str]:
    """Whether an io_uring ring can be created here, and why not.

    Returns
    -------
    (bool, str)
        ``(True, "available ...")`` or ``(False, reason)``; the reason names
        the errno and, for ``EPERM``, the ``kernel.io_uring_disabled`` value.
    """
    if _c is None:
        return False, f"the C transfer kernels are not built ({_C_ERROR})"
    err = _c.ffi.new("int *")
    ring = _c.lib.czyx_uring_open(entries, err)
    if ring == _c.ffi.NULL:
        code = err[0]
        why = f"io_uring_setup({entries}) failed: [errno {code}] {os.strerror(code)}"
        if code == 38:  # ENOSYS
            why += " (kernel built without io_uring, or older than 5.1)"
        elif code == 1:  # EPERM
            sysctl = "?"
            with contextlib.suppress(OSError):
                sysctl = Path("/proc/sys/kernel/io_uring_disabled").read_text().strip()
            why += f" (kernel.io_uring_disabled={sysctl}, or a seccomp filter)"
        return False, why
    n = _c.lib.czyx_uring_entries(ring)
    _c.lib.czyx_uring_close(ring)
    return True, f"available (ring of {n} entries, kernel {os.uname().release})"


def drop_file_cache(path: str | os.PathLike) -> None:
    """Evict ``path`` from the page cache (``POSIX_FADV_DONTNEED``) for a cold measurement."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class TransferSource(FdOwner):
    """Fills caller-owned destinations with a file's bytes through one I/O path.

    Parameters
    ----------
    path
        The file (for example a block file, or ``/proc/self/fd/N`` to reopen
        a descriptor another object owns).
    align
        Direct-I/O alignment of offsets, lengths and destination addresses.

    Notes
    -----
    Safe to share between threads: every call is positional; per-thread
    state (the C transfer record, an io_uring ring) lives in thread-local
    storage.
    """

    name = "abstract"
    direct = False
    #: Whether the bytes pass through the page cache and are then copied into
    #: the slot (pread: by the kernel; mmap: by memcpy). Reported by X-Ray as
    #: staging-copy bytes, so no staging copy goes undeclared.
    staging_copy = True

    def __init__(self, path: str | os.PathLike, *, align: int = DIRECT_ALIGN) -> None:
        if align < 512 or align & (align - 1):
            raise ValueError(f"align: {align} is not a power of two >= 512")
        _warn_fallback()
        self.path = os.fspath(path)
        self.align = align
        self._local = threading.local()
        self._fd = self._dfd = -1
        try:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            if self.direct:
                self._dfd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
        except OSError as exc:
            self.close()
            raise ReadIOError(exc.errno or 0, self.path, 0, 0) from exc
        # The name to re-stat for replacement: a /proc/self/fd link resolves to the file,
        # or to "NAME (deleted)" when it was replaced or removed after its owner opened it.
        real = os.path.realpath(self.path)
        if real.endswith(" (deleted)"):
            self.close()
            raise StaleSourceError(
                f"{real[: -len(' (deleted)')]}: stale: the file was replaced or removed "
                "after it was opened"
            )
        self.identity = SourceIdentity.of_fd(real, self._fd)
        self.path = real  # errors name the file, not the /proc/self/fd link

    # -- identity ----------------------------------------------------------------------
    def check_identity(self) -> None:
        """Refuse a file that changed since open: two ``stat`` calls.

        Raises
        ------
        StaleSourceError
            The path now names another file (replaced, deleted), or the open
            file's size or modification time changed (truncated, grown, rewritten).
        """
        ident = self.identity
        st = os.fstat(self._fd)
        if st.st_size != ident.size or st.st_mtime_ns != ident.mtime_ns:
            raise StaleSourceError(
                f"{ident.path}: stale: size {st.st_size} / mtime {st.st_mtime_ns} ns, "
                f"opened with {ident.size} / {ident.mtime_ns} ns (rewritten after mount)"
            )
        try:
            now = os.stat(ident.path)
        except FileNotFoundError as exc:
            raise StaleSourceError(
                f"{ident.path}: stale: the file was replaced or removed"
            ) from exc
        if (now.st_dev, now.st_ino) != (ident.dev, ident.ino):
            raise StaleSourceError(
                f"{ident.path}: stale: the path now names inode {now.st_ino}, "
                f"opened inode {ident.ino} (the file was replaced)"
            )

    # -- transfers ---------------------------------------------------------------------
    def _xfer(self):
        x = getattr(self._local, "x", None)
        if x is None:
            x = self._local.x = _c.ffi.new("czyx_xfer *")
        return x

    def _check_request(self, offset: int, length: int, dest: np.ndarray) -> int:
        if not isinstance(dest, np.ndarray) or dest.dtype != np.uint8 or dest.ndim != 1:
            raise ValueError("dest: must be a 1-D uint8 numpy array (a slot view)")
        if not dest.flags.writeable or not dest.flags.c_contiguous:
            raise ValueError("dest: must be writable and contiguous")
        return self.check_extent(offset, length, dest.__array_interface__["data"][0], dest.size)

    def check_extent(self, offset: int, length: int, addr: int, size: int) -> int:
        """Bytes to read for ``length`` at ``offset`` into ``size`` bytes at ``addr``.

        Direct paths round ``length`` up to the alignment (block files are
        padded) and need ``offset`` and ``addr`` aligned. Arithmetic only: the
        native pool checks registered destinations with it on every submit.

        Raises
        ------
        AlignmentError, ValueError
        """
        if offset < 0 or length < 0:
            raise ValueError(f"{self.path}: negative offset {offset} or length {length}")
        n = length
        if self.direct:
            if offset % self.align or addr % self.align:
                raise AlignmentError(
                    f"{self.path}: {self.name} transfer at offset {offset} into address "
                    f"{addr:#x}: both must be multiples of {self.align}"
                )
            n = -(-length // self.align) * self.align
        if n > size:
            raise AlignmentError(
                f"{self.path}: {self.name} transfer of {n} bytes does not fit its "
                f"{size}-byte destination"
            )
        return n

    def read_into(self, offset: int, length: int, dest: np.ndarray) -> ReadTiming:
        """Fill ``dest[:length]`` with the bytes at ``offset``, or raise.

        Direct paths read ``length`` rounded up to the alignment (the
        destination must have room: slots are padded).

        Raises
        ------
        ShortReadError, ReadIOError, AlignmentError
        """
        n = self._check_request(offset, length, dest)
        t = self._read(offset, n, dest)
        if t.nbytes < length:
            raise ShortReadError(self.path, offset, length, t.nbytes)
        return t

    def read_many(self, requests: Sequence[tuple[int, int, np.ndarray]]) -> list[ReadTiming]:
        """Read a batch of ``(offset, length, dest)``; the default issues them in order."""
        return [self.read_into(o, n, d) for o, n, d in requests]

    def _read(self, offset: int, n: int, dest: np.ndarray) -> ReadTiming:
        raise NotImplementedError

    def _finish(self, x, offset: int, n: int) -> ReadTiming:
        if x.err:
            raise ReadIOError(-int(x.err), self.path, offset, n)
        first = int(x.t_first_ns) or None
        return ReadTiming(0, first, int(x.t_done_ns), int(x.done))

    def close(self) -> None:
        """Close the descriptors (idempotent)."""
        close_fds(self, ("_dfd", "_fd"))


class _PreadBase(TransferSource):
    def _read(self, offset: int, n: int, dest: np.ndarray) -> ReadTiming:
        fd = self._dfd if self.direct else self._fd
        if _c is None:
            return _py_pread(fd, offset, n, dest, self.align if self.direct else 0)
        x = self._xfer()
        x.offset, x.length = offset, n
        x.buf = _c.ffi.from_buffer(dest)
        t0 = time.monotonic_ns()
        _c.lib.czyx_pread_xfer(fd, int(self.direct), self.align, x)
        t = self._finish(x, offset, n)
        return ReadTiming(t0, t.first_ns, t.done_ns, t.nbytes)


class PreadSource(_PreadBase):
    """Buffered ``pread``: through the page cache, then copied into the slot by the kernel."""

    name = "pread"


class DirectSource(_PreadBase):
    """``O_DIRECT`` ``pread`` into the aligned slot itself: no page cache, no staging copy."""

    name = "direct"
    direct = True
    staging_copy = False


class MmapSource(TransferSource):
    """The file mapped once; ``MADV_WILLNEED`` over the extent, then a copy into the slot."""

    name = "mmap"

    def __init__(self, path: str | os.PathLike, *, align: int = DIRECT_ALIGN) -> None:
        super().__init__(path, align=align)
        self._size = self.identity.size
        self._base = None
        self._mm = None
        if self._size == 0:
            return
        if _c is not None:
            err = _c.ffi.new("int *")
            base = _c.lib.czyx_map(self._fd, self._size, err)
            if base == _c.ffi.NULL:
                raise ReadIOError(err[0], self.path, 0, self._size)
            self._base = base
        else:
            self._mm = mmap.mmap(self._fd, self._size, prot=mmap.PROT_READ)

    def _read(self, offset: int, n: int, dest: np.ndarray) -> ReadTiming:
        t0 = time.monotonic_ns()
        if self._base is None and self._mm is None:
            return ReadTiming(t0, None, time.monotonic_ns(), 0)
        if _c is None:
            size = min(os.fstat(self._fd).st_size, self._size)  # SIGBUS guard
            k = max(0, min(n, size - offset))
            if k:
                lo = offset - offset % mmap.PAGESIZE
                self._mm.madvise(mmap.MADV_WILLNEED, lo, offset + k - lo)
                dest[:k] = np.frombuffer(self._mm, np.uint8, k, offset)
            t1 = time.monotonic_ns()
            return ReadTiming(t0, t1 if k else None, t1, k)
        x = self._xfer()
        x.offset, x.length = offset, n
        x.buf = _c.ffi.from_buffer(dest)
        _c.lib.czyx_mmap_copy(self._fd, self._base, self._size, x, 1)
        t = self._finish(x, offset, n)
        return ReadTiming(t0, t.first_ns, t.done_ns, t.nbytes)

    def close(self) -> None:
        """Unmap and close (idempotent)."""
        if getattr(self, "_base", None) is not None:
            _c.lib.czyx_unmap(self._base, self._size)
            self._base = None
        if getattr(self, "_mm", None) is not None:
            self._mm.close()
            self._mm = None
        super().close()


class IoUringSource(TransferSource):
    """io_uring ``IORING_OP_READ`` on an ``O_DIRECT`` descriptor, one ring per thread.

    Parameters
    ----------
    queue_depth
        Requests in flight in :meth:`read_many` (a single :meth:`read_into`
        has one).

    Raises
    ------
    IOPathUnavailableError
        When the kernel (or the build) cannot create a ring; the message is
        :func:`probe_io_uring`'s reason.
    """

    name = "io_uring"
    direct = True
    staging_copy = False

    def __init__(
        self, path: str | os.PathLike, *, align: int = DIRECT_ALIGN, queue_depth: int = 16
    ) -> None:
        ok, why = probe_io_uring(max(queue_depth, 1))
        if not ok:
            raise IOPathUnavailableError(f"io_uring: {why}")
        super().__init__(path, align=align)
        self.queue_depth = max(int(queue_depth), 1)
        self._rings: list = []
        self._lock = threading.Lock()

    def _ring(self):
        ring = getattr(self._local, "ring", None)
        if ring is None:
            err = _c.ffi.new("int *")
            ring = _c.lib.czyx_uring_open(self.queue_depth, err)
            if ring == _c.ffi.NULL:
                raise IOPathUnavailableError(f"io_uring: [errno {err[0]}] {os.strerror(err[0])}")
            self._local.ring = ring
            with self._lock:
                self._rings.append(ring)
        return ring

    def _read(self, offset: int, n: int, dest: np.ndarray) -> ReadTiming:
        x = self._xfer()
        x.offset, x.length = offset, n
        x.buf = _c.ffi.from_buffer(dest)
        t0 = time.monotonic_ns()
        _c.lib.czyx_uring_read(self._ring(), self._dfd, 1, self.align, x, 1)
        t = self._finish(x, offset, n)
        return ReadTiming(t0, t.first_ns, t.done_ns, t.nbytes)

    def read_many(self, requests: Sequence[tuple[int, int, np.ndarray]]) -> list[ReadTiming]:
        """Read a batch, ``queue_depth`` requests in flight; raises for the first bad one."""
        k = len(requests)
        if not k:
            return []
        xs = _c.ffi.new("czyx_xfer[]", k)
        keep = []
        wants = []
        for i, (off, length, dest) in enumerate(requests):
            n = self._check_request(off, length, dest)
            buf = _c.ffi.from_buffer(dest)
            keep.append(buf)
            xs[i].offset, xs[i].length, xs[i].buf = off, n, buf
            wants.append(length)
        t0 = time.monotonic_ns()
        _c.lib.czyx_uring_read(self._ring(), self._dfd, 1, self.align, xs, k)
        out = []
        for i in range(k):
            t = self._finish(xs[i], requests[i][0], int(xs[i].length))
            if t.nbytes < wants[i]:
                raise ShortReadError(self.path, requests[i][0], wants[i], t.nbytes)
            out.append(ReadTiming(t0, t.first_ns, t.done_ns, t.nbytes))
        return out

    def close(self) -> None:
        """Close every thread's ring and the descriptors (idempotent)."""
        for ring in getattr(self, "_rings", []):
            _c.lib.czyx_uring_close(ring)
        self._rings = []
        super().close()


_SOURCES: dict[str, type[TransferSource]] = {
    "pread": PreadSource,
    "mmap": MmapSource,
    "direct": DirectSource,
    "io_uring": IoUringSource,
}


def open_source(kind: str, path: str | os.PathLike, **kw: int) -> TransferSource:
    """Open ``path`` through the I/O path named ``kind`` (one of :data:`PATHS`)."""
    if kind not in _SOURCES:
        raise ValueError(f"I/O path {kind!r} is not one of {PATHS}")
    if kind != "io_uring":
        kw.pop("queue_depth", None)
    return _SOURCES[kind](path, **kw)


def available_paths() -> dict[str, str]:
    """Every path with ``"available"`` or the reason it cannot run here."""
    out = {k: "available" for k in PATHS}
    ok, why = probe_io_uring()
    if not ok:
        out["io_uring"] = why
    return out


def _py_pread(fd: int, offset: int, n: int, dest: np.ndarray, direct_align: int) -> ReadTiming:
    """The pure-Python pread loop (no C build): same contract, first byte observed."""
    mv = memoryview(dest)[:n]
    t0 = time.monotonic_ns()
    first = None
    done = 0
    while done < n:
        try:
            r = os.preadv(fd, [mv[done:]], offset + done)
        except InterruptedError:
            continue
        except OSError as exc:
            raise ReadIOError(exc.errno or 5, f"fd {fd}", offset, n) from exc
        if r == 0:
            break
        first = first or time.monotonic_ns()
        done += r
        if direct_align and r % direct_align:
            break
    return ReadTiming(t0, first, time.monotonic_ns(), done)


# -- the measured choice -----------------------------------------------------------------


@dataclass(frozen=True)
class IOConfig:
    """The I/O path ``czyx bench io`` measured fastest here, and what it measured."""

    path: str
    bandwidth: float  # bytes/s of the winner (cold, the engine's request size)
    request_bytes: int
    measured: dict[str, float]  # path -> bytes/s
    unavailable: dict[str, str]  # path -> reason
    machine: str


def config_path() -> Path:
    """Where the measured config lives: ``$CZYX_IO_CONFIG`` or ``~/.config/czyx/io.json``."""
    env = os.environ.get(CONFIG_ENV)
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config")) / "czyx" / "io.json"


def save_io_config(cfg: IOConfig, path: str | os.PathLike | None = None) -> Path:
    """Write ``cfg`` as JSON (atomically: temp file then rename); returns the path."""
    p = Path(path) if path is not None else config_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(cfg), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, p)
    return p


def load_io_config(path: str | os.PathLike | None = None) -> IOConfig | None:
    """The saved config, or ``None`` when there is none; a malformed file is an error."""
    p = Path(path) if path is not None else config_path()
    if not p.exists():
        return None
    try:
        raw = json.loads(p.read_text())
        cfg = IOConfig(**raw)
    except (ValueError, TypeError) as exc:
        raise StoreError(f"{p}: malformed I/O config ({exc}); rerun `czyx bench io`") from exc
    if cfg.path not in PATHS:
        raise StoreError(f"{p}: unknown I/O path {cfg.path!r}; rerun `czyx bench io`")
    return cfg


def accepts_direct(path: str | os.PathLike) -> bool:
    """Whether ``path`` opens with ``O_DIRECT`` (some filesystems refuse it: tmpfs before
    Linux 6.6, some network filesystems)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    return True


def default_io_path(prefer_direct: bool = False, probe: str | os.PathLike | None = None) -> str:
    """The I/O path when none is named.

    The winner ``czyx bench io`` recorded, if it recorded one. Else ``"direct"``
    when the caller prefers it (its slots are the only cache its reads will have:
    they hold part of the experts and memory cannot hold the rest, so a buffered
    read would only keep a second, soon evicted copy in the page cache, which a
    memory limit counts against the same room) and ``probe``, one of the files to
    be read, opens with ``O_DIRECT``. Else buffered ``"pread"`` (portable, and
    from a warm page cache a copy at memory speed).
    """
    cfg = load_io_config()
    if cfg is not None:
        return cfg.path
    if prefer_direct and probe is not None and accepts_direct(probe):
        return "direct"
    return "pread"
