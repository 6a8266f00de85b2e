"""Row-major (lexicographic) order: axis 0 most significant, axis ``ndim-1`` fastest.

``ordinal = ((c0 << bits | c1) << bits | c2) ...``: the coordinates' bit
strings concatenated. Row-major is the order inside an expert (a matrix
multiply walks contiguous rows) and the plain baseline the other curves are
compared with.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from czyx.curves.base import CurveBase

_U = np.uint64


@dataclass(frozen=True)
class RowMajorCurve(CurveBase):
    """Concatenation of the axes' bits, axis 0 first.

    Parameters
    ----------
    ndim : int
        Number of axes.
    bits : int
        Bits per axis, 1..64.
    """

    ndim: int = 3
    bits: int = 61
    name: str = "rowmajor"

    def __post_init__(self) -> None:
        self._validate_shape()

    def encode(self, coords: tuple[int, ...]) -> int:
        """Ordinal of one point."""
        out = 0
        for c in self._check_point(coords):
            out = (out << self.bits) | c
        return out

    def decode(self, ordinal: int) -> tuple[int, ...]:
        """Point of one ordinal; inverse of :meth:`encode`."""
        v = self._check_ordinal(ordinal)
        mask = (1 << self.bits) - 1
        out = []
        for _ in range(self.ndim):
            out.append(v & mask)
            v >>= self.bits
        return tuple(reversed(out))

    def encode_array(self, coords: np.ndarray) -> np.ndarray:
        """``(N, ndim)`` integer coordinates -> ``(N, W)`` big-endian uint64 ordinal words."""
        src = self._check_coords_array(coords)
        n, w = src.shape[0], self.n_words
        acc = [np.zeros(n, dtype=np.uint64) for _ in range(w + 1)]  # little-endian words
        for axis in range(self.ndim):
            pos = (self.ndim - 1 - axis) * self.bits
            k, s = divmod(pos, 64)
            acc[k] |= src[:, axis] << _U(s)
            if s:
                acc[k + 1] |= src[:, axis] >> _U(64 - s)
        out = np.empty((n, w), dtype=np.uint64)
        for k in range(w):
            out[:, k] = acc[w - 1 - k]
        return out

    def decode_array(self, ordinals: np.ndarray) -> np.ndarray:
        """``(N, W)`` ordinal words (or ``(N,)`` when ``W == 1``) -> ``(N, ndim)`` uint64."""
        src = self._check_ordinals_array(ordinals)
        n, w = src.shape
        acc = [np.ascontiguousarray(src[:, w - 1 - k]) for k in range(w)]
        acc.append(np.zeros(n, dtype=np.uint64))
        out = np.empty((n, self.ndim), dtype=np.uint64)
        mask = _U((1 << self.bits) - 1)
        for axis in range(self.ndim):
            k, s = divmod((self.ndim - 1 - axis) * self.bits, 64)
            v = acc[k] >> _U(s)
            if s:
                v |= acc[k + 1] << _U(64 - s)
            out[:, axis] = v & mask
        return out
