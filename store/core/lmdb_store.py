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
  never hold a transaction while the caller runs. Readers announce
  themselves by appending to a list and re-check a ``resizing`` flag (both
  atomic under the GIL), which costs ~50 ns instead of a lock per read.
- An environment must not be used across ``fork()``: in a fork child every
  inherited store refuses use with ``StoreForkError``. Right after the fork
  the child closes its copies of the environments that were idle, so it can
  ``Store.open`` them afresh; one that had a transaction in flight is pinned
  open instead, because closing it would release the parent's reader slot
  (see :func:`store.lifecycle.close_inherited`).

Integrity of the index (why, and what happens to older stores):

- Every value in every database is *sealed* (:func:`store.core.records.seal`): an
  XXH3-64 over its key and bytes, checked on every read, so one flipped bit in a
  manifest, a config, an extent record, a tag, a portal or session record is a
  typed :class:`~store.errors.IndexChecksumError`, never a different computation.
  ``fsck`` checks every value, and that each space holds the records it was
  published with.
- Before LMDB maps ``data.mdb`` its two meta pages are read with plain ``read``:
  a file shorter than the pages its newest meta page claims is refused with
  :class:`~store.errors.IndexCorruptError` (mapping it would die with SIGBUS on
  the first touch past the end). LMDB's own corruption errors are typed too.
- Reader slots left by killed processes are reclaimed on every open
  (``reader_check``), so they cannot fill the reader table.
- A store whose creation was killed before its databases existed (an empty or
  header-only index, and no block files) is re-created by the next open.
- Stores written before checksums (no ``meta`` database: format 1) are migrated
  in place, in one write transaction, by the first writable open; a read-only
  open of such a store is refused with a message saying so (``czyx store
  migrate``), because reading unchecked values is exactly what this prevents.
"""

from __future__ import annotations

import os
import pathlib
import threading
import time
import weakref
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from itertools import chain, islice
from operator import itemgetter
from typing import Any, TypeVar

import lmdb

from czyx.key import KEY_SIZE, class_range_bounds
from czyx.space import SELECTOR_SIZE, Selector
from czyx.store.core.blockfile import BlockIdentity, verify_block_file
from czyx.store.core.catalog import CatalogMixin
from czyx.store.core.lifecycle import OPEN_STORES, Unusable
from czyx.store.core.records import (
    MAGIC,
    SEEDS,
    check_key,
    check_selector,
    decode_sealed,
    encode,
    seal,
    sealed_ok,
    unpackb,
    unseal,
)
from czyx.store.core.snapshot import SCAN_CHUNK as _SCAN_CHUNK
from czyx.store.core.snapshot import Snapshot, decode_rows
from czyx.store.core.writer import SpaceWriter
from czyx.store.errors import (
    IndexCorruptError,
    RecordDecodeError,
    ReservedSpaceError,
    SealedSpaceError,
    SpaceInUseError,
    SpaceNotFoundError,
    StoreError,
    StoreMapFullError,
)
from czyx.store.interfaces import StoreInterface
from czyx.store.io.reader import RawReader

T = TypeVar("T")

DEFAULT_MAP_SIZE = 1 << 30  # virtual reservation only; the file grows as written
MAX_MAP_SIZE = 1 << 40
_DBS = ("records", "spaces", "tags", "portals", "edges", "audit")
FORMAT = b"2"  # 1: bare msgpack values; 2: every value sealed (records.seal)
_FORMAT_KEY = b"format"
_REC_SEED = SEEDS["records"]
_digest = __import__("xxhash").xxh3_64_digest


def _corrupt(where: object, exc: BaseException) -> IndexCorruptError:
    return IndexCorruptError(f"{where}: LMDB index is corrupt ({exc}); run `czyx store fsck`")


def check_index_file(data: pathlib.Path) -> str:
    """Check ``data.mdb`` is as long as its newest meta page says, before LMDB maps it.

    Returns ``"ok"``, or ``"uninitialised"`` for a file shorter than LMDB's two meta
    pages or with neither meta page valid (creation killed before LMDB wrote them).

    Raises
    ------
    IndexCorruptError
        The file is truncated: shorter than its last page. Mapping it would raise
        SIGBUS on the first read past its end.
    """
    import struct

    size = data.stat().st_size
    with open(data, "rb") as f:
        head = f.read(2 * 65536)
    metas = []
    # Meta page 0 sits at offset 0; its free-DB record's md_pad holds the page size,
    # and meta page 1 sits at that offset.
    if len(head) >= 16 + 24 + 96 + 16:
        magic, _ver = struct.unpack_from("<II", head, 16)
        if magic == 0xBEEFC0DE:
            psize = struct.unpack_from("<I", head, 16 + 24)[0]
            if psize in (4096, 8192, 16384, 32768, 65536):
                for base in (0, psize):
                    if len(head) < base + 16 + 24 + 96 + 16:
                        continue
                    m = struct.unpack_from("<I", head, base + 16)[0]
                    if m != 0xBEEFC0DE:
                        continue
                    last_pg, txnid = struct.unpack_from("<QQ", head, base + 16 + 24 + 96)
                    metas.append((txnid, last_pg, psize))
    if not metas:
        if size < 2 * 4096:
            return "uninitialised"
        raise IndexCorruptError(f"{data}: not an LMDB file (no valid meta page)")
    _, last_pg, psize = max(metas)
    need = (last_pg + 1) * psize
    if size < need:
        raise IndexCorruptError(
            f"{data}: truncated LMDB index ({size} bytes, its last page ends at {need}); "
            "restore it from a copy"
        )
    return "ok"


def _migrate_in(env: lmdb.Environment, txn: lmdb.Transaction) -> int:
    """Seal every value of a format-1 store inside ``txn``; returns how many were sealed."""
    n = 0
    for name in _DBS:
        db = env.open_db(name.encode(), txn=txn, create=True)
        seed = SEEDS[name]
        with txn.cursor(db=db) as cur:
            rows = list(cur.iternext())  # format 1: no value is sealed yet
        with txn.cursor(db=db) as cur:
            cur.putmulti([(k, seal(seed, k, v)) for k, v in rows])
        n += len(rows)
    return n


def _has_blocks(root: pathlib.Path) -> bool:
    blocks = root / "blocks"
    return blocks.is_dir() and any(p.suffix in (".blk", ".part") for p in blocks.iterdir())


class _Retry(Exception):
    """Internal: a read met a map resize and takes the slow path."""


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
        self._db["meta"] = env.open_db(b"meta", create=False)
        self._records = self._db["records"]
        self._spaces = self._db["spaces"]
        # Active read transactions of this process: the map is only remapped at zero,
        # while holding the lock, so no reader can begin during the remap.
        self._lock = threading.Lock()  # held while remapping: readers wait on it
        # Serialises this process's write transactions and resizes: LMDB refuses to
        # resize while a write transaction of the process is open (EINVAL).
        self._wlock = threading.RLock()
        self._writing = 0  # write transactions in flight (see store.lifecycle)
        self._readers: list[None] = []
        self._resizing = False
        # Snapshots open in the current thread: such a thread must not wait for a
        # resize (the resize waits for its snapshot: a deadlock), and need not (its
        # snapshot is in _readers, so the resize cannot start before it closes).
        self._local = threading.local()
        self._snapshots: weakref.WeakSet[Snapshot] = weakref.WeakSet()
        OPEN_STORES.add(self)

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
        data = index / "data.mdb"
        if not data.exists():
            if readonly or not create:
                raise StoreError(f"{root}: no store here (missing {data})")
            (root / "blocks").mkdir(parents=True, exist_ok=True)
            index.mkdir(exist_ok=True)
        elif not data.is_file():
            raise IndexCorruptError(f"{data}: not a regular file")
        elif check_index_file(data) == "uninitialised":
            cls._repair_uninitialised(root)
        env = cls._open_env(index, map_size, readonly)
        try:
            env.reader_check()  # reclaim reader slots of processes that died
            if not cls._prepare(env, root, readonly):
                # Read-only open of a store whose creation was killed before its
                # databases existed (nothing was ever stored): create them, reopen.
                env.close()
                w = cls._open_env(index, map_size, False)
                try:
                    cls._prepare(w, root, False)
                finally:
                    w.close()
                env = cls._open_env(index, map_size, readonly)
                cls._prepare(env, root, readonly)
            return cls(root, env, readonly, max_map_size)
        except lmdb.Error as exc:
            env.close()
            raise _corrupt(index, exc) from exc
        except BaseException:
            env.close()
            raise

    @staticmethod
    def _repair_uninitialised(root: pathlib.Path) -> None:
        """Re-create an index whose creation was killed before LMDB initialised it.

        Only when no block file exists: with block files present the index held
        (or was about to hold) published spaces, and re-creating it would orphan them.
        """
        index = root / "index"
        if _has_blocks(root):
            raise IndexCorruptError(
                f"{index / 'data.mdb'}: the index is empty or unreadable but block files "
                "exist; restore the index from a copy"
            )
        for name in ("data.mdb", "lock.mdb"):
            (index / name).unlink(missing_ok=True)
        env = Store._open_env(index, DEFAULT_MAP_SIZE, False)
        try:
            Store._prepare(env, root, False)
        finally:
            env.close()

    @staticmethod
    def _prepare(env: lmdb.Environment, root: pathlib.Path, readonly: bool) -> bool:
        """Create missing databases (a new store), migrate format 1, check the format.

        Returns ``False`` (read-only only) when the databases were never created and
        no block file exists: the caller re-creates them with a writable open.
        """
        with env.begin() as txn:
            present = {name for name in (*_DBS, "meta") if txn.get(name.encode()) is not None}
        if readonly:
            if not present and not _has_blocks(root):
                return False
            missing = set(_DBS) - present
            if missing:
                raise StoreError(f"{root}: store databases missing ({sorted(missing)})")
            if "meta" not in present:
                raise StoreError(
                    f"{root}: this store predates index checksums (format 1); migrate it "
                    f"once with `czyx store migrate --store {root}` (any writable open does)"
                )
        else:
            with env.begin(write=True) as txn:
                legacy = "records" in present and "meta" not in present
                for name in _DBS:
                    env.open_db(name.encode(), txn=txn, create=True)
                meta = env.open_db(b"meta", txn=txn, create=True)
                if legacy:
                    _migrate_in(env, txn)
                if txn.get(_FORMAT_KEY, db=meta) is None:
                    txn.put(_FORMAT_KEY, seal(SEEDS["meta"], _FORMAT_KEY, FORMAT), db=meta)
        with env.begin() as txn:
            meta = env.open_db(b"meta", txn=txn, create=False)
            raw = txn.get(_FORMAT_KEY, db=meta)
        fmt = None if raw is None else unseal(SEEDS["meta"], _FORMAT_KEY, raw, "store format")
        if fmt != FORMAT:
            raise StoreError(f"{root}: unknown store format {fmt!r} (this czyx reads {FORMAT!r})")
        return True

    @staticmethod
    def _open_env(index: pathlib.Path, map_size: int, readonly: bool) -> lmdb.Environment:
        try:
            return lmdb.open(
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
            hint = ""
            if "already open" in str(exc):
                hint = (
                    "; if this process was forked while the parent used this store, open it"
                    " in a spawned process instead"
                )
            raise StoreError(f"{index}: cannot open LMDB environment ({exc}){hint}") from exc

    def close(self) -> None:
        """Close the environment (idempotent; in a fork child it was closed at fork)."""
        env = self._env
        if isinstance(env, Unusable):
            return
        self._env = Unusable(StoreError, f"{self.path}: store is closed")
        OPEN_STORES.discard(self)
        env.close()

    @property
    def closed(self) -> bool:
        """Whether this handle can no longer be used (closed, or inherited across fork)."""
        return isinstance(self._env, Unusable)

    # -- transactions ------------------------------------------------------------------
    def _begin_read(self, db: Any = None) -> lmdb.Transaction:
        """Begin a read transaction registered in ``_readers`` (end it with ``_end_read``)."""
        readers = self._readers
        while True:
            readers.append(None)
            if self._resizing and not getattr(self._local, "snapshots", 0):
                # A resize is in progress: step back and wait for it.
                readers.pop()
                with self._lock:
                    pass
                continue
            try:
                return self._env.begin(db=db)
            except lmdb.MapResizedError:
                # Another process grew the map past ours: adopt its size and retry.
                readers.pop()
                self._remap(0)
            except BaseException:
                readers.pop()
                raise

    def _end_read(self, txn: lmdb.Transaction) -> None:
        txn.abort()
        self._readers.pop()

    def _remap(self, new_size: int) -> None:
        """Resize the map once no read transaction of this process is open.

        The flag is set before the reader count is checked and readers check
        the flag after registering, so (under the GIL's sequential
        consistency) a reader either is counted here or sees the flag.
        """
        if getattr(self._local, "snapshots", 0):
            raise StoreMapFullError(
                f"{self.path}: the LMDB map must grow, but this thread holds an open "
                "snapshot; close it and retry"
            )
        with self._wlock, self._lock:
            self._resizing = True
            try:
                deadline = time.monotonic() + 30.0
                while self._readers:
                    if time.monotonic() > deadline:
                        raise StoreMapFullError(
                            f"{self.path}: cannot resize the LMDB map while read "
                            "transactions stay open"
                        )
                    time.sleep(0.001)
                self._env.set_mapsize(new_size)
            finally:
                self._resizing = False

    def _write(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """Run ``fn`` in one write transaction, growing the map and retrying on MapFull."""
        if self.readonly:
            raise StoreError(f"{self.path}: store is open read-only")
        with self._wlock:
            self._writing += 1
            try:
                return self._write_locked(fn)
            finally:
                self._writing -= 1

    def _write_locked(self, fn: Callable[[lmdb.Transaction], T]) -> T:
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
        v = seal(_REC_SEED, k, encode(record))

        def fn(txn: lmdb.Transaction) -> None:
            self._refuse_sealed(txn, k[:SELECTOR_SIZE])
            txn.put(k, v, db=self._records)

        self._write(fn)

    def put_many(self, space: Selector, items: Iterable[tuple[bytes, dict]]) -> int:
        """Store many records in one transaction; returns how many were written."""
        sel = self._writable_space(space)
        rows = [
            (sk, seal(_REC_SEED, sk, encode(r)))
            for sk, r in ((sel + check_key(k), r) for k, r in items)
        ]

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
        # The common case (a Selector and a 24-byte bytes key) is checked inline:
        # this is the store's point-read hot path.
        sel = space.raw if type(space) is Selector else check_selector(space)
        k = sel + (key if type(key) is bytes and len(key) == KEY_SIZE else check_key(key))
        readers = self._readers  # _begin_read, inlined
        readers.append(None)
        try:
            if self._resizing:
                raise _Retry
            txn = self._env.begin(db=self._records)
        except (_Retry, lmdb.MapResizedError):
            readers.pop()
            return self._get_slow(k)
        except BaseException:
            readers.pop()
            raise
        try:
            v = txn.get(k)
        except lmdb.Error as exc:
            raise _corrupt(self.path, exc) from exc
        finally:
            txn.abort()
            readers.pop()
        if v is None:
            return None
        if v[:9] == MAGIC + _digest(k + v[9:], _REC_SEED):
            try:
                obj = unpackb(v[9:], raw=False, strict_map_key=False)
            except Exception:
                obj = None
            if type(obj) is dict:
                return obj
        return decode_sealed(_REC_SEED, k, v, "record")  # raises, naming the fault

    def _get_slow(self, k: bytes) -> dict | None:
        txn = self._begin_read(self._records)  # waits out a resize, adopts a new map size
        try:
            v = txn.get(k)
        except lmdb.Error as exc:
            raise _corrupt(self.path, exc) from exc
        finally:
            self._end_read(txn)
        return None if v is None else decode_sealed(_REC_SEED, k, v, "record")

    def get_many(self, space: Selector, keys: Iterable[bytes]) -> list[dict | None]:
        """The records at many keys of one space, read in one transaction."""
        sel = check_selector(space)
        full = [sel + check_key(k) for k in keys]
        txn = self._begin_read(self._records)
        try:
            vals = [txn.get(k) for k in full]
        except lmdb.Error as exc:
            raise _corrupt(self.path, exc) from exc
        finally:
            self._end_read(txn)
        return [
            None if v is None else decode_sealed(_REC_SEED, k, v, "record")
            for k, v in zip(full, vals)
        ]

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

    def _scan_chunks(
        self, db: Any, start: bytes, end: bytes | None
    ) -> Iterator[list[tuple[bytes, bytes]]]:
        """Lists of raw ``(key, value)`` pairs with ``start <= key < end`` (``None``: no end).

        Each chunk is read in its own short read transaction, so no transaction
        is held while the caller consumes the rows; a chunk is sliced off the
        cursor in C (``islice``) and cut at ``end`` by bisection, so the bound
        costs nothing per key.
        """
        cursor_key, skip = start, False
        while True:
            txn = self._begin_read(db)
            try:
                cur = txn.cursor()
                rows: list[tuple[bytes, bytes]] = []
                if cur.set_range(cursor_key):
                    it = cur.iternext()
                    if skip:
                        next(it, None)
                    rows = list(islice(it, _SCAN_CHUNK))
            except lmdb.Error as exc:
                raise _corrupt(self.path, exc) from exc
            finally:
                self._end_read(txn)
            full = len(rows) == _SCAN_CHUNK
            if end is not None and rows and rows[-1][0] >= end:
                rows = rows[: bisect_left(rows, end, key=itemgetter(0))]
                full = False
            if rows:
                yield rows
            if not full:
                return
            cursor_key, skip = rows[-1][0], True

    def _scan_raw(self, db: Any, start: bytes, end: bytes | None) -> Iterator[tuple[bytes, bytes]]:
        """Raw ``(key, value)`` pairs, chunk by chunk (see :meth:`_scan_chunks`)."""
        for rows in self._scan_chunks(db, start, end):
            yield from rows

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
        # A C-level chain over decoded chunks (see ``decode_rows``): no Python frame
        # runs per record. Arguments are checked here, rows read as consumed.
        chunks = self._scan_chunks(self._records, sel + lo, sel + hi + b"\x00")
        return chain.from_iterable(map(decode_rows, chunks))

    def keys(self, space: Selector, lo_cls: int = 0, hi_cls: int = 255) -> Iterator[bytes]:
        """The 24-byte keys of classes ``lo_cls..hi_cls``, in order, without decoding values."""
        sel = check_selector(space)
        lo, hi = class_range_bounds(lo_cls, hi_cls)
        chunks = self._scan_chunks(self._records, sel + lo, sel + hi + b"\x00")
        # C-level maps over chained chunks: no Python frame runs per key.
        strip = itemgetter(slice(SELECTOR_SIZE, None))
        return map(strip, map(itemgetter(0), chain.from_iterable(chunks)))

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
        except lmdb.Error as exc:
            raise _corrupt(self.path, exc) from exc
        finally:
            self._end_read(txn)
        if v is None:
            raise SpaceNotFoundError(f"space {sel.hex()} is not published")
        entry = decode_sealed(SEEDS["spaces"], sel, v, "space entry")
        if not isinstance(entry.get("manifest"), dict) or not isinstance(entry.get("block"), dict):
            raise RecordDecodeError(f"space entry {sel.hex()}: no manifest or block identity")
        return entry

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
        rows = list(self._scan_raw(self._spaces, b"", None))
        if not sealed_ok(SEEDS["spaces"], rows):
            for k, v in rows:
                unseal(SEEDS["spaces"], k, v, "space entry")  # raises, naming the entry
        return [Selector(k) for k, _ in rows]

    def remove_space(self, space: Selector) -> pathlib.Path | None:
        """Delete a published space that nothing names any more; free its block file.

        The space's records and index entry go in one write transaction, which
        first checks, inside that transaction, that no tag points at the space.
        Links between spaces (a model version's trunk, an adapter's base) are
        the caller's to check: the store does not read manifests (see
        :func:`czyx.portals.model.remove_version`). The block file is unlinked
        after the commit, unless another space was published over the same
        file. A crash between the two leaves an unreferenced block file, which
        :func:`collect_garbage` removes.

        Returns
        -------
        pathlib.Path or None
            The block file removed; ``None`` if ``space`` was not published (or
            another space still uses its block file, which then stays).

        Raises
        ------
        SpaceInUseError
            A tag still names ``space``; nothing changes.
        """
        sel = check_selector(space)

        def fn(txn: lmdb.Transaction) -> str | None:
            raw = txn.get(sel, db=self._spaces)
            if raw is None:
                return None
            entry = decode_sealed(SEEDS["spaces"], sel, raw, "space entry")
            block = BlockIdentity.from_record(entry["block"]).name
            tags = sorted(
                k.decode(errors="replace")
                for k, v in txn.cursor(db=self._db["tags"])
                if unseal(SEEDS["tags"], k, v, "tag") == sel
            )
            if tags:
                raise SpaceInUseError(f"space {sel.hex()[:16]} is still tagged {', '.join(tags)}")
            shared = any(
                BlockIdentity.from_record(
                    decode_sealed(SEEDS["spaces"], k, v, "space entry")["block"]
                ).name
                == block
                for k, v in txn.cursor(db=self._spaces)
                if k != sel
            )
            with txn.cursor(db=self._records) as cur:
                if cur.set_range(sel):
                    while cur.key()[:SELECTOR_SIZE] == sel and cur.delete():
                        pass
            txn.delete(sel, db=self._spaces)
            self._audit_in(txn, "space.remove", {"space": sel.hex(), "block": block})
            return None if shared else block

        if not self.has_space(sel):
            return None
        block = self._write(fn)
        if block is None:
            return None
        path = self.path / "blocks" / block
        path.unlink(missing_ok=True)
        return path

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
        self,
        space: Selector,
        *,
        direct: bool = False,
        mapped: bool = False,
        backend: str = "auto",
    ) -> RawReader:
        """A :class:`RawReader` on the space's block file, after :meth:`verify_space`.

        Raises
        ------
        SpaceNotFoundError, BlockFileError
            Unpublished space; missing, truncated or replaced block file.
        """
        ident = self.verify_space(space)
        return RawReader(
            self.path / "blocks" / ident.name,
            direct=direct,
            mapped=mapped,
            align=ident.align,
            backend=backend,
        )

    def __repr__(self) -> str:
        return f"Store({str(self.path)!r})"
