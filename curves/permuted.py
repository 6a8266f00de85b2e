"""A learned per-axis permutation applied before another curve.

``PermutedCurve(inner, perms)`` maps coordinate ``v`` of axis ``a`` to
``perms[a][v]`` (for ``v < len(perms[a])``; larger values, and axes whose perm
is ``None``, pass through unchanged) and then encodes with ``inner``. A perm
must be a permutation of ``range(len(perm))``, so the whole map stays a
bijection. Typical use: co-activation order of the experts of a layer, so
experts that fire together sit next to each other on the curve.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from czyx.curves.base import Curve, CurveBase
from czyx.curves.errors import CurveError


def _as_perm(axis: int, perm: Sequence[int] | np.ndarray, bits: int) -> tuple[int, ...]:
    arr = np.asarray(perm)
    if arr.ndim != 1 or arr.dtype.kind not in "ui":
        raise CurveError(f"perms[{axis}]: expected a 1-D integer sequence")
    n = arr.shape[0]
    if n == 0 or n > (1 << bits):
        raise CurveError(f"perms[{axis}]: length {n} outside [1, 2**{bits}]")
    if not np.array_equal(np.sort(arr), np.arange(n)):
        raise CurveError(f"perms[{axis}]: not a permutation of range({n})")
    return tuple(int(v) for v in arr)


@dataclass(frozen=True)
class PermutedCurve(CurveBase):
    """``inner`` applied after a per-axis permutation of the low coordinate values.

    Parameters
    ----------
    inner : Curve
        The curve that orders the permuted coordinates.
    perms : sequence of (sequence of int or None)
        One entry per axis; ``perms[a][v]`` is where value ``v`` of axis ``a`` goes.
    """

    inner: Curve
    perms: tuple[tuple[int, ...] | None, ...]
    name: str = "permuted"
    ndim: int = field(init=False)
    bits: int = field(init=False)
    _fwd: tuple[np.ndarray | None, ...] = field(init=False, repr=False, compare=False)
    _inv: tuple[np.ndarray | None, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.inner, Curve):
            raise CurveError(f"inner: {self.inner!r} is not a Curve")
        ndim, bits = self.inner.ndim, self.inner.bits
        perms = tuple(self.perms)
        if len(perms) != ndim:
            raise CurveError(f"perms: expected {ndim} entries (one per axis), got {len(perms)}")
        norm = tuple(None if p is None else _as_perm(a, p, bits) for a, p in enumerate(perms))
        fwd = tuple(None if p is None else np.array(p, dtype=np.uint64) for p in norm)
        inv = tuple(None if p is None else np.argsort(np.array(p)).astype(np.uint64) for p in norm)
        object.__setattr__(self, "perms", norm)
        object.__setattr__(self, "ndim", ndim)
        object.__setattr__(self, "bits", bits)
        object.__setattr__(self, "_fwd", fwd)
        object.__setattr__(self, "_inv", inv)

    @staticmethod
    def _map_point(pt: tuple[int, ...], tables: tuple[Any, ...]) -> tuple[int, ...]:
        return tuple(v if t is None or v >= len(t) else int(t[v]) for v, t in zip(pt, tables))

    @staticmethod
    def _map_array(arr: np.ndarray, tables: tuple[np.ndarray | None, ...]) -> np.ndarray:
        out = arr.copy()
        for axis, t in enumerate(tables):
            if t is None:
                continue
            col = arr[:, axis]
            low = col < np.uint64(len(t))
            out[low, axis] = t[col[low].astype(np.intp)]
        return out

    def encode(self, coords: tuple[int, ...]) -> int:
        """Ordinal of one point: permute, then ``inner.encode``."""
        return self.inner.encode(self._map_point(self._check_point(coords), self._fwd))

    def decode(self, ordinal: int) -> tuple[int, ...]:
        """Inverse of :meth:`encode`."""
        return self._map_point(self.inner.decode(self._check_ordinal(ordinal)), self._inv)

    def encode_array(self, coords: np.ndarray) -> np.ndarray:
        """Vectorised :meth:`encode` (``(N, ndim)`` -> ``(N, W)`` big-endian words)."""
        return self.inner.encode_array(self._map_array(self._check_coords_array(coords), self._fwd))

    def decode_array(self, ordinals: np.ndarray) -> np.ndarray:
        """Vectorised :meth:`decode`."""
        return self._map_array(self.inner.decode_array(ordinals), self._inv)

    def to_dict(self) -> dict[str, Any]:
        """Description for a manifest; inverse of :func:`curves.curve_from_dict`."""
        return {
            "name": self.name,
            "inner": self.inner.to_dict(),  # type: ignore[attr-defined]
            "perms": [None if p is None else list(p) for p in self.perms],
        }
