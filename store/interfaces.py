"""The abstract store interface that every backend implements.

:class:`StoreInterface` is what ``mount``, ``portals`` and the engine code
against (every signature that takes a store takes this type), and what the
conformance suite (:mod:`czyx.testing.store_conformance`) checks;
:class:`czyx.store.core.lmdb_store.Store` is the LMDB backend. A second
backend (an object store, an in-memory one for tests) subclasses this and
passes the same suite. The shape follows zarr-python v3's ``abc/store.py``:
one small abstract class, typed, with the lifecycle, the reads, the writes
and the listing separated.

:class:`ClassView` is the other side of the store/portal boundary: what a
portal's view onto one space must offer for the store to check expert reads
(the store never imports ``portals``; ``czyx.portals.view.SpaceView``
satisfies this protocol).
"""

from __future__ import annotations

import abc
import pathlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from czyx.space import Selector

if TYPE_CHECKING:
    import numpy as np

    from czyx.store.core.records import Extent
    from czyx.store.io.reader import RawReader


@runtime_checkable
class ClassView(Protocol):
    """A portal's read-only view onto one space: which classes and layers it covers."""

    space: Selector
    allowed_classes: np.ndarray  # bool[256], read-only
    layer_lo: int
    layer_hi: int

    def check(self, cls: int, layer: int | None = None) -> None:
        """Raise the portal's (audited) denial unless ``(cls, layer)`` is covered."""
        ...


class SpaceWriterInterface(abc.ABC):
    """Stages one space's extents and records; publication is atomic."""

    @abc.abstractmethod
    def write_extent(self, data: bytes | memoryview | np.ndarray) -> Extent:
        """Append ``data`` at the next aligned offset of the space's block file."""

    @abc.abstractmethod
    def put(self, key: bytes, record: dict) -> None:
        """Stage the record at ``key`` (visible only after publication)."""

    @abc.abstractmethod
    def put_many(self, items: Iterable[tuple[bytes, dict]]) -> None:
        """Stage several records."""

    @abc.abstractmethod
    def commit(self) -> None:
        """Make the block file durable, then publish records, manifest and seal at once."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Discard everything staged; nothing becomes visible."""

    def __enter__(self) -> SpaceWriterInterface:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


class StoreInterface(abc.ABC):
    """Records at ``(space, 24-byte key)``, sealed spaces, tags, portals, edges, audit."""

    path: pathlib.Path

    # -- lifecycle ---------------------------------------------------------------------
    @abc.abstractmethod
    def close(self) -> None:
        """Release the backend's resources (idempotent)."""

    def __enter__(self) -> StoreInterface:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- records -----------------------------------------------------------------------
    @abc.abstractmethod
    def put(self, space: Selector, key: bytes, record: dict) -> None:
        """Store ``record`` at ``(space, key)``; refused for sealed spaces."""

    @abc.abstractmethod
    def put_many(self, space: Selector, items: Iterable[tuple[bytes, dict]]) -> int:
        """Store many records in one transaction; return how many."""

    @abc.abstractmethod
    def get(self, space: Selector, key: bytes) -> dict | None:
        """The record at ``(space, key)``, or ``None``."""

    @abc.abstractmethod
    def delete(self, space: Selector, key: bytes) -> bool:
        """Delete the record; ``True`` if it existed."""

    @abc.abstractmethod
    def scan(
        self, space: Selector, lo_cls: int = 0, hi_cls: int = 255
    ) -> Iterator[tuple[bytes, dict]]:
        """Records of classes ``lo_cls..hi_cls`` (inclusive) in packed-key order."""

    @abc.abstractmethod
    def aggregate(self, space: Selector, lo_cls: int = 0, hi_cls: int = 255) -> tuple[int, int]:
        """``(count, sum of record["len"])`` over a class range, computed by a scan."""

    # -- spaces ------------------------------------------------------------------------
    @abc.abstractmethod
    def begin_space(self, space: Selector, manifest: dict) -> SpaceWriterInterface:
        """Start publishing ``space``; ``SealedSpaceError`` if already published."""

    @abc.abstractmethod
    def has_space(self, space: Selector) -> bool:
        """Whether ``space`` is published (sealed)."""

    @abc.abstractmethod
    def manifest(self, space: Selector) -> dict:
        """The published manifest; ``SpaceNotFoundError`` otherwise."""

    @abc.abstractmethod
    def spaces(self) -> list[Selector]:
        """Every published space, in selector order."""

    @abc.abstractmethod
    def remove_space(self, space: Selector) -> pathlib.Path | None:
        """Delete a space no tag names, and its block file (``SpaceInUseError`` if tagged)."""

    @abc.abstractmethod
    def block_path(self, space: Selector) -> pathlib.Path:
        """The published space's block file."""

    @abc.abstractmethod
    def verify_space(self, space: Selector) -> Any:
        """Check the block file is exactly the published one (``BlockFileError`` if not)."""

    @abc.abstractmethod
    def open_reader(
        self, space: Selector, *, direct: bool = False, mapped: bool = False, backend: str = "auto"
    ) -> RawReader:
        """A verified :class:`~czyx.store.io.reader.RawReader` on the space's block file."""

    # -- tags --------------------------------------------------------------------------
    @abc.abstractmethod
    def set_tag(self, tag: str, space: Selector) -> None:
        """Point ``tag`` at ``space``; ``TagConflictError`` if it points elsewhere."""

    @abc.abstractmethod
    def resolve_tag(self, tag: str) -> Selector:
        """The space ``tag`` points at; ``TagNotFoundError`` otherwise."""

    @abc.abstractmethod
    def tags(self) -> dict[str, Selector]:
        """Every tag and its space."""

    # -- portals, edges, audit ---------------------------------------------------------
    @abc.abstractmethod
    def put_portal_descriptor(self, portal_id: bytes, record: dict) -> None:
        """Store a portal descriptor (the 0xFE space)."""

    @abc.abstractmethod
    def get_portal_descriptor(self, portal_id: bytes) -> dict | None:
        """A portal descriptor, or ``None``."""

    @abc.abstractmethod
    def portal_descriptors(self) -> Iterator[tuple[bytes, dict]]:
        """Every portal descriptor in id order."""

    @abc.abstractmethod
    def put_edge(self, key: bytes, record: dict) -> None:
        """Store an association edge (the 0xFF space)."""

    @abc.abstractmethod
    def edges(self, prefix: bytes = b"") -> Iterator[tuple[bytes, dict]]:
        """Edges whose key starts with ``prefix``, in key order."""

    @abc.abstractmethod
    def audit(self, event: str, **fields: Any) -> None:
        """Append an event to the audit log."""

    @abc.abstractmethod
    def audit_log(self) -> Iterator[dict]:
        """The audit log, oldest first; each entry has ``seq``, ``time`` and ``event``."""
