"""Byte-level helpers shared by the caveat and token codecs: LEB128 varints
and a bounds-checked reader that fails with :class:`TokenFormatError`."""

from __future__ import annotations

from czyx.portals.errors import TokenFormatError

# A varint never needs more than 10 bytes for the values we encode (< 2**64);
# refusing longer ones bounds the work done on garbage input.
_MAX_VARINT_BYTES = 10


def encode_varint(value: int) -> bytes:
    """Unsigned LEB128 encoding of ``value`` (minimal length)."""
    if value < 0:
        raise ValueError(f"varint: negative value {value}")
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


class Reader:
    """Sequential reader over ``data``; every short read is a ``TokenFormatError``."""

    __slots__ = ("data", "pos", "what")

    def __init__(self, data: bytes, what: str = "token") -> None:
        self.data = data
        self.pos = 0
        self.what = what

    def take(self, n: int, field: str) -> bytes:
        end = self.pos + n
        if n < 0 or end > len(self.data):
            raise TokenFormatError(
                f"{self.what}: truncated at byte {self.pos} reading {field} "
                f"({n} bytes wanted, {len(self.data) - self.pos} left)"
            )
        chunk = self.data[self.pos : end]
        self.pos = end
        return chunk

    def byte(self, field: str) -> int:
        return self.take(1, field)[0]

    def varint(self, field: str) -> int:
        value = 0
        for i in range(_MAX_VARINT_BYTES):
            b = self.byte(field)
            value |= (b & 0x7F) << (7 * i)
            if not b & 0x80:
                # Minimal encoding only: a trailing zero group would give a
                # second spelling of the same value.
                if b == 0 and i > 0:
                    raise TokenFormatError(f"{self.what}: non-minimal varint in {field}")
                return value
        raise TokenFormatError(f"{self.what}: varint too long in {field}")

    def remaining(self) -> int:
        return len(self.data) - self.pos

    def done(self, field: str) -> None:
        if self.pos != len(self.data):
            raise TokenFormatError(
                f"{self.what}: {len(self.data) - self.pos} unexpected trailing bytes after {field}"
            )
