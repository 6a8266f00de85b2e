"""The store's typed errors: one small hierarchy under :class:`StoreError`.

Every deliberate failure of the store (bad input, an on-disk fault, a refused
write) is one of these, so callers can fail closed with one ``except``
clause. Errors that come from the operating system keep their ``errno`` and
name the file and offset involved.
"""

from __future__ import annotations

from czyx.errors import CzyxError


class StoreError(CzyxError):
    """Base class of every error the store raises on purpose."""


class SpaceNotFoundError(StoreError, KeyError):
    """The space has not been published (no manifest, not sealed)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "space not found"


class SealedSpaceError(StoreError):
    """A write was aimed at a space that is already published (immutable)."""


class ReservedSpaceError(StoreError, ValueError):
    """Records were aimed at a reserved selector (0xFE portal / 0xFF edge spaces)."""


class SpaceNotEmptyError(StoreError):
    """A space being published already holds records written outside the publication."""


class SpaceInUseError(StoreError):
    """A space cannot be removed: a tag still names it, or another space builds on it."""


class TagNotFoundError(StoreError, KeyError):
    """No tag of that name exists."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "tag not found"


class TagConflictError(StoreError):
    """The tag already points at a different space; tags are never re-pointed silently."""


class RecordDecodeError(StoreError):
    """A stored value is not a msgpack map (corrupt or foreign bytes)."""


class IndexChecksumError(RecordDecodeError):
    """An index (LMDB) value fails its checksum: its bytes or its key changed since written."""


class IndexCorruptError(StoreError):
    """The LMDB index file itself is damaged (truncated, or refused by LMDB as corrupt)."""


class KeyLengthError(StoreError, ValueError):
    """A key (or selector) has the wrong length or type."""


class BlockFileError(StoreError):
    """A space's block file is missing, truncated, replaced (stale) or malformed."""


class ShortReadError(StoreError):
    """A read returned fewer bytes than asked for: the extent runs past end of file.

    Attributes
    ----------
    path, offset, expected, got
        The file, the offset of the request, its length, and the bytes obtained.
    """

    def __init__(self, path: str, offset: int, expected: int, got: int) -> None:
        super().__init__(
            f"{path}: short read at offset {offset}: wanted {expected} bytes, got {got} "
            "(extent past end of file?)"
        )
        self.path = path
        self.offset = offset
        self.expected = expected
        self.got = got


class ReadIOError(StoreError, OSError):
    """The operating system refused a read; carries ``errno``, the file and the offset."""

    def __init__(self, err: int, path: str, offset: int, length: int) -> None:
        import os

        OSError.__init__(self, err, f"{os.strerror(err)} reading {length} bytes at offset {offset}")
        self.filename = path
        self.offset = offset
        self.length = length

    def __str__(self) -> str:
        return f"{self.filename}: [errno {self.errno}] {self.strerror}"

    def __reduce__(self):  # keep the 4-argument constructor picklable
        return (type(self), (self.errno, self.filename, self.offset, self.length))


class ChecksumError(StoreError):
    """An extent's bytes do not match the checksum in its record."""


class StoreMapFullError(StoreError):
    """The LMDB map could not grow any further (limit reached or disk full)."""


class StoreForkError(StoreError):
    """A store handle was used in a process other than the one that opened it."""


# The contract names it ``MapFullError``; keep both spellings.
MapFullError = StoreMapFullError

__all__ = [
    "BlockFileError",
    "ChecksumError",
    "IndexChecksumError",
    "IndexCorruptError",
    "KeyLengthError",
    "MapFullError",
    "ReadIOError",
    "RecordDecodeError",
    "ReservedSpaceError",
    "SealedSpaceError",
    "ShortReadError",
    "SpaceNotEmptyError",
    "SpaceNotFoundError",
    "StoreError",
    "StoreForkError",
    "StoreMapFullError",
    "TagConflictError",
    "TagNotFoundError",
]
