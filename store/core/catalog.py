"""The store's catalog databases: tags, portal descriptors, edges and the audit log.

A mixin of :class:`store.lmdb_store.Store`: it relies on the store's
``_write`` (a re-runnable write transaction that grows the map), ``_begin_read``
/ ``_end_read`` and ``_scan_raw`` (chunked scans), and ``_db`` (the named
databases). Tags are never re-pointed silently; the audit log is append-only
with a monotonic 8-byte big-endian sequence key, written in the same
transaction as the change it records where the store makes the change itself.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator
from typing import Any

import lmdb

from czyx.space import Selector
from czyx.store.core.records import SEEDS, check_selector, decode_sealed, seal, unseal
from czyx.store.core.records import encode as encode
from czyx.store.errors import (
    KeyLengthError,
    RecordDecodeError,
    TagConflictError,
    TagNotFoundError,
)

MAX_KEY = 511  # LMDB's default maximum key size
_SEQ = struct.Struct(">Q")
_TAG = SEEDS["tags"]


def _tag_target(key: bytes, value: bytes) -> bytes:
    sel = unseal(_TAG, key, value, "tag")
    if len(sel) != 32:
        raise RecordDecodeError(f"tag {key!r}: target is {len(sel)} bytes, not a selector")
    return sel


def _check_blob_key(what: str, key: bytes) -> bytes:
    if not isinstance(key, bytes | bytearray) or not 0 < len(key) <= MAX_KEY:
        raise KeyLengthError(f"{what}: expected 1..{MAX_KEY} bytes, got {key!r:.60}")
    return bytes(key)


def prefix_end(prefix: bytes) -> bytes | None:
    """The smallest key greater than every key starting with ``prefix`` (``None``: none)."""
    p = prefix.rstrip(b"\xff")
    return p[:-1] + bytes((p[-1] + 1,)) if p else None


def _tag_key(tag: str) -> bytes:
    if not isinstance(tag, str) or not tag or "\x00" in tag:
        raise ValueError(f"tag: {tag!r} is not a non-empty string without NUL")
    t = tag.encode()
    if len(t) > MAX_KEY:
        raise ValueError(f"tag: longer than {MAX_KEY} bytes")
    return t


class CatalogMixin:
    """Tags, portal descriptors, edges and audit log of a store (see module docstring)."""

    # -- tags --------------------------------------------------------------------------
    def set_tag(self, tag: str, space: Selector) -> None:
        """Point ``tag`` at ``space`` (idempotent).

        Raises
        ------
        TagConflictError
            ``tag`` already points at another space (remove it first).
        """
        t = _tag_key(tag)
        sel = check_selector(space)

        def fn(txn: lmdb.Transaction) -> None:
            old = txn.get(t, db=self._db["tags"])
            if old is not None:
                old = _tag_target(t, old)
            if old is not None and old != sel:
                raise TagConflictError(f"tag {tag!r} points at {old.hex()}, not {sel.hex()}")
            if old is None:
                txn.put(t, seal(_TAG, t, sel), db=self._db["tags"])
                self._audit_in(txn, "tag.set", {"tag": tag, "space": sel.hex()})

        self._write(fn)

    def remove_tag(self, tag: str) -> bool:
        """Remove ``tag``; ``True`` if it existed."""
        t = _tag_key(tag)

        def fn(txn: lmdb.Transaction) -> bool:
            old = txn.pop(t, db=self._db["tags"])
            if old is not None:
                try:
                    target = _tag_target(t, old).hex()
                except RecordDecodeError:
                    target = "corrupt"  # removing a damaged tag is how it is repaired
                self._audit_in(txn, "tag.remove", {"tag": tag, "space": target})
            return old is not None

        return self._write(fn)

    def resolve_tag(self, tag: str) -> Selector:
        """The space ``tag`` points at (``TagNotFoundError`` otherwise)."""
        t = _tag_key(tag)
        txn = self._begin_read()
        try:
            v = txn.get(t, db=self._db["tags"])
        finally:
            self._end_read(txn)
        if v is None:
            raise TagNotFoundError(f"tag {tag!r} not found")
        return Selector(_tag_target(t, v))

    def tags(self) -> dict[str, Selector]:
        """Every tag and the space it points at."""
        rows = self._scan_raw(self._db["tags"], b"", None)
        out = {}
        for k, v in rows:
            sel = _tag_target(k, v)
            try:
                out[k.decode()] = Selector(sel)
            except UnicodeDecodeError as exc:
                raise RecordDecodeError(f"tag {k!r}: not UTF-8") from exc
        return out

    # -- portal descriptors and edges ----------------------------------------------------
    def _put_blob(self, db: str, key: bytes, record: dict) -> None:
        v = seal(SEEDS[db], key, encode(record))
        self._write(lambda txn: txn.put(key, v, db=self._db[db]))

    def _get_blob(self, db: str, key: bytes) -> dict | None:
        txn = self._begin_read()
        try:
            v = txn.get(key, db=self._db[db])
        finally:
            self._end_read(txn)
        return None if v is None else decode_sealed(SEEDS[db], key, v, db)

    def _prefix(self, db: str, prefix: bytes) -> Iterator[tuple[bytes, dict]]:
        for k, v in self._scan_raw(self._db[db], prefix, prefix_end(prefix)):
            yield k, decode_sealed(SEEDS[db], k, v, db)

    def put_portal_descriptor(self, portal_id: bytes, record: dict) -> None:
        """Store (or replace) the descriptor of portal ``portal_id``."""
        self._put_blob("portals", _check_blob_key("portal id", portal_id), record)

    def get_portal_descriptor(self, portal_id: bytes) -> dict | None:
        """The descriptor of ``portal_id``, or ``None``."""
        return self._get_blob("portals", _check_blob_key("portal id", portal_id))

    def portal_descriptors(self) -> Iterator[tuple[bytes, dict]]:
        """Every portal descriptor, in id order."""
        return self._prefix("portals", b"")

    def put_edge(self, key: bytes, record: dict) -> None:
        """Store (or replace) the association edge at ``key``."""
        self._put_blob("edges", _check_blob_key("edge key", key), record)

    def get_edge(self, key: bytes) -> dict | None:
        """The edge at ``key``, or ``None``."""
        return self._get_blob("edges", _check_blob_key("edge key", key))

    def delete_edge(self, key: bytes) -> bool:
        """Delete the edge at ``key``; ``True`` if it existed."""
        k = _check_blob_key("edge key", key)
        return self._write(lambda txn: txn.delete(k, db=self._db["edges"]))

    def edges(self, prefix: bytes = b"") -> Iterator[tuple[bytes, dict]]:
        """Edges whose key starts with ``prefix``, in key order."""
        return self._prefix("edges", bytes(prefix))

    # -- audit log ---------------------------------------------------------------------
    def _audit_in(self, txn: lmdb.Transaction, event: str, fields: dict) -> int:
        with txn.cursor(db=self._db["audit"]) as cur:
            seq = _SEQ.unpack(cur.key())[0] + 1 if cur.last() else 1
        entry = {**fields, "seq": seq, "time": time.time(), "event": event}
        k = _SEQ.pack(seq)
        txn.put(k, seal(SEEDS["audit"], k, encode(entry)), db=self._db["audit"], append=True)
        return seq

    def audit(self, event: str, **fields: Any) -> None:
        """Append ``event`` with ``fields`` to the log (sequence number and time added)."""
        if not isinstance(event, str) or not event:
            raise ValueError("audit: event must be a non-empty string")
        encode(fields)  # fail before taking the write lock
        self._write(lambda txn: self._audit_in(txn, event, fields))

    def audit_log(self, since: int = 0) -> Iterator[dict]:
        """Audit entries with ``seq > since``, oldest first."""
        for k, v in self._scan_raw(self._db["audit"], _SEQ.pack(since + 1), None):
            yield decode_sealed(SEEDS["audit"], k, v, "audit entry")
