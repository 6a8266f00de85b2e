"""The store: LMDB index, msgpack records, aligned block files, the cffi raw reader,
and model checkpoints mounted as spaces. It never runs a model.

Subpackages: ``core`` (index, records, block files, writer, snapshot),
``io`` (readers, I/O paths, the native read pool, and :mod:`czyx.store.io.experts`,
the one expert-read interface engines use), ``models`` (checkpoints,
architectures, mount, export, the opened model version) and ``quant``.

Public surface: :class:`Store` (the LMDB backend of :class:`StoreInterface`),
:class:`SpaceWriter`, :class:`Extent`, :class:`RawReader`,
:func:`read_extent_verified`, :func:`checksum`, :func:`aligned_empty` and the
errors of :mod:`czyx.store.errors`.
"""

from __future__ import annotations

from czyx.store.core.checksum import CHECKSUM_NAME, checksum
from czyx.store.core.lmdb_store import Store
from czyx.store.core.records import Extent
from czyx.store.core.snapshot import Snapshot
from czyx.store.core.writer import SpaceWriter, collect_garbage
from czyx.store.errors import (
    BlockFileError,
    ChecksumError,
    KeyLengthError,
    MapFullError,
    ReadIOError,
    RecordDecodeError,
    ReservedSpaceError,
    SealedSpaceError,
    ShortReadError,
    SpaceInUseError,
    SpaceNotEmptyError,
    SpaceNotFoundError,
    StoreError,
    StoreForkError,
    StoreMapFullError,
    TagConflictError,
    TagNotFoundError,
)
from czyx.store.interfaces import SpaceWriterInterface, StoreInterface
from czyx.store.io.reader import RawReader, aligned_empty, c_available, read_extent_verified

__all__ = [
    "CHECKSUM_NAME",
    "BlockFileError",
    "ChecksumError",
    "Extent",
    "KeyLengthError",
    "MapFullError",
    "RawReader",
    "ReadIOError",
    "RecordDecodeError",
    "ReservedSpaceError",
    "SealedSpaceError",
    "ShortReadError",
    "Snapshot",
    "SpaceInUseError",
    "SpaceNotEmptyError",
    "SpaceNotFoundError",
    "SpaceWriter",
    "SpaceWriterInterface",
    "Store",
    "StoreError",
    "StoreForkError",
    "StoreInterface",
    "StoreMapFullError",
    "TagConflictError",
    "TagNotFoundError",
    "aligned_empty",
    "c_available",
    "checksum",
    "collect_garbage",
    "read_extent_verified",
]
