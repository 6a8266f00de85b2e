"""A read snapshot: one LMDB read transaction for many lookups in one thread.

:class:`Snapshot` is what :meth:`store.lmdb_store.Store.snapshot` returns. It
registers itself as a reader of its store (so the map is never remapped under
it) and counts itself in the store's thread-local snapshot depth (so reads in
the same thread never wait for a resize that is itself waiting for this
snapshot).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from itertools import chain, islice
from operator import itemgetter
from typing import TYPE_CHECKING

import lmdb

from czyx.key import KEY_SIZE, class_range_bounds
from czyx.space import SELECTOR_SIZE, Selector
from czyx.store.core.records import (
    MAGIC,
    SEEDS,
    check_key,
    check_selector,
    decode_sealed,
    sealed_ok,
    unpackb,
)
from czyx.store.errors import StoreError, StoreForkError

if TYPE_CHECKING:
    from czyx.store.core.lmdb_store import Store


_REC_SEED = SEEDS["records"]
_digest = __import__("xxhash").xxh3_64_digest
SCAN_CHUNK = 512  # rows per decoded chunk: small enough that its values stay cache-resident
_first = itemgetter(0)
_strip_selector = itemgetter(slice(SELECTOR_SIZE, None))


def decode_rows(rows: list[tuple[bytes, bytes]]) -> Iterator[tuple[bytes, dict]]:
    """``(24-byte key, record)`` pairs of a chunk of raw ``(selector || key, value)`` rows.

    The whole chunk is decoded in one comprehension and the keys are cut by
    C-level ``map`` calls; the caller chains the returned ``zip`` iterators
    with ``itertools.chain``, so handing out a record runs no Python frame.
    Profiled on 200k records these per-record costs (a generator resumption,
    a Python-level key slice) were most of what a scan added to raw py-lmdb.

    Raises
    ------
    RecordDecodeError
        A value does not decode to a msgpack map, or fails its index checksum
        (:class:`~store.errors.IndexChecksumError`), named by its key.
    """
    objs: list = []
    if sealed_ok(_REC_SEED, rows):
        try:
            objs = [unpackb(v[9:], raw=False, strict_map_key=False) for _, v in rows]
        except Exception:
            objs = []
    if len(objs) != len(rows) or (rows and set(map(type, objs)) != {dict}):
        for k, v in rows:  # find the culprit and raise naming its key
            decode_sealed(_REC_SEED, k, v, "record")
    return zip(map(_strip_selector, map(_first, rows)), objs)


def _cursor_chunks(
    cur: lmdb.Cursor, start: bytes, end: bytes
) -> Iterator[list[tuple[bytes, bytes]]]:
    """Lists of raw rows with ``start <= key < end``, sliced off ``cur`` in C."""
    if not cur.set_range(start):
        return
    it = cur.iternext()
    while True:
        rows = list(islice(it, SCAN_CHUNK))
        if rows and rows[-1][0] >= end:
            yield rows[: bisect_left(rows, end, key=_first)]
            return
        if rows:
            yield rows
        if len(rows) < SCAN_CHUNK:
            return


def _snapshot_closed(key: bytes) -> None:
    raise StoreError("snapshot is closed")


def _snapshot_forked(key: bytes) -> None:
    raise StoreForkError("snapshot opened before fork(): unusable in the child")


class Snapshot:
    """One read transaction over a :class:`Store`, owned by (and closed in) the thread
    that made it.

    Lookups cost one LMDB ``get`` each, with no transaction setup; the view
    does not change while it is open.
    """

    def __init__(self, store: Store) -> None:
        self._store = store
        self._txn: lmdb.Transaction | None = store._begin_read(store._records)
        self._tget = self._txn.get
        local = store._local
        local.snapshots = getattr(local, "snapshots", 0) + 1
        store._snapshots.add(self)

    def get(self, space: Selector, key: bytes) -> dict | None:
        """The record at ``(space, key)`` as of the snapshot, or ``None``."""
        sel = space.raw if type(space) is Selector else check_selector(space)
        k = sel + (key if type(key) is bytes and len(key) == KEY_SIZE else check_key(key))
        try:
            v = self._tget(k)
        except lmdb.Error as exc:
            raise StoreError(f"LMDB index is corrupt ({exc}); run `czyx store fsck`") from exc
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

    def scan(
        self, space: Selector, lo_cls: int = 0, hi_cls: int = 255
    ) -> Iterator[tuple[bytes, dict]]:
        """Like :meth:`Store.scan`, inside the snapshot's transaction.

        The arguments are checked when called; rows are read lazily, a chunk
        at a time, as the iterator is consumed.
        """
        if self._txn is None:
            self._tget(b"")  # raises: closed, or retired after fork
        sel = check_selector(space)
        lo, hi = class_range_bounds(lo_cls, hi_cls)
        chunks = _cursor_chunks(self._txn.cursor(), sel + lo, sel + hi + b"\x00")
        return chain.from_iterable(map(decode_rows, chunks))

    def close(self) -> None:
        """End the read transaction (idempotent)."""
        if self._txn is not None:
            self._store._end_read(self._txn)
            self._txn = None
            self._tget = _snapshot_closed
            self._store._local.snapshots -= 1
            self._store._snapshots.discard(self)

    def retire_after_fork(self, pinned: list) -> None:
        """In a fork child: refuse further use without ending the parent's transaction.

        The transaction object is moved to ``pinned`` (kept alive for the
        child's lifetime): aborting or freeing the child's copy would release
        the parent's reader slot.
        """
        if self._txn is not None:
            pinned.append(self._txn)
            self._txn = None
        self._tget = _snapshot_forked

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
