"""Block files: one append-only, aligned file of extents per published space.

Layout
------
Offset 0 holds a header of one alignment unit (4096 bytes unless the
filesystem asks for more): magic, format version, alignment, the space's
selector and a random 16-byte *generation*, followed by an XXH3-64 of those
fields. Extents follow, each starting at a multiple of the alignment and
zero-padded to the next one, so every extent can be read with ``O_DIRECT``
into an aligned buffer and the file size is always a multiple of the
alignment.

Identity and staleness
----------------------
When a space is published its manifest entry records the block file's name,
generation, alignment and exact size (:class:`BlockIdentity`). A sealed space
never changes, so :func:`verify_block_file` demands an exact match: a missing
file, a shorter one (truncated), a longer one, or one with another header
(replaced by a different file, even of the same size) raises
:class:`~store.errors.BlockFileError` before any extent is read.

This module only writes and checks files; which file is visible is decided by
the LMDB index (:mod:`store.lmdb_store`).
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from czyx.store.core.checksum import checksum
from czyx.store.core.records import Extent
from czyx.store.errors import BlockFileError, StoreError

MAGIC = b"CZYXBLK\x01"
FORMAT_VERSION = 1
DEFAULT_ALIGN = 4096
_HEADER = struct.Struct("<8sII32s16s")
_HEADER_SUM = struct.Struct("<Q")

_STATX_DIOALIGN = 0x2000
_AT_FDCWD = -100


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def dio_alignment(path: str | os.PathLike) -> int:
    """The alignment to use for direct I/O on ``path``'s filesystem.

    Reads ``STATX_DIOALIGN`` (Linux >= 6.1) through ``statx``; the answer is
    never below 4096 (the page size, which O_DIRECT buffers need anyway) and
    is a power of two. Falls back to 4096 where ``statx`` or the field is
    unavailable.

    Parameters
    ----------
    path
        An existing file or directory on the filesystem in question.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        statx = libc.statx
    except (OSError, AttributeError):
        return DEFAULT_ALIGN
    buf = ctypes.create_string_buffer(256)
    rc = statx(_AT_FDCWD, os.fsencode(os.fspath(path)), 0, _STATX_DIOALIGN, buf)
    if rc != 0:
        return DEFAULT_ALIGN
    mask = struct.unpack_from("<I", buf.raw, 0)[0]
    if not mask & _STATX_DIOALIGN:
        return DEFAULT_ALIGN
    mem_align, off_align = struct.unpack_from("<II", buf.raw, 152)
    align = max(DEFAULT_ALIGN, mem_align, off_align)
    return 1 << (align - 1).bit_length()  # next power of two


@dataclass(frozen=True)
class BlockIdentity:
    """What the index remembers about a published block file.

    Attributes
    ----------
    name
        File name inside the store's ``blocks/`` directory.
    generation
        16 random bytes, also written in the file's header.
    size
        Exact file size at publication.
    align
        The alignment every extent offset is a multiple of.
    """

    name: str
    generation: bytes
    size: int
    align: int

    def to_record(self) -> dict:
        """The msgpack-able form stored in the space's manifest entry."""
        return {"name": self.name, "gen": self.generation, "size": self.size, "align": self.align}

    @classmethod
    def from_record(cls, rec: dict) -> BlockIdentity:
        """Inverse of :meth:`to_record`."""
        return cls(rec["name"], bytes(rec["gen"]), int(rec["size"]), int(rec["align"]))


def encode_header(selector: bytes, generation: bytes, align: int) -> bytes:
    """The header bytes (padded to ``align``) for a new block file."""
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, align, selector, generation)
    head += _HEADER_SUM.pack(checksum(head))
    return head + bytes(align - len(head))


def read_header(path: Path) -> tuple[bytes, bytes, int]:
    """Return ``(selector, generation, align)`` from a block file's header.

    Raises
    ------
    BlockFileError
        If the file is missing, too short, or the header is not ours.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(_HEADER.size + _HEADER_SUM.size)
    except FileNotFoundError as exc:
        raise BlockFileError(f"{path}: block file is missing") from exc
    except OSError as exc:
        raise BlockFileError(f"{path}: cannot read header ({exc})") from exc
    if len(raw) < _HEADER.size + _HEADER_SUM.size:
        raise BlockFileError(f"{path}: truncated header ({len(raw)} bytes)")
    magic, version, align, selector, generation = _HEADER.unpack_from(raw)
    (stored,) = _HEADER_SUM.unpack_from(raw, _HEADER.size)
    if magic != MAGIC:
        raise BlockFileError(f"{path}: not a czyx block file (magic {magic!r})")
    if stored != checksum(raw[: _HEADER.size]):
        raise BlockFileError(f"{path}: header checksum mismatch")
    if version != FORMAT_VERSION:
        raise BlockFileError(f"{path}: unsupported block format version {version}")
    return selector, generation, align


def verify_block_file(path: Path, ident: BlockIdentity, selector: bytes) -> None:
    """Check that ``path`` is exactly the block file published as ``ident``.

    Raises
    ------
    BlockFileError
        Missing, truncated, grown, or replaced (header generation, selector or
        alignment differ from the index).
    """
    try:
        size = os.stat(path).st_size
    except FileNotFoundError as exc:
        raise BlockFileError(f"{path}: block file is missing") from exc
    if size < ident.size:
        raise BlockFileError(f"{path}: truncated: {size} bytes, published with {ident.size}")
    if size > ident.size:
        raise BlockFileError(f"{path}: stale: {size} bytes, published with {ident.size}")
    sel, gen, align = read_header(path)
    if gen != ident.generation or sel != selector or align != ident.align:
        raise BlockFileError(
            f"{path}: stale: header generation {gen.hex()} != published {ident.generation.hex()}"
            " (the file was replaced)"
        )


class BlockWriter:
    """Appends aligned, checksummed extents to a new block file.

    The file is created exclusively (never overwriting anything) and nothing
    in it is visible until the index publishes it; :meth:`sync` must be called
    before that.

    Parameters
    ----------
    path
        The new file's path (must not exist).
    selector
        The 32-byte space selector, written into the header.
    generation
        16 random bytes identifying this file.
    align
        Extent alignment in bytes (a power of two >= 4096).
    """

    def __init__(self, path: Path, selector: bytes, generation: bytes, align: int) -> None:
        if align < DEFAULT_ALIGN or align & (align - 1):
            raise ValueError(f"align: {align} is not a power of two >= {DEFAULT_ALIGN}")
        self.path = Path(path)
        self.align = align
        self.generation = generation
        try:
            self._fd = os.open(
                self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644
            )
        except OSError as exc:
            raise StoreError(f"{self.path}: cannot create block file ({exc})") from exc
        self._zeros = bytes(align)
        self._pos = 0
        self._pwrite(memoryview(encode_header(selector, generation, align)))

    @property
    def size(self) -> int:
        """Bytes written so far (always a multiple of the alignment)."""
        return self._pos

    def _pwrite(self, mv: memoryview) -> None:
        done, n = 0, len(mv)
        while done < n:
            try:
                done += os.pwrite(self._fd, mv[done:], self._pos + done)
            except InterruptedError:
                continue
            except OSError as exc:
                raise StoreError(
                    f"{self.path}: write of {n} bytes at offset {self._pos} failed "
                    f"([errno {exc.errno}] {exc.strerror})"
                ) from exc
        self._pos += n

    def write(self, data: bytes | bytearray | memoryview | np.ndarray) -> Extent:
        """Append ``data`` at the next aligned offset; return its :class:`Extent`."""
        if self._fd < 0:
            raise StoreError(f"{self.path}: block writer is closed")
        if isinstance(data, np.ndarray):
            data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        mv = memoryview(data).cast("B")
        ext = Extent(self._pos, len(mv), checksum(mv))
        self._pwrite(mv)
        pad = _round_up(self._pos, self.align) - self._pos
        if pad:
            self._pwrite(memoryview(self._zeros)[:pad])
        return ext

    def skip_to(self, offset: int) -> None:
        """Leave a hole (zeros, sparse where the filesystem allows) up to ``offset``.

        Lets a layout place extents at computed offsets with gaps between them.
        ``offset`` must be aligned and not behind the current end.
        """
        if offset % self.align or offset < self._pos:
            raise ValueError(
                f"{self.path}: skip_to({offset}): must be a multiple of {self.align} "
                f"and >= the current end {self._pos}"
            )
        if offset > self._pos:
            os.ftruncate(self._fd, offset)
            self._pos = offset

    def sync(self) -> None:
        """``fsync`` the file: every byte written so far is durable afterwards."""
        os.fsync(self._fd)

    def close(self) -> None:
        """Close the file descriptor (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def fsync_file(path: Path) -> None:
    """``fsync`` the file at ``path``: its bytes are durable afterwards."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """``fsync`` a directory so a rename or create inside it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:  # some filesystems refuse fsync on directories
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)
