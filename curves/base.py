"""The ``Curve`` protocol (coordinates <-> linear ordinal) and the checks all curves share.

Conventions every curve in this package follows:

- ``ndim`` axes (``1 <= ndim <= 16``) of ``bits`` bits each (``1 <= bits <= 64``); ordinals lie in
  ``[0, 2**(ndim * bits))``.
- Scalar methods take and return Python ints, so the 3 x 61 = 183-bit ordinals
  of a key are exact.
- Vectorised methods take ``(N, ndim)`` integer coordinates and return ordinals
  as an ``(N, W)`` ``uint64`` array of big-endian words (see :mod:`curves.words`);
  ``decode_array`` is the exact inverse and returns ``(N, ndim)`` ``uint64``.
- Axis 0 is the most significant axis wherever a curve must break a tie
  (Morton interleave, Hilbert transpose, row-major).
- Bad input raises :class:`curves.errors.CurveError` (a ``ValueError``).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from czyx.curves.errors import CurveError
from czyx.curves.words import check_coords, check_words, n_words

# Scalar Morton decoding keeps a 2**ndim-entry table per dimension count.
MAX_NDIM = 16


@runtime_checkable
class Curve(Protocol):
    """A bijection between ``ndim`` coordinates of ``bits`` bits and ``[0, 2**(ndim*bits))``."""

    name: str
    ndim: int
    bits: int

    def encode(self, coords: tuple[int, ...]) -> int:
        """Ordinal of one point (Python ints, exact)."""
        ...

    def decode(self, ordinal: int) -> tuple[int, ...]:
        """Point of one ordinal; the exact inverse of :meth:`encode`."""
        ...

    def encode_array(self, coords: np.ndarray) -> np.ndarray:
        """``(N, ndim)`` integer coordinates -> ``(N, W)`` big-endian ``uint64`` words."""
        ...

    def decode_array(self, ordinals: np.ndarray) -> np.ndarray:
        """``(N, W)`` words (``(N,)`` when ``W == 1``) -> ``(N, ndim)`` ``uint64``."""
        ...


class CurveBase:
    """Validation and bookkeeping shared by the concrete curves (a mixin, not a protocol)."""

    ndim: int
    bits: int
    name: str

    def _validate_shape(self) -> None:
        for field in ("ndim", "bits"):
            v = getattr(self, field)
            if not isinstance(v, int) or isinstance(v, bool):
                raise CurveError(f"{field}: {v!r} is not an integer")
        if not 1 <= self.ndim <= MAX_NDIM:
            raise CurveError(f"ndim: {self.ndim} outside [1, {MAX_NDIM}]")
        if not 1 <= self.bits <= 64:
            raise CurveError(f"bits: {self.bits} outside [1, 64]")

    @property
    def total_bits(self) -> int:
        """Bits in an ordinal: ``ndim * bits``."""
        return self.ndim * self.bits

    @property
    def n_words(self) -> int:
        """Columns ``W`` of the vectorised ordinal array."""
        return n_words(self.total_bits)

    @property
    def size(self) -> int:
        """Number of cells (and ordinals): ``2**(ndim * bits)``."""
        return 1 << self.total_bits

    def _check_point(self, coords: Any) -> tuple[int, ...]:
        try:
            pt = tuple(coords)
        except TypeError as exc:
            raise CurveError(f"coords: {coords!r} is not a sequence") from exc
        if len(pt) != self.ndim:
            raise CurveError(f"coords: expected {self.ndim} coordinates, got {len(pt)}")
        limit = 1 << self.bits
        for axis, c in enumerate(pt):
            if not isinstance(c, int | np.integer) or isinstance(c, bool):
                raise CurveError(f"coords[{axis}]: {c!r} is not an integer")
            if not 0 <= c < limit:
                raise CurveError(f"coords[{axis}]: {c} outside [0, 2**{self.bits})")
        return tuple(int(c) for c in pt)

    def _check_ordinal(self, ordinal: Any) -> int:
        if not isinstance(ordinal, int | np.integer) or isinstance(ordinal, bool):
            raise CurveError(f"ordinal: {ordinal!r} is not an integer")
        if not 0 <= ordinal < (1 << self.total_bits):
            raise CurveError(f"ordinal: {ordinal} outside [0, 2**{self.total_bits})")
        return int(ordinal)

    def _check_coords_array(self, coords: np.ndarray) -> np.ndarray:
        return check_coords(coords, self.ndim, self.bits)

    def _check_ordinals_array(self, ordinals: np.ndarray) -> np.ndarray:
        return check_words(ordinals, self.total_bits)

    def to_dict(self) -> dict[str, Any]:
        """A JSON/msgpack-able description, inverse of :func:`curves.curve_from_dict`."""
        return {"name": self.name, "ndim": self.ndim, "bits": self.bits}
