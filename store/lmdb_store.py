"""The LMDB backend of the store: one environment per store directory.

Directory layout::

    <store>/index/      the LMDB environment (data.mdb, lock.mdb)
    <store>/blocks/     one block file per published space (store.blockfile)

Named databases: ``records`` (``selector || key -> msgpack``), ``spaces``
(selector -> manifest entry with the seal and block-file identity), ``tags``
(``name@version`` -> selector), ``portals`` (portal id -> descriptor),
``edges`` (edge key -> record) and ``audit`` (8-byte big-endian sequence
number -> event).

Concurrency rules, and why:

- One writer at a time (LMDB's write lock, shared between processes); any
  number of readers in any threads or processes. py-lmdb opens every
  environment with ``MDB_NOTLS``, so this module begins a fresh read
  transaction per call (or per scan chunk) and never hands one to another
  thread.
- The map starts at ``map_size`` and doubles when a write hits
  ``MDB_MAP_FULL``: the write transaction is aborted, the map grown and the
  whole transaction retried (every write is a re-runnable function of its
  transaction). Growing remaps the file, so it waits until no read
  transaction of this process is open; scans therefore read in chunks and
  never hold a transaction while the caller runs.
- An environment must not be used across ``fork()``: the opening pid is
  recorded and any use from another process raises ``StoreForkError``. Right
  after a fork the child closes its inherited copies of every open
  environment (``os.register_at_fork``; LMDB's close only releases the
  child's own reader slots and mappings), so the child can ``Store.open``
  the same directory afresh (py-lmdb refuses a second open of a path that is
  still open in the process).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import lmdb

from czyx.key import class_range_bounds
from czyx.space import SELECTOR_SIZE, Selector
from store.blockfile import BlockIdentity, verify_block_file
from store.catalog import CatalogMixin
from store.errors import (
    ReservedSpaceError,
    SealedSpaceError,
    SpaceNotFoundError,
    StoreError,
    StoreForkError,
    StoreMapFullError,
)
from store.interfaces import StoreInterface
from store.reader import RawReader
from store.records import check_key, check_selector, decode, encode
from store.writer import SpaceWriter

T = TypeVar("T")

DEFAULT_MAP_SIZE = 1 << 30  # virtual reservation only; the file grows as written
MAX_MAP_SIZE = 1 << 40
_SCAN_CHUNK = 4096
_DBS = ("records", "spaces", "tags", "portals", "edges", "audit")


_OPEN: weakref.WeakSet[Store] = weakref.WeakSet()


def _close_inherited() -> None:
    """In a fork child: drop every environment inherited from the parent."""
    for st in list(_OPEN):
        with contextlib.suppress(Exception):
            st._env.close()
    _OPEN.clear()


os.register_at_fork(after_in_child=_close_inherited)


class Store(CatalogMixin, StoreInterface):
    """A store directory: records, sealed spaces, tags, portals, edges and audit log.

    Use :meth:`open`; the constructor is internal.
    """

    def __init__(
        self, path: pathlib.Path, env: lmdb.Environment, readonly: bool, max_map_size: int
    ) -> None:
        self.path = path
        self.readonly = readonly
        self._env = env
        self._pid = os.getpid()
        self._max_map = max_map_size
        self._db = {name: env.open_db(name.encode(), create=False) for name in _DBS}
        self._records = self._db["records"]
        self._spaces = self._db["spaces"]
        # Active read transactions of this process; the map is only remapped at zero.
        self._cond = threading.Condition(threading.Lock())
        self._nread = 0
        self._closed = False
        _OPEN.add(self)

    # -- lifecycle ---------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        path: str | os.PathLike,
        *,
        create: bool = True,
        readonly: bool = False,
        map_size: int = DEFAULT_MAP_SIZE,
        max_map_size: int = MAX_MAP_SIZE,
    ) -> Store:
        """Create or open the store at ``path``.

        Parameters
        ----------
        path
            The store directory.
        create
            Create the directory and databases if missing (ignored when ``readonly``).
        readonly
            Open without write access; every write raises.
        map_size
            Initial LMDB map size in bytes; it grows by doubling on demand.
        max_map_size
            Growth stops here (``StoreMapFullError``).

        Raises
        ------
        StoreError
            The store does not exist (and ``create`` is false or ``readonly``),
            or LMDB refused to open it.
        """
        root = pathlib.Path(path)
        index = root / "index"
        if not (index / "data.mdb").exists():
            if readonly or not create:
                raise StoreError(f"{root}: no store here (missing {index / 'data.mdb'})")
            (root / "blocks").mkdir(parents=True, exist_ok=True)
            index.mkdir(exist_ok=True)
        try:
            env = lmdb.open(
                str(index),
                map_size=max(map_size, 1 << 16),
                max_dbs=len(_DBS) + 2,
                max_readers=1024,
                readonly=readonly,
                lock=True,
                subdir=True,
                readahead=False,  # point reads into a large index: no wasted readahead
            )
        except lmdb.Error as exc:
            raise StoreError(f"{index}: cannot open LMDB environment ({exc})") from exc
        if not readonly:
            with env.begin(write=True) as txn:
                for name in _DBS:
                    env.open_db(name.encode(), txn=txn, create=True)
        try:
            return cls(root, env, readonly, max_map_size)
        except lmdb.Error as exc:
            env.close()
            raise StoreError(f"{index}: store databases missing ({exc})") from exc

    def close(self) -> None:
        """Close the environment (idempotent; in a fork child it was closed at fork)."""
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        if os.getpid() == self._pid:
            self._env.close()

    def _check(self) -> None:
        if self._pid != os.getpid():
            raise StoreForkError(
                f"{self.path}: store opened in pid {self._pid} used in pid {os.getpid()}; "
                "LMDB environments must not cross fork(): call Store.open again in the child"
            )
        if self._closed:
            raise StoreError(f"{self.path}: store is closed")

    # -- transactions ------------------------------------------------------------------
    def _begin_read(self) -> lmdb.Transaction:
        self._check()
        with self._cond:
            self._nread += 1
        try:
            return self._env.begin()
        except lmdb.MapResizedError:
            # Another process grew the map past ours: adopt its size and retry.
            self._end_read()
            self._remap(0)
            return self._begin_read()
        except BaseException:
            self._end_read()
            raise

    def _end_read(self, txn: lmdb.Transaction | None = None) -> None:
        if txn is not None:
            txn.abort()
        with self._cond:
            self._nread -= 1
            if self._nread == 0:
                self._cond.notify_all()

    def _remap(self, new_size: int) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._nread == 0, timeout=30.0):
                raise StoreMapFullError(
                    f"{self.path}: cannot resize the LMDB map while read transactions stay open"
                )
            self._env.set_mapsize(new_size)

    def _write(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """Run ``fn`` in one write transaction, growing the map and retrying on MapFull."""
        self._check()
        if self.readonly:
            raise StoreError(f"{self.path}: store is open read-only")
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    return fn(txn)
            except lmdb.MapFullError:
                size = self._env.info()["map_size"]
                if size >= self._max_map:
                    raise StoreMapFullError(
                        f"{self.path}: LMDB map full at {size} bytes (limit {self._max_map})"
                    ) from None
                self._remap(min(size * 2, self._max_map))
            except lmdb.MapResizedError:
                self._remap(0)

    def map_size(self) -> int:
        """The current LMDB map size in bytes."""
        self._check()
        return self._env.info()["map_size"]

    # -- records -----------------------------------------------------------------------
    def _sealed_in(self, txn: lmdb.Transaction, sel: bytes) -> bool:
        return txn.get(sel, db=self._spaces) is not None

    def _writable_space(self, space: Selector) -> bytes:
        sel = check_selector(space)
        if sel[0] in (0xFE, 0xFF):
            raise ReservedSpaceError(
                f"space {sel.hex()}: reserved prefix 0x{sel[0]:02X}; use put_portal_descriptor"
                " / put_edge"
            )
        return sel

    def _refuse_sealed(self, txn: lmdb.Transaction, sel: bytes) -> None:
        if self._sealed_in(txn, sel):
            raise SealedSpaceError(f"space {sel.hex()} is published (sealed); it is immutable")

    def put(self, space: Selector, key: bytes, record: dict) -> None:
        """Store ``record`` at ``(space, key)``.

        Raises
        ------
        KeyLengthError
            ``key`` is not 24 bytes (or ``space`` not a selector).
        SealedSpaceError
            ``space`` is published.
        """
        k = self._writable_space(space) + check_key(key)
        v = encode(record)

        def fn(txn: lmdb.Transaction) -> None:
            self._refuse_sealed(txn, k[:SELECTOR_SIZE])
            txn.put(k, v, db=self._records)

        self._write(fn)

    def put_many(self, space: Selector, items: Iterable[tuple[bytes, dict]]) -> int:
        """Store many records in one transaction; returns how many were written."""
        sel = self._writable_space(space)
        rows = [(sel + check_key(k), encode(r)) for k, r in items]

        def fn(txn: lmdb.Transaction) -> int:
            self._refuse_sealed(txn, sel)
            with txn.cursor(db=self._records) as cur:
                cur.putmulti(rows)
            return len(rows)

        return self._write(fn)

    def get(self, space: Selector, key: bytes) -> dict | None:
        """The record at ``(space, key)``, or ``None`` if there is none.

        Raises
        ------
        KeyLengthError
            Bad key or selector.
        RecordDecodeError
            The stored value is not a msgpack map.
        """
        k = check_selector(space) + check_key(key)
        txn = self._begin_read()
        try:
            v = txn.get(k, db=self._records)
        finally:
            self._end_read(txn)
        return None if v is None else decode(v, f"record {k.hex()}")

    def get_many(self, space: Selector, keys: Iterable[bytes]) -> list[dict | None]:
        """The records at many keys of one space, read in one transaction."""
        sel = check_selector(space)
        full = [sel + check_key(k) for k in keys]
        txn = self._begin_read()
        try:
            vals = [txn.get(k, db=self._records) for k in full]
        finally:
            self._end_read(txn)
        return [None if v is None else decode(v, f"record {k.hex()}") for k, v in zip(full, vals)]

    def snapshot(self) -> Snapshot:
        """A consistent read view in one read transaction, for many lookups in one thread.

        Use it as a context manager and keep it short: while it is open the
        LMDB map of this process cannot grow.
        """
        return Snapshot(self)

    def delete(self, space: Selector, key: bytes) -> bool:
        """Delete the record at ``(space, key)``; ``True`` if it existed."""
        k = self._writable_space(space) + check_key(key)

        def fn(txn: lmdb.Transaction) -> bool:
            self._refuse_sealed(txn, k[:SELECTOR_SIZE])
            return txn.delete(k, db=self._records)

        return self._write(fn)

    def _scan_raw(
        self, db: Any, start: bytes, stop: Callable[[bytes], bool]
    ) -> Iterator[tuple[bytes, bytes]]:
        """Raw ``(key, value)`` pairs from ``start`` on until ``stop(key)``, in chunks.

        Each chunk is read in its own short read transaction, so no transaction
        is held while the caller consumes the rows.
        """
        cursor_key, skip = start, False
        while True:
            txn = self._begin_read()
            try:
                cur = txn.cursor(db=db)
                rows: list[tuple[bytes, bytes]] = []
                if cur.set_range(cursor_key):
                    it = cur.iternext()
                    if skip:
                        next(it, None)
                    for k, v in it:
                        if stop(k):
                            break
                        rows.append((k, v))
                        if len(rows) == _SCAN_CHUNK:
                            break
            finally:
                self._end_read(txn)
            yield from rows
            if len(rows) < _SCAN_CHUNK:
                return
            cursor_key, skip = rows[-1][0], True

    def scan(
        self, space: Selector, lo_cls: int = 0, hi_cls: int = 255
    ) -> Iterator[tuple[bytes, dict]]:
        """Records of classes ``lo_cls..hi_cls`` inclusive, in packed-key (curve) order.

        Yields
        ------
        (key, record)
            ``key`` is the 24-byte packed key.
        """
        sel = check_selector(space)
        lo, hi = class_range_bounds(lo_cls, hi_cls)
        end = sel + hi
        for k, v in self._scan_raw(self._records, sel + lo, end.__lt__):
            yield k[SELECTOR_SIZE:], decode(v, f"record {k.hex()}")

    def keys(self, space: Selector, lo_cls: int = 0, hi_cls: int = 255) -> Iterator[bytes]:
        """The 24-byte keys of classes ``lo_cls..hi_cls``, in order, without decoding values."""
        sel = check_selector(space)
        lo, hi = class_range_bounds(lo_cls, hi_cls)
        end = sel + hi
        for k, _ in self._scan_raw(self._records, sel + lo, end.__lt__):
            yield k[SELECTOR_SIZE:]

    def aggregate(self, space: Selector, lo_cls: int = 0, hi_cls: int = 255) -> tuple[int, int]:
        """``(count, total bytes)`` of the records in a class range.

        Computed by a scan (never stored twice); records without an extent
        count with 0 bytes.
        """
        count = total = 0
        for _, rec in self.scan(space, lo_cls, hi_cls):
            count += 1
            n = rec.get("len", 0)
            total += n if isinstance(n, int) else 0
        return count, total

    # -- spaces ------------------------------------------------------------------------
    def begin_space(self, space: Selector, manifest: dict) -> SpaceWriter:
        """Start publishing ``space`` with ``manifest``; see :class:`SpaceWriter`.

        Raises
        ------
        SealedSpaceError
            The space is already published.
        """
        sel = self._writable_space(space)
        if self.has_space(space):
            raise SealedSpaceError(f"space {sel.hex()} is already published")
        return SpaceWriter(self, sel, manifest)

    def _space_entry(self, space: Selector) -> dict:
        sel = check_selector(space)
        txn = self._begin_read()
        try:
            v = txn.get(sel, db=self._spaces)
        finally:
            self._end_read(txn)
        if v is None:
            raise SpaceNotFoundError(f"space {sel.hex()} is not published")
        return decode(v, f"space entry {sel.hex()}")

    def has_space(self, space: Selector) -> bool:
        """Whether ``space`` is published (and therefore sealed)."""
        sel = check_selector(space)
        txn = self._begin_read()
        try:
            return txn.get(sel, db=self._spaces) is not None
        finally:
            self._end_read(txn)

    def manifest(self, space: Selector) -> dict:
        """The manifest ``space`` was published with (``SpaceNotFoundError`` otherwise)."""
        return self._space_entry(space)["manifest"]

    def space_info(self, space: Selector) -> dict:
        """The full index entry: ``manifest``, ``block`` identity, ``checksum``, ``count``,
        ``time``."""
        return self._space_entry(space)

    def spaces(self) -> list[Selector]:
        """Every published space, in selector order."""
        return [Selector(k) for k, _ in self._scan_raw(self._spaces, b"", lambda k: False)]

    def block_identity(self, space: Selector) -> BlockIdentity:
        """The identity recorded for the space's block file at publication."""
        return BlockIdentity.from_record(self._space_entry(space)["block"])

    def block_path(self, space: Selector) -> pathlib.Path:
        """The published space's block file (``SpaceNotFoundError`` if unpublished)."""
        return self.path / "blocks" / self.block_identity(space).name

    def verify_space(self, space: Selector) -> BlockIdentity:
        """Check the block file is exactly the published one (``BlockFileError`` if not)."""
        ident = self.block_identity(space)
        verify_block_file(self.path / "blocks" / ident.name, ident, check_selector(space))
        return ident

    def open_reader(
        self, space: Selector, *, direct: bool = False, backend: str = "auto"
    ) -> RawReader:
        """A :class:`RawReader` on the space's block file, after :meth:`verify_space`.

        Raises
        ------
        SpaceNotFoundError, BlockFileError
            Unpublished space; missing, truncated or replaced block file.
        """
        ident = self.verify_space(space)
        return RawReader(
            self.path / "blocks" / ident.name, direct=direct, align=ident.align, backend=backend
        )

    def open_space(
        self,
        portal: str,
        space: Selector | None = None,
        *,
        right: str = "read",
        tenant: str | None = None,
    ):
        """Open a space through a portal token: the public path to a space's data.

        Returns the read-only :class:`portals.view.SpaceView` whose reads are
        checked against the portal's caveats (computed once, here).
        """
        from portals import open_space

        return open_space(self, portal, space, right=right, tenant=tenant)

    def __repr__(self) -> str:
        return f"Store({str(self.path)!r})"


class Snapshot:
    """One read transaction over a :class:`Store`, owned by the thread that made it.

    Lookups cost one LMDB ``get`` each, with no transaction setup; the view
    does not change while it is open.
    """

    def __init__(self, store: Store) -> None:
        self._store = store
        self._txn: lmdb.Transaction | None = store._begin_read()
        self._records = store._records

    def get(self, space: Selector, key: bytes) -> dict | None:
        """The record at ``(space, key)`` as of the snapshot, or ``None``."""
        if self._txn is None:
            raise StoreError("snapshot is closed")
        k = check_selector(space) + check_key(key)
        v = self._txn.get(k, db=self._records)
        return None if v is None else decode(v, f"record {k.hex()}")

    def scan(
        self, space: Selector, lo_cls: int = 0, hi_cls: int = 255
    ) -> Iterator[tuple[bytes, dict]]:
        """Like :meth:`Store.scan`, inside the snapshot's transaction."""
        if self._txn is None:
            raise StoreError("snapshot is closed")
        sel = check_selector(space)
        lo, hi = class_range_bounds(lo_cls, hi_cls)
        end = sel + hi
        cur = self._txn.cursor(db=self._records)
        if not cur.set_range(sel + lo):
            return
        for k, v in cur.iternext():
            if k > end:
                break
            yield k[SELECTOR_SIZE:], decode(v, f"record {k.hex()}")

    def close(self) -> None:
        """End the read transaction (idempotent)."""
        if self._txn is not None:
            self._store._end_read(self._txn)
            self._txn = None

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
