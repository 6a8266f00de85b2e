"""Morton (Z-order) curve, scalar and vectorised.

Bit convention (pinned; keys depend on it): axis 0 is the most significant
axis in each interleaved group. For 3-D ``(z, y, x)``, ordinal bit ``3*i + 2``
is bit ``i`` of ``z``, bit ``3*i + 1`` is bit ``i`` of ``y`` and bit ``3*i`` is
bit ``i`` of ``x``. In general bit ``i`` of axis ``a`` lands at ordinal bit
``ndim*i + (ndim - 1 - a)``. This is ``zCurve.interlace`` with the axes given
in reverse order (zCurve puts its first argument least significant).

The vectorised path spreads bits with magic masks, 32 bits (2-D) or 21 bits
(3-D) at a time, and assembles the 64- or 63-bit pieces into big-endian words
(:mod:`curves.words`); the C kernel does the same per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np

from czyx.curves import _native
from czyx.curves.base import CurveBase
from czyx.curves.words import n_words

_U = np.uint64


# --------------------------------------------------------------------------- scalar


@cache
def _spread_table(ndim: int) -> tuple[int, ...]:
    """Byte ``b`` -> ``b`` with bit ``i`` moved to bit ``ndim*i``."""
    return tuple(sum(((b >> i) & 1) << (ndim * i) for i in range(8)) for b in range(256))


@cache
def _compact_table(ndim: int) -> tuple[int, tuple[tuple[int, ...], ...]]:
    """(bits per axis per step ``g``, table of ``ndim*g``-bit groups -> per-axis values)."""
    g = max(1, 12 // ndim)
    table = []
    for v in range(1 << (ndim * g)):
        table.append(
            tuple(
                sum(((v >> (ndim * i + ndim - 1 - a)) & 1) << i for i in range(g))
                for a in range(ndim)
            )
        )
    return g, tuple(table)


def interleave(coords: tuple[int, ...]) -> int:
    """Interleave Python-int coordinates (axis 0 most significant per group). Unchecked."""
    ndim = len(coords)
    table = _spread_table(ndim)
    out = 0
    step = 8 * ndim
    for axis, c in enumerate(coords):
        shift = ndim - 1 - axis
        while c:
            out |= table[c & 0xFF] << shift
            c >>= 8
            shift += step
    return out


def deinterleave(ordinal: int, ndim: int, bits: int) -> tuple[int, ...]:
    """Inverse of :func:`interleave` for ``bits`` bits per axis. Unchecked."""
    g, table = _compact_table(ndim)
    mask = (1 << (ndim * g)) - 1
    coords = [0] * ndim
    shift = 0
    while ordinal:
        parts = table[ordinal & mask]
        for axis in range(ndim):
            coords[axis] |= parts[axis] << shift
        ordinal >>= ndim * g
        shift += g
    return tuple(c & ((1 << bits) - 1) for c in coords)


# --------------------------------------------------------------------------- numpy


def _spread_np(x: np.ndarray, ndim: int, chunk: int) -> np.ndarray:
    if ndim == 2:
        x = x & _U(0xFFFFFFFF)
        x = (x | (x << _U(16))) & _U(0x0000FFFF0000FFFF)
        x = (x | (x << _U(8))) & _U(0x00FF00FF00FF00FF)
        x = (x | (x << _U(4))) & _U(0x0F0F0F0F0F0F0F0F)
        x = (x | (x << _U(2))) & _U(0x3333333333333333)
        return (x | (x << _U(1))) & _U(0x5555555555555555)
    if ndim == 3:
        x = x & _U(0x1FFFFF)
        x = (x | (x << _U(32))) & _U(0x001F00000000FFFF)
        x = (x | (x << _U(16))) & _U(0x001F0000FF0000FF)
        x = (x | (x << _U(8))) & _U(0x100F00F00F00F00F)
        x = (x | (x << _U(4))) & _U(0x10C30C30C30C30C3)
        return (x | (x << _U(2))) & _U(0x1249249249249249)
    out = np.zeros_like(x)
    for i in range(chunk):
        out |= ((x >> _U(i)) & _U(1)) << _U(ndim * i)
    return out


def _compact_np(x: np.ndarray, ndim: int, chunk: int) -> np.ndarray:
    if ndim == 2:
        x = x & _U(0x5555555555555555)
        x = (x | (x >> _U(1))) & _U(0x3333333333333333)
        x = (x | (x >> _U(2))) & _U(0x0F0F0F0F0F0F0F0F)
        x = (x | (x >> _U(4))) & _U(0x00FF00FF00FF00FF)
        x = (x | (x >> _U(8))) & _U(0x0000FFFF0000FFFF)
        return (x | (x >> _U(16))) & _U(0x00000000FFFFFFFF)
    if ndim == 3:
        x = x & _U(0x1249249249249249)
        x = (x ^ (x >> _U(2))) & _U(0x10C30C30C30C30C3)
        x = (x ^ (x >> _U(4))) & _U(0x100F00F00F00F00F)
        x = (x ^ (x >> _U(8))) & _U(0x001F0000FF0000FF)
        x = (x ^ (x >> _U(16))) & _U(0x001F00000000FFFF)
        return (x ^ (x >> _U(32))) & _U(0x00000000001FFFFF)
    out = np.zeros_like(x)
    for i in range(chunk):
        out |= ((x >> _U(ndim * i)) & _U(1)) << _U(i)
    return out


def _chunk(ndim: int) -> int:
    return 64 // ndim


def interleave_np(cols: np.ndarray, bits: int) -> np.ndarray:
    """``(N, ndim)`` uint64 coordinates -> ``(N, W)`` big-endian words (numpy path)."""
    n, ndim = cols.shape
    w = n_words(ndim * bits)
    chunk = _chunk(ndim)
    acc = [np.zeros(n, dtype=np.uint64) for _ in range(w + 1)]  # little-endian words
    for j in range(-(-bits // chunk)):
        piece = np.zeros(n, dtype=np.uint64)
        for axis in range(ndim):
            spread = _spread_np(cols[:, axis] >> _U(chunk * j), ndim, chunk)
            piece |= spread << _U(ndim - 1 - axis)
        k, s = divmod(ndim * chunk * j, 64)
        acc[k] |= piece << _U(s)
        if s:
            acc[k + 1] |= piece >> _U(64 - s)
    out = np.empty((n, w), dtype=np.uint64)
    for k in range(w):
        out[:, k] = acc[w - 1 - k]
    return out


def deinterleave_np(words: np.ndarray, ndim: int, bits: int) -> np.ndarray:
    """Inverse of :func:`interleave_np`: ``(N, W)`` words -> ``(N, ndim)`` uint64."""
    n, w = words.shape
    chunk = _chunk(ndim)
    acc = [np.ascontiguousarray(words[:, w - 1 - k]) for k in range(w)]
    acc.append(np.zeros(n, dtype=np.uint64))
    out = np.zeros((n, ndim), dtype=np.uint64)
    for j in range(-(-bits // chunk)):
        k, s = divmod(ndim * chunk * j, 64)
        piece = acc[k] >> _U(s)
        if s:
            piece |= acc[k + 1] << _U(64 - s)
        for axis in range(ndim):
            part = _compact_np(piece >> _U(ndim - 1 - axis), ndim, chunk)
            out[:, axis] |= part << _U(chunk * j)
    if bits < 64:
        out &= _U((1 << bits) - 1)
    return out


# --------------------------------------------------------------------------- curve


@dataclass(frozen=True)
class MortonCurve(CurveBase):
    """Z-order curve over ``ndim`` axes of ``bits`` bits (see the module docstring for bits).

    Parameters
    ----------
    ndim : int
        Number of axes (vectorised C kernel for 2 and 3, numpy otherwise).
    bits : int
        Bits per axis, 1..64.
    """

    ndim: int = 3
    bits: int = 61
    name: str = "morton"

    def __post_init__(self) -> None:
        self._validate_shape()

    def encode(self, coords: tuple[int, ...]) -> int:
        """Ordinal of one point (Python ints, exact at any width)."""
        return interleave(self._check_point(coords))

    def decode(self, ordinal: int) -> tuple[int, ...]:
        """Point of one ordinal; inverse of :meth:`encode`."""
        return deinterleave(self._check_ordinal(ordinal), self.ndim, self.bits)

    def encode_array(self, coords: np.ndarray) -> np.ndarray:
        """``(N, ndim)`` integer coordinates -> ``(N, W)`` big-endian uint64 ordinal words."""
        src = self._check_coords_array(coords)
        if _native.available(self.ndim):
            n = self.n_words
            return _native.run("czyx_morton_encode", self.ndim, self.bits, src, n, n)
        return interleave_np(src, self.bits)

    def decode_array(self, ordinals: np.ndarray) -> np.ndarray:
        """``(N, W)`` ordinal words (or ``(N,)`` when ``W == 1``) -> ``(N, ndim)`` uint64."""
        src = self._check_ordinals_array(ordinals)
        if _native.available(self.ndim):
            n = self.n_words
            return _native.run("czyx_morton_decode", self.ndim, self.bits, src, self.ndim, n)
        return deinterleave_np(src, self.ndim, self.bits)
