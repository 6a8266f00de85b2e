"""The 24-byte CZYX key: ``class byte || 184-bit big-endian curve code of (z, y, x)``.

Packed keys sort as ``(class, curve ordinal)``, so LMDB's lexicographic order
is the curve order inside each class and a class (or class range) is a key
prefix (range). The curve is a property of the space (Morton by default); it
must be 3-D with 61 bits an axis, so its 183-bit ordinal fits the 184-bit code
with the top bit zero.

Vectorised keys are ``(N, 24)`` ``uint8`` arrays (``as_void`` views them as a
``V24`` vector, one element a key). Packing is arithmetic on whole arrays: the
curve's big-endian ordinal words (:mod:`curves.words`) already are the key's
bytes 1..23 once written big-endian, and byte 0 is then overwritten by the
class (the top 9 bits of the 192-bit word triple are always zero).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # curves imports czyx.errors, so czyx imports curves lazily
    from czyx.curves.base import Curve

KEY_SIZE = 24
CODE_SIZE = KEY_SIZE - 1
COORD_BITS = 61
COORD_LIMIT = 1 << COORD_BITS
CODE_BITS = 3 * COORD_BITS

# Named classes of general (non-expert) spaces. In an expert space every
# class value is an expert selector instead.
MEM = 0x4D  # 'M' memory
SES = 0x53  # 'S' session / thread
PRJ = 0x50  # 'P' project-internal
EDG = 0x45  # 'E' association edge
NAMED_CLASSES = {"MEM": MEM, "SES": SES, "PRJ": PRJ, "EDG": EDG}

_DEFAULT: list[Curve] = []


def default_curve() -> Curve:
    """The default key curve: 3-D Morton, 61 bits an axis."""
    if not _DEFAULT:
        from czyx.curves.morton import MortonCurve

        _DEFAULT.append(MortonCurve(ndim=3, bits=COORD_BITS))
    return _DEFAULT[0]


def __getattr__(name: str) -> Any:
    # DEFAULT_CURVE stays importable (``from czyx.key import DEFAULT_CURVE``)
    # without importing curves while czyx itself initialises.
    if name == "DEFAULT_CURVE":
        return default_curve()
    raise AttributeError(f"module 'czyx.key' has no attribute {name!r}")


def _key_curve(curve: Curve | None) -> Curve:
    if curve is None:
        return default_curve()
    if getattr(curve, "ndim", None) != 3 or getattr(curve, "bits", None) != COORD_BITS:
        raise ValueError(f"curve: a key curve must be 3-D with {COORD_BITS} bits, got {curve!r}")
    return curve


def _check_class(cls: Any) -> None:
    if not isinstance(cls, int | np.integer) or isinstance(cls, bool) or not 0 <= cls <= 0xFF:
        raise ValueError(f"class: {cls!r} is not a byte (0..255)")


def _check_coord(name: str, v: Any) -> None:
    if not isinstance(v, int | np.integer) or isinstance(v, bool):
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
        for f in ("cls", "z", "y", "x"):  # numpy ints -> Python ints, so hashes agree
            object.__setattr__(self, f, int(getattr(self, f)))

    def pack(self, curve: Curve | None = None) -> bytes:
        """Return the 24-byte packed key under ``curve`` (Morton by default)."""
        code = _key_curve(curve).encode((self.z, self.y, self.x))
        return bytes((self.cls,)) + code.to_bytes(CODE_SIZE, "big")

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview, curve: Curve | None = None) -> Key:
        """Inverse of :meth:`pack`.

        Raises
        ------
        ValueError
            ``key`` if ``data`` is not 24 bytes; ``key code`` if the code has
            its top (184th) bit set, which no packed key has.
        """
        if not isinstance(data, bytes | bytearray | memoryview):
            raise ValueError(f"key: expected bytes, got {type(data).__name__}")
        data = bytes(data)
        if len(data) != KEY_SIZE:
            raise ValueError(f"key: expected {KEY_SIZE} bytes, got {len(data)}")
        code = int.from_bytes(data[1:], "big")
        if code >> CODE_BITS:
            raise ValueError(f"key code: top bit set (codes are {CODE_BITS} bits)")
        z, y, x = _key_curve(curve).decode(code)
        return cls(data[0], z, y, x)


def class_range_bounds(lo: int, hi: int | None = None) -> tuple[bytes, bytes]:
    """Smallest and largest packed key of classes ``lo..hi`` (inclusive), any curve.

    Both bounds are inclusive: every key ``k`` of those classes has
    ``lo_key <= k <= hi_key`` and no key of another class does.
    """
    hi = lo if hi is None else hi
    _check_class(lo)
    _check_class(hi)
    if lo > hi:
        raise ValueError(f"class range: lo {lo} > hi {hi}")
    return bytes((lo,)) + bytes(CODE_SIZE), bytes((hi,)) + b"\xff" * CODE_SIZE


def class_prefix(cls: int) -> bytes:
    """The one-byte key prefix shared by every key of class ``cls``."""
    _check_class(cls)
    return bytes((cls,))


# --------------------------------------------------------------------------- vectorised


def _kernel_kind(curve: Curve) -> int | None:
    """0/1 when the C key kernel serves ``curve`` (plain Morton/Hilbert), else ``None``."""
    from czyx.curves import _native
    from czyx.curves.hilbert import HilbertCurve
    from czyx.curves.morton import MortonCurve

    if _native.LIB is None:
        return None
    if type(curve) is MortonCurve:
        return 0
    if type(curve) is HilbertCurve:
        return 1
    return None


def _check_classes(classes: Any, n: int) -> np.ndarray:
    arr = np.asarray(classes)
    if arr.ndim == 0:
        arr = np.broadcast_to(arr, (n,))
    if arr.shape != (n,):
        raise ValueError(f"class: expected shape ({n},), got {arr.shape}")
    if arr.dtype.kind not in "ui":
        raise ValueError(f"class: expected integers, got dtype {arr.dtype}")
    if arr.dtype != np.uint8 and n and (arr.min() < 0 or arr.max() > 0xFF):
        bad = int(np.flatnonzero((arr < 0) | (arr > 0xFF))[0])
        raise ValueError(f"class[{bad}]: {int(arr[bad])} is not a byte (0..255)")
    return arr


def _check_key_coords(coords: Any) -> np.ndarray:
    arr = np.asarray(coords)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise ValueError(f"coords: expected shape (N, 3) for (z, y, x), got {arr.shape}")
    if arr.dtype.kind not in "ui":
        raise ValueError(f"coords: expected integers, got dtype {arr.dtype}")
    names = "zyx"
    if arr.dtype.kind == "i" and arr.size and arr.min() < 0:
        row, axis = np.argwhere(arr < 0)[0]
        raise ValueError(f"{names[axis]}[{row}]: negative value {int(arr[row, axis])}")
    arr = np.ascontiguousarray(arr, dtype=np.uint64)
    if arr.size and int(arr.max()) >= COORD_LIMIT:
        row, axis = np.argwhere(arr >= np.uint64(COORD_LIMIT))[0]
        raise ValueError(
            f"{names[axis]}[{row}]: {int(arr[row, axis])} outside [0, 2**{COORD_BITS})"
        )
    return arr


def pack_keys(classes: Any, coords: Any, curve: Curve | None = None) -> np.ndarray:
    """Pack ``N`` keys at once; row ``i`` equals ``Key(classes[i], *coords[i]).pack(curve)``.

    Parameters
    ----------
    classes : int or array_like of int, shape (N,)
        Class bytes (a scalar applies to every row).
    coords : array_like of int, shape (N, 3)
        ``(z, y, x)`` per row, each below ``2**61``.
    curve : Curve, optional
        The space's key curve (3-D, 61 bits); Morton by default.

    Returns
    -------
    numpy.ndarray
        ``(N, 24)`` ``uint8``; ``as_void`` gives the ``V24`` view.
    """
    src = _check_key_coords(coords)
    cls = _check_classes(classes, src.shape[0])
    curve = _key_curve(curve)
    kernel = _kernel_kind(curve)
    if kernel is not None:  # one C pass: encode and write the bytes
        from czyx.curves import _native

        out = np.empty((src.shape[0], KEY_SIZE), dtype=np.uint8)
        cls8 = np.ascontiguousarray(cls, dtype=np.uint8)
        ffi = _native.FFI
        _native.LIB.czyx_key_pack(
            kernel,
            ffi.cast("const uint8_t *", cls8.ctypes.data),
            ffi.cast("const uint64_t *", src.ctypes.data),
            src.shape[0],
            ffi.cast("uint8_t *", out.ctypes.data),
        )
        return out
    words = curve.encode_array(src)  # (N, 3) big-endian words, top 9 bits zero
    out = words.astype(">u8").view(np.uint8).reshape(-1, KEY_SIZE)
    out[:, 0] = cls
    return out


def _as_key_bytes(keys: Any) -> np.ndarray:
    arr = np.asarray(keys)
    if arr.dtype.kind == "V":
        if arr.dtype.itemsize != KEY_SIZE or arr.ndim != 1:
            raise ValueError(f"key: expected a 1-D V{KEY_SIZE} array, got {arr.dtype} {arr.shape}")
        arr = np.ascontiguousarray(arr).view(np.uint8).reshape(-1, KEY_SIZE)
    if arr.dtype != np.uint8 or arr.ndim != 2 or arr.shape[1] != KEY_SIZE:
        raise ValueError(
            f"key: expected an (N, {KEY_SIZE}) uint8 array, got {arr.dtype} {arr.shape}"
        )
    return arr


def unpack_keys(keys: Any, curve: Curve | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`pack_keys`.

    Parameters
    ----------
    keys : numpy.ndarray
        ``(N, 24)`` ``uint8`` or ``(N,)`` ``V24``.
    curve : Curve, optional
        The curve the keys were packed under; Morton by default.

    Returns
    -------
    classes : numpy.ndarray
        ``(N,)`` ``uint8``.
    coords : numpy.ndarray
        ``(N, 3)`` ``uint64`` ``(z, y, x)``.

    Raises
    ------
    ValueError
        ``key`` for a wrong shape or dtype, ``key code[i]`` for a code with its
        top bit set.
    """
    arr = _as_key_bytes(keys)
    cls = arr[:, 0].copy()
    if arr.shape[0] and int(arr[:, 1].max()) & 0x80:
        bad = int(np.flatnonzero(arr[:, 1] & 0x80)[0])
        raise ValueError(f"key code[{bad}]: top bit set (codes are {CODE_BITS} bits)")
    curve = _key_curve(curve)
    kernel = _kernel_kind(curve)
    if kernel is not None:  # one C pass: read the bytes and decode
        from czyx.curves import _native

        src = np.ascontiguousarray(arr)
        coords = np.empty((src.shape[0], 3), dtype=np.uint64)
        ffi = _native.FFI
        _native.LIB.czyx_key_unpack(
            kernel,
            ffi.cast("const uint8_t *", src.ctypes.data),
            src.shape[0],
            ffi.cast("uint8_t *", cls.ctypes.data),
            ffi.cast("uint64_t *", coords.ctypes.data),
        )
        return cls, coords
    buf = arr.copy()
    buf[:, 0] = 0
    words = buf.view(">u8").astype(np.uint64)
    return cls, curve.decode_array(words)


def as_void(keys: np.ndarray) -> np.ndarray:
    """View ``(N, 24)`` ``uint8`` keys as an ``(N,)`` ``V24`` array (no copy when contiguous)."""
    return np.ascontiguousarray(_as_key_bytes(keys)).view(f"V{KEY_SIZE}").reshape(-1)
