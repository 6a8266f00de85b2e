"""Morton (Z-order) curve.

Bit convention: axis 0 is the most significant in each interleaved group. For
3-D ``(z, y, x)``, ordinal bit ``3*i + 2`` is bit ``i`` of ``z``, ``3*i + 1`` of
``y`` and ``3*i`` of ``x``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MortonCurve:
    ndim: int = 3
    bits: int = 61
    name: str = "morton"

    def _check(self, coords: tuple[int, ...]) -> None:
        if len(coords) != self.ndim:
            raise ValueError(f"coords: expected {self.ndim} coordinates, got {len(coords)}")
        for axis, c in enumerate(coords):
            if not 0 <= c < (1 << self.bits):
                raise ValueError(f"coords[{axis}]: {c} outside [0, 2**{self.bits})")

    def encode(self, coords: tuple[int, ...]) -> int:
        self._check(tuple(coords))
        out = 0
        n = self.ndim
        for axis, c in enumerate(coords):
            shift = n - 1 - axis
            for i in range(c.bit_length()):
                if (c >> i) & 1:
                    out |= 1 << (n * i + shift)
        return out

    def decode(self, ordinal: int) -> tuple[int, ...]:
        if not 0 <= ordinal < (1 << (self.ndim * self.bits)):
            raise ValueError(f"ordinal: {ordinal} outside the curve's range")
        n = self.ndim
        coords = [0] * n
        for axis in range(n):
            shift = n - 1 - axis
            c = 0
            for i in range(self.bits):
                if (ordinal >> (n * i + shift)) & 1:
                    c |= 1 << i
            coords[axis] = c
        return tuple(coords)

    def encode_array(self, coords: np.ndarray) -> np.ndarray:
        raise NotImplementedError("vectorised Morton: issue #2")

    def decode_array(self, ordinals: np.ndarray) -> np.ndarray:
        raise NotImplementedError("vectorised Morton: issue #2")
