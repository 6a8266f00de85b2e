"""Hilbert curve by Skilling's transform, scalar and vectorised.

J. Skilling, "Programming the Hilbert curve", AIP Conf. Proc. 707 (2004):
``AxestoTranspose`` turns the axes into the "transpose" of the Hilbert index,
whose bits are then interleaved exactly as :mod:`curves.morton` does (axis 0
most significant in each group). This is the convention of the
``hilbertcurve`` package (``HilbertCurve(p=bits, n=ndim)``), so
``encode(point) == HilbertCurve(bits, ndim).distance_from_point(point)``; the
``numpy-hilbert-curve`` package agrees where it applies (``ndim*bits <= 64``).
For 2-D, 2 bits: ordinals 0..3 visit ``(0,0), (1,0), (1,1), (0,1)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from czyx.curves import _native
from czyx.curves.base import CurveBase
from czyx.curves.morton import deinterleave, deinterleave_np, interleave, interleave_np

_U = np.uint64


def axes_to_transpose(x: list[int], bits: int) -> list[int]:
    """Skilling's AxestoTranspose on Python ints (in place; also returned)."""
    n = len(x)
    q = 1 << (bits - 1)
    while q > 1:
        p = q - 1
        for i in range(n):
            if x[i] & q:
                x[0] ^= p
            else:
                t = (x[0] ^ x[i]) & p
                x[0] ^= t
                x[i] ^= t
        q >>= 1
    for i in range(1, n):
        x[i] ^= x[i - 1]
    t = 0
    q = 1 << (bits - 1)
    while q > 1:
        if x[n - 1] & q:
            t ^= q - 1
        q >>= 1
    for i in range(n):
        x[i] ^= t
    return x


def transpose_to_axes(x: list[int], bits: int) -> list[int]:
    """Skilling's TransposetoAxes on Python ints (in place; also returned)."""
    n = len(x)
    t = x[n - 1] >> 1
    for i in range(n - 1, 0, -1):
        x[i] ^= x[i - 1]
    x[0] ^= t
    q = 2
    while q != (1 << bits):
        p = q - 1
        for i in range(n - 1, -1, -1):
            if x[i] & q:
                x[0] ^= p
            else:
                t = (x[0] ^ x[i]) & p
                x[0] ^= t
                x[i] ^= t
        q <<= 1
    return x


def _axes_to_transpose_np(x: list[np.ndarray], bits: int) -> None:
    """Branch-free vectorised AxestoTranspose over columns (in place)."""
    n = len(x)
    ones = _U(0xFFFFFFFFFFFFFFFF)
    for b in range(bits - 1, 0, -1):
        p = _U((1 << b) - 1)
        for i in range(n):
            m = ((x[i] >> _U(b)) & _U(1)) * ones  # all ones where bit b is set
            s = (x[0] ^ x[i]) & p & ~m
            x[0] ^= (p & m) | s
            if i:
                x[i] ^= s
    for i in range(1, n):
        x[i] ^= x[i - 1]
    # Skilling's "for Q: if X[n-1] & Q: t ^= Q - 1" sets bit j of t to the XOR
    # of the bits above j: the inverse Gray code of X[n-1] >> 1, in 6 steps.
    t = x[n - 1] >> _U(1)
    for sh in (1, 2, 4, 8, 16, 32):
        t ^= t >> _U(sh)
    for i in range(n):
        x[i] ^= t


def _transpose_to_axes_np(x: list[np.ndarray], bits: int) -> None:
    """Branch-free vectorised TransposetoAxes over columns (in place)."""
    n = len(x)
    ones = _U(0xFFFFFFFFFFFFFFFF)
    t = x[n - 1] >> _U(1)
    for i in range(n - 1, 0, -1):
        x[i] ^= x[i - 1]
    x[0] ^= t
    for b in range(1, bits):
        p = _U((1 << b) - 1)
        for i in range(n - 1, -1, -1):
            m = ((x[i] >> _U(b)) & _U(1)) * ones
            s = (x[0] ^ x[i]) & p & ~m
            x[0] ^= (p & m) | s
            if i:
                x[i] ^= s


def hilbert_encode_np(coords: np.ndarray, bits: int) -> np.ndarray:
    """``(N, ndim)`` uint64 -> ``(N, W)`` big-endian words (numpy path, any ndim)."""
    cols = [coords[:, a].copy() for a in range(coords.shape[1])]
    _axes_to_transpose_np(cols, bits)
    return interleave_np(np.stack(cols, axis=1), bits)


def hilbert_decode_np(words: np.ndarray, ndim: int, bits: int) -> np.ndarray:
    """Inverse of :func:`hilbert_encode_np`."""
    tr = deinterleave_np(words, ndim, bits)
    cols = [tr[:, a].copy() for a in range(ndim)]
    _transpose_to_axes_np(cols, bits)
    return np.stack(cols, axis=1)


@dataclass(frozen=True)
class HilbertCurve(CurveBase):
    """Hilbert curve over ``ndim`` axes of ``bits`` bits (Skilling; hilbertcurve convention).

    Parameters
    ----------
    ndim : int
        Number of axes (vectorised C kernel for 2 and 3, numpy otherwise).
    bits : int
        Bits per axis, 1..64.
    """

    ndim: int = 3
    bits: int = 61
    name: str = "hilbert"

    def __post_init__(self) -> None:
        self._validate_shape()

    def encode(self, coords: tuple[int, ...]) -> int:
        """Hilbert index of one point (Python ints, exact)."""
        pt = list(self._check_point(coords))
        return interleave(tuple(axes_to_transpose(pt, self.bits)))

    def decode(self, ordinal: int) -> tuple[int, ...]:
        """Point at one Hilbert index; inverse of :meth:`encode`."""
        tr = list(deinterleave(self._check_ordinal(ordinal), self.ndim, self.bits))
        return tuple(transpose_to_axes(tr, self.bits))

    def encode_array(self, coords: np.ndarray) -> np.ndarray:
        """``(N, ndim)`` integer coordinates -> ``(N, W)`` big-endian uint64 ordinal words."""
        src = self._check_coords_array(coords)
        if _native.available(self.ndim):
            n = self.n_words
            return _native.run("czyx_hilbert_encode", self.ndim, self.bits, src, n, n)
        return hilbert_encode_np(src, self.bits)

    def decode_array(self, ordinals: np.ndarray) -> np.ndarray:
        """``(N, W)`` ordinal words (or ``(N,)`` when ``W == 1``) -> ``(N, ndim)`` uint64."""
        src = self._check_ordinals_array(ordinals)
        if _native.available(self.ndim):
            n = self.n_words
            return _native.run("czyx_hilbert_decode", self.ndim, self.bits, src, self.ndim, n)
        return hilbert_decode_np(src, self.ndim, self.bits)
