"""The record codec: msgpack maps at ``(space, key)`` and the :class:`Extent` value.

Records are msgpack maps with string keys. Numpy scalars are accepted on the
way in (converted to Python numbers) so callers can store ``arr.shape`` or
``np.int64`` values without thinking about it; bytes stay bytes. Anything that
does not decode to a map raises :class:`~store.errors.RecordDecodeError`
naming where it came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import xxhash

from czyx.key import KEY_SIZE
from czyx.space import SELECTOR_SIZE, Selector
from czyx.store.errors import IndexChecksumError, KeyLengthError, RecordDecodeError


def _default(obj: Any) -> Any:
    # numpy scalars and small arrays show up in manifests (shapes, dtypes).
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(f"record: cannot encode {type(obj).__name__}")


_packer_opts = {"use_bin_type": True, "default": _default}


def encode(record: dict) -> bytes:
    """Encode one record (a ``dict`` with string keys) as msgpack bytes.

    Raises
    ------
    TypeError
        If ``record`` is not a dict or holds a value msgpack cannot encode.
    """
    if not isinstance(record, dict):
        raise TypeError(f"record: expected a dict, got {type(record).__name__}")
    return msgpack.packb(record, **_packer_opts)


# Bound once: the read hot paths call it per record.
unpackb = msgpack.unpackb


def decode(data: bytes | memoryview, where: str = "record", key: bytes | None = None) -> dict:
    """Decode msgpack bytes into a dict.

    Parameters
    ----------
    data
        The stored value.
    where, key
        Name the value's source in errors (``key`` is shown in hex); the
        message is only built on failure, since this runs once per record read.

    Raises
    ------
    RecordDecodeError
        If the bytes are not one complete msgpack map.
    """
    try:
        obj = unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise RecordDecodeError(f"{_where(where, key)}: undecodable msgpack ({exc})") from exc
    if type(obj) is not dict:
        raise RecordDecodeError(
            f"{_where(where, key)}: expected a msgpack map, got {type(obj).__name__}"
        )
    return obj


# -- sealed values: every value in the index carries a checksum -------------------------
#
# A stored value is ``MAGIC || xxh3_64(key || payload, seed=db) || payload``. MAGIC is
# 0xC1, the one byte msgpack never emits, so a sealed value can never be mistaken for
# a bare msgpack map (the format before checksums). The checksum covers the LMDB key
# too, so a value moved to another key (or a flipped key bit) fails as surely as a
# flipped value bit; the seed names the database, so a value cannot pass in another.

MAGIC = b"\xc1"
SEAL_SIZE = 9  # MAGIC + 8-byte digest
SEEDS = {"records": 1, "spaces": 2, "tags": 3, "portals": 4, "edges": 5, "audit": 6, "meta": 7}
_digest = xxhash.xxh3_64_digest


def seal(seed: int, key: bytes, payload: bytes) -> bytes:
    """The stored form of ``payload`` at ``key`` in the database of ``seed`` (see above)."""
    return MAGIC + _digest(key + payload, seed) + payload


def unseal(seed: int, key: bytes, value: bytes, where: str = "record") -> bytes:
    """The payload of a sealed value, after checking its checksum.

    Raises
    ------
    IndexChecksumError
        The value is not sealed, or its bytes (or its key) changed since it was written.
    """
    if value[:SEAL_SIZE] != MAGIC + _digest(key + value[SEAL_SIZE:], seed):
        raise IndexChecksumError(
            f"{_where(where, key)}: index checksum mismatch (the LMDB value or key is "
            "corrupt); run `czyx store fsck`"
        )
    return value[SEAL_SIZE:]


def sealed_ok(seed: int, rows: list[tuple[bytes, bytes]]) -> bool:
    """Whether every ``(key, value)`` of ``rows`` is intact (one comprehension, no frames)."""
    m, d = MAGIC, _digest
    return all([v[:9] == m + d(k + v[9:], seed) for k, v in rows])


def decode_sealed(seed: int, key: bytes, value: bytes, where: str = "record") -> dict:
    """:func:`unseal`, then :func:`decode`."""
    return decode(unseal(seed, key, value, where), where, key)


def _where(where: str, key: bytes | None) -> str:
    return where if key is None else f"{where} {bytes(key).hex()}"


def check_key(key: bytes) -> bytes:
    """Return ``key`` as bytes if it is a 24-byte key, else raise :class:`KeyLengthError`."""
    if type(key) is not bytes:
        if not isinstance(key, bytes | bytearray | memoryview):
            raise KeyLengthError(f"key: expected bytes, got {type(key).__name__}")
        key = bytes(key)
    if len(key) != KEY_SIZE:
        raise KeyLengthError(f"key: expected {KEY_SIZE} bytes, got {len(key)}")
    return key


def check_selector(space: Selector | bytes) -> bytes:
    """Return the 32 raw bytes of a selector (a :class:`Selector` or raw bytes)."""
    if isinstance(space, Selector):
        return space.raw
    if isinstance(space, bytes | bytearray) and len(space) == SELECTOR_SIZE:
        return bytes(space)
    raise KeyLengthError(
        f"space: expected a Selector or {SELECTOR_SIZE} bytes, got {type(space).__name__}"
        + (f" of length {len(space)}" if isinstance(space, bytes | bytearray) else "")
    )


@dataclass(frozen=True)
class Extent:
    """A checksummed byte range of a space's block file.

    Attributes
    ----------
    offset
        Byte offset in the block file, a multiple of the file's alignment.
    length
        Exact byte count of the payload (the padding to the next aligned
        offset is not part of it).
    checksum
        XXH3-64 of the payload (see :mod:`store.checksum`).
    """

    offset: int
    length: int
    checksum: int

    def record(self) -> dict:
        """The record fields that locate this extent: ``{"off", "len", "sum"}``."""
        return {"off": self.offset, "len": self.length, "sum": self.checksum}

    @classmethod
    def from_record(cls, record: dict, where: str = "record") -> Extent:
        """Read ``off``/``len``/``sum`` back out of a record.

        Raises
        ------
        RecordDecodeError
            If a field is missing or not a non-negative integer.
        """
        try:
            off, length, s = record["off"], record["len"], record["sum"]
        except (KeyError, TypeError) as exc:
            raise RecordDecodeError(f"{where}: no extent fields off/len/sum ({exc})") from exc
        for name, v in (("off", off), ("len", length), ("sum", s)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise RecordDecodeError(f"{where}: extent field {name}={v!r} is not an int >= 0")
        return cls(off, length, s)
