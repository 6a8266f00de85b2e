"""The raw reader: fill caller-owned, aligned buffers with a block file's bytes.

Two backends give identical bytes:

- ``"c"``: ``store._reader``, a small C library built with cffi (API mode,
  see :mod:`store._reader_build`). The GIL is released during every call and
  :meth:`RawReader.read_many` reads a whole batch of extents in one call.
- ``"python"``: ``os.preadv`` loops, used when the C build is unavailable
  (a ``RuntimeWarning`` says so once) or when asked for explicitly.

``direct=True`` opens a second descriptor with ``O_DIRECT``: a request whose
buffer address and offset are aligned reads its aligned body through it and
any unaligned tail (< one alignment unit) through the buffered descriptor, so
every request works and a well-aligned one bypasses the page cache entirely.
Buffers from :func:`aligned_empty` (optionally huge-page backed, which
raises O_DIRECT throughput over an ordinary buffer: ``bench/RATIONALE.md``,
``czyx bench io``) satisfy the alignment.

A request either fills its buffer completely or raises: ``ShortReadError`` at
end of file, ``ReadIOError`` (with ``errno``) otherwise, both naming the file
and the offset.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import warnings
from collections.abc import Sequence

import numpy as np

from czyx.store.core.checksum import checksum
from czyx.store.core.records import Extent
from czyx.store.errors import ChecksumError, ReadIOError, ShortReadError, StoreError
from czyx.store.io.fdowner import FdOwner, close_fds

try:
    from czyx.store.io import _reader as _c
except ImportError as _exc:  # no compiler at install time, or not built in place
    _c = None
    _C_IMPORT_ERROR: ImportError | None = _exc
else:
    _C_IMPORT_ERROR = None

HUGE_PAGE = 2 << 20
# madvise(2) advice values missing from Python 3.11's mmap module (Linux >= 5.14).
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
DIRECT_ALIGN = 4096
_warned = False

Buffer = np.ndarray | memoryview | bytearray


def c_available() -> bool:
    """Whether the compiled C reader could be imported."""
    return _c is not None


def _warn_fallback() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"store: C raw reader unavailable ({_C_IMPORT_ERROR}); using the slower "
            "os.preadv fallback. Build it with `python setup.py build_ext --inplace`.",
            RuntimeWarning,
            stacklevel=3,
        )


def _as_bytes_view(buf: Buffer) -> memoryview:
    """A writable, contiguous byte view of ``buf`` (numpy array, memoryview, bytearray)."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("buffer: array must be C-contiguous")
        if not buf.flags.writeable:
            raise ValueError("buffer: array is read-only")
        buf = buf.reshape(-1).view(np.uint8)
    mv = memoryview(buf)
    if mv.readonly:
        raise ValueError("buffer: read-only")
    if not mv.c_contiguous:
        raise ValueError("buffer: must be contiguous")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def _address(mv: memoryview) -> int:
    return np.frombuffer(mv, np.uint8).__array_interface__["data"][0] if len(mv) else 0


class RawReader(FdOwner):
    """Positional reads of one block file into caller-owned buffers.

    Parameters
    ----------
    path
        The file to read.
    direct
        Also open an ``O_DIRECT`` descriptor and use it for aligned requests.
    mapped
        Serve reads by ``memcpy`` from a read-only, shared mapping of the whole
        file, populated at open with huge pages advised (the warm path: no
        system call per request; see :func:`_map_whole_file`). Only for sealed
        files: the size is fixed at open, and a file truncated *under* a live
        mapping would raise ``SIGBUS``, so open a mapped reader through
        :meth:`store.lmdb_store.Store.open_reader`, which verifies the file
        first. Exclusive with ``direct``.
    align
        Direct-I/O alignment (offset and buffer address); 4096 by default.
    backend
        ``"auto"`` (C if built, else Python with a warning), ``"c"`` or ``"python"``.

    Attributes
    ----------
    fd
        The descriptor reads go through (the ``O_DIRECT`` one in direct mode).
    path, direct, align, backend
        As given (``backend`` resolved to ``"c"`` or ``"python"``).

    Notes
    -----
    One reader may be shared by threads: each call is a positional read with
    no shared cursor.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        direct: bool = False,
        mapped: bool = False,
        align: int = DIRECT_ALIGN,
        backend: str = "auto",
    ) -> None:
        if direct and mapped:
            raise ValueError("reader: direct and mapped are exclusive")
        if backend not in ("auto", "c", "python"):
            raise ValueError(f"backend: {backend!r} is not 'auto', 'c' or 'python'")
        if backend == "c" and _c is None:
            raise StoreError(f"store: C raw reader requested but unavailable ({_C_IMPORT_ERROR})")
        if backend == "auto":
            backend = "c" if _c is not None else "python"
            if _c is None:
                _warn_fallback()
        if align < 512 or align & (align - 1):
            raise ValueError(f"align: {align} is not a power of two >= 512")
        self.path = os.fspath(path)
        self.direct = direct
        self.mapped = mapped
        self.align = align
        self.backend = backend
        self._bfd = self._dfd = -1
        self._map: mmap.mmap | None = None
        self._mview: memoryview | None = None
        self._mptr = None
        self._msize = 0
        try:
            self._bfd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            if direct:
                self._dfd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
            if mapped:
                self._msize = os.fstat(self._bfd).st_size
                if self._msize:
                    self._map = _map_whole_file(self._bfd, self._msize)
        except OSError as exc:
            self.close()
            raise ReadIOError(exc.errno or 0, self.path, 0, 0) from exc
        self.fd = self._dfd if direct else self._bfd
        if backend == "c":
            self._ffi = _c.ffi
            self._lib = _c.lib
            self._result = _c.ffi.new("int64_t[1]")
            self._mptr = _c.ffi.from_buffer(self._map) if self._map is not None else _c.ffi.NULL
        elif self._map is not None:
            self._mview = memoryview(self._map)

    # -- errors -----------------------------------------------------------------------
    def _raise(self, offset: int, length: int, r: int) -> None:
        if r < 0:
            raise ReadIOError(-r, self.path, offset, length)
        raise ShortReadError(self.path, offset, length, r)

    # -- single reads -------------------------------------------------------------------
    def read_into(self, offset: int, buf: Buffer) -> None:
        """Fill all of ``buf`` with the bytes at ``offset``, or raise.

        Raises
        ------
        ShortReadError
            The file ends before ``offset + len(buf)``.
        ReadIOError
            The OS refused the read (``errno`` kept).
        """
        if self._bfd < 0:
            raise StoreError(f"{self.path}: reader is closed")
        if self.backend == "c":
            try:
                cbuf = self._ffi.from_buffer(buf, require_writable=True)
            except (BufferError, TypeError) as exc:
                raise ValueError(f"buffer: {exc}") from exc
            n = len(cbuf)
            if self.mapped:
                r = self._lib.czyx_copy_one(self._mptr, self._msize, offset, cbuf, n)
            else:
                r = self._lib.czyx_read_one(self._bfd, self._dfd, self.align, offset, cbuf, n)
            if r != n:
                self._raise(offset, n, r)
            return
        mv = _as_bytes_view(buf)
        r = self._py_copy_one(offset, mv) if self.mapped else self._py_read_one(offset, mv)
        if r != len(mv):
            self._raise(offset, len(mv), r)

    def _py_copy_one(self, offset: int, mv: memoryview) -> int:
        if offset < 0:
            return -22
        avail = max(0, min(len(mv), self._msize - offset))
        if avail:
            mv[:avail] = self._mview[offset : offset + avail]
        return avail

    def _py_read_one(self, offset: int, mv: memoryview) -> int:
        n = len(mv)
        if offset < 0:
            return -22  # EINVAL, as the C path reports
        body = 0
        if self._dfd >= 0 and offset % self.align == 0 and _address(mv) % self.align == 0:
            body = n // self.align * self.align
        if body:
            r = _py_full_pread(self._dfd, mv[:body], offset, self.align)
            if r != body:
                return r
        if n > body:
            r = _py_full_pread(self._bfd, mv[body:], offset + body, 0)
            return r if r < 0 else body + r
        return body

    # -- batches ----------------------------------------------------------------------
    def read_many(self, extents: Sequence[tuple[int, int, Buffer]]) -> None:
        """Read a batch of ``(offset, length, buffer)`` requests in one call.

        Each request fills ``buffer[:length]``. With the C backend the whole
        batch runs in one C call with the GIL released. Stops at, and raises
        for, the first request that cannot be filled.
        """
        if self._bfd < 0:
            raise StoreError(f"{self.path}: reader is closed")
        n = len(extents)
        if n == 0:
            return
        if self.backend == "python":
            for off, length, buf in extents:
                mv = _as_bytes_view(buf)
                if length > len(mv):
                    raise ValueError(f"read_many: length {length} > buffer of {len(mv)} bytes")
                part = mv[:length]
                r = self._py_copy_one(off, part) if self.mapped else self._py_read_one(off, part)
                if r != length:
                    self._raise(off, length, r)
            return
        ffi = self._ffi
        arr = ffi.new("czyx_extent[]", n)
        keep = []  # the cdata buffers must outlive the call
        for i, (off, length, buf) in enumerate(extents):
            try:
                cbuf = ffi.from_buffer(buf, require_writable=True)
            except (BufferError, TypeError) as exc:
                raise ValueError(f"buffer {i}: {exc}") from exc
            if length > len(cbuf):
                raise ValueError(f"read_many: length {length} > buffer of {len(cbuf)} bytes")
            keep.append(cbuf)
            e = arr[i]
            e.offset = off
            e.length = length
            e.buf = cbuf
        if self.mapped:
            bad = self._lib.czyx_copy_many(self._mptr, self._msize, arr, n, self._result)
        else:
            bad = self._lib.czyx_read_many(self._bfd, self._dfd, self.align, arr, n, self._result)
        if bad >= 0:
            off, length, _ = extents[bad]
            self._raise(off, length, self._result[0])

    def close(self) -> None:
        """Close the descriptors and the mapping (idempotent)."""
        if getattr(self, "_mptr", None) is not None and self._map is not None:
            self._ffi.release(self._mptr)
        self._mptr = None
        if getattr(self, "_mview", None) is not None:
            self._mview.release()
            self._mview = None
        if getattr(self, "_map", None) is not None:
            self._map.close()
            self._map = None
        close_fds(self, ("_dfd", "_bfd"))
        self.fd = -1


def _map_whole_file(fd: int, size: int) -> mmap.mmap:
    """A read-only, shared, populated mapping of a file's first ``size`` bytes.

    Huge pages are advised *before* populating: the pages of a cold file are
    then read into the page cache as 2 MiB folios and mapped by PMD entries.
    Measured here (bench/bench_store.py, "page-cache fill", 512 MiB file):
    warm mapped copies out of a page cache held in 4 KiB folios (what
    random-order buffered reads leave) ran at 0.64-0.76 of a RAM-to-RAM copy,
    out of 2 MiB folios at 0.89-1.01; populating a cold file this way ran at
    the device's rate. Pages already cached keep their folio size (the kernel
    here cannot collapse file folios: ``MADV_COLLAPSE`` gives ``EINVAL``). Falls back to
    ``MAP_POPULATE`` where the advice is unsupported (old kernel, no THP).
    """
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
            mm.madvise(_MADV_POPULATE_READ)
            return mm
        except OSError:
            mm.close()
    return mmap.mmap(
        fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ
    )


def _py_full_pread(fd: int, mv: memoryview, offset: int, direct_align: int) -> int:
    """The Python twin of the C ``full_pread``: bytes read, or ``-errno``."""
    done, n = 0, len(mv)
    while done < n:
        try:
            r = os.preadv(fd, [mv[done:]], offset + done)
        except InterruptedError:
            continue
        except OSError as exc:
            return -(exc.errno or 5)
        if r == 0:
            break
        done += r
        if direct_align and r % direct_align:
            break
    return done


def read_extent_verified(reader: RawReader, extent_record: dict, buf: Buffer) -> None:
    """Read the extent described by ``extent_record`` into ``buf`` and verify it.

    ``buf`` must hold at least ``record["len"]`` bytes; the payload lands in
    its first ``len`` bytes. In direct mode, when ``buf`` has room, the read
    is rounded up to the alignment (block files are padded) so it stays
    entirely ``O_DIRECT``.

    Raises
    ------
    ChecksumError
        The bytes read do not match ``record["sum"]``.
    ShortReadError, ReadIOError, RecordDecodeError
        From the read itself or a malformed record.
    """
    ext = Extent.from_record(extent_record)
    mv = _as_bytes_view(buf)
    if len(mv) < ext.length:
        raise ValueError(f"buffer: {len(mv)} bytes, extent needs {ext.length}")
    n = ext.length
    if reader.direct:
        rounded = -(-n // reader.align) * reader.align
        if rounded <= len(mv):
            n = rounded
    try:
        reader.read_into(ext.offset, mv[:n])
    except ShortReadError as exc:
        # Only the rounding ran past the end (a file not padded to the alignment):
        # the extent itself was read in full.
        if n == ext.length or exc.got < ext.length:
            raise
    got = checksum(mv[: ext.length])
    if got != ext.checksum:
        raise ChecksumError(
            f"{reader.path}: checksum mismatch for extent at offset {ext.offset} "
            f"({ext.length} bytes): stored {ext.checksum:016x}, read {got:016x}"
        )


def aligned_empty(nbytes: int, align: int = DIRECT_ALIGN, *, hugepage: bool = False) -> np.ndarray:
    """An uninitialised ``uint8`` array whose data address is a multiple of ``align``.

    Parameters
    ----------
    nbytes
        Size of the array.
    align
        Required address alignment (a power of two).
    hugepage
        Back it with an anonymous mapping advised ``MADV_HUGEPAGE``, aligned to
        2 MiB and touched once, so the kernel can use transparent huge pages:
        O_DIRECT reads into such a buffer are issued as larger requests.

    Returns
    -------
    numpy.ndarray
        A 1-D ``uint8`` array; it keeps its backing memory alive.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes: {nbytes} < 0")
    if align <= 0 or align & (align - 1):
        raise ValueError(f"align: {align} is not a power of two")
    if not hugepage:
        raw = np.empty(nbytes + align, np.uint8)
        start = (-raw.__array_interface__["data"][0]) % align
        return raw[start : start + nbytes]
    align = max(align, HUGE_PAGE)
    mm = mmap.mmap(-1, nbytes + align, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        # THP disabled: still a correct, aligned buffer, only slower for O_DIRECT.
        with contextlib.suppress(OSError):
            mm.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(mm, np.uint8)
    start = (-raw.__array_interface__["data"][0]) % align
    out = raw[start : start + nbytes]
    out[::4096] = 0  # touch every page once so first use does not fault
    return out
