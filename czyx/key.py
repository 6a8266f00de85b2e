"""The 24-byte CZYX key: ``class byte || 184-bit big-endian curve code of (z, y, x)``.

Packed keys sort as ``(class, curve ordinal)``, so LMDB's lexicographic order
is the curve order inside each class and a class (or class range) is a key
prefix (range).
"""

from __future__ import annotations

from dataclasses import dataclass

from curves.base import Curve
from curves.morton import MortonCurve

KEY_SIZE = 24
CODE_SIZE = KEY_SIZE - 1
COORD_BITS = 61
COORD_LIMIT = 1 << COORD_BITS

# Named classes of general (non-expert) spaces. In an expert space every
# class value is an expert selector instead.
MEM = 0x4D  # 'M' memory
SES = 0x53  # 'S' session / thread
PRJ = 0x50  # 'P' project-internal
EDG = 0x45  # 'E' association edge

DEFAULT_CURVE: Curve = MortonCurve(ndim=3, bits=COORD_BITS)


def _check_class(cls: int) -> None:
    if not isinstance(cls, int) or isinstance(cls, bool) or not 0 <= cls <= 0xFF:
        raise ValueError(f"class: {cls!r} is not a byte (0..255)")


def _check_coord(name: str, v: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"{name}: {v!r} is not an integer")
    if not 0 <= v < COORD_LIMIT:
        raise ValueError(f"{name}: {v} outside [0, 2**{COORD_BITS})")


@dataclass(frozen=True, order=True)
class Key:
    """A record's address inside a space: class byte and coordinate ``(z, y, x)``.

    Ordering of ``Key`` values is by ``(cls, z, y, x)``; the order of *packed*
    keys is ``(cls, curve ordinal)``, which is what stores scan by.
    """

    cls: int
    z: int = 0
    y: int = 0
    x: int = 0

    def __post_init__(self) -> None:
        _check_class(self.cls)
        _check_coord("z", self.z)
        _check_coord("y", self.y)
        _check_coord("x", self.x)

    def pack(self, curve: Curve = DEFAULT_CURVE) -> bytes:
        """Return the 24-byte packed key under ``curve`` (Morton by default)."""
        code = curve.encode((self.z, self.y, self.x))
        return bytes((self.cls,)) + code.to_bytes(CODE_SIZE, "big")

    @classmethod
    def unpack(cls, data: bytes, curve: Curve = DEFAULT_CURVE) -> Key:
        """Inverse of :meth:`pack`."""
        if len(data) != KEY_SIZE:
            raise ValueError(f"key: expected {KEY_SIZE} bytes, got {len(data)}")
        z, y, x = curve.decode(int.from_bytes(data[1:], "big"))
        return cls(data[0], z, y, x)


def class_range_bounds(lo: int, hi: int | None = None) -> tuple[bytes, bytes]:
    """Smallest and largest packed key of classes ``lo..hi`` (inclusive), any curve."""
    hi = lo if hi is None else hi
    _check_class(lo)
    _check_class(hi)
    if lo > hi:
        raise ValueError(f"class range: lo {lo} > hi {hi}")
    return bytes((lo,)) + bytes(CODE_SIZE), bytes((hi,)) + b"\xff" * CODE_SIZE
