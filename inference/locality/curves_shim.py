"""Physical slot of each expert under an outer curve over ``(layer, class)``.

Scope: the one place the locality analysis turns a curve name and a class
order into slot indices, with a small local implementation (row-major,
Morton and Hilbert over a ``2**b`` square, occupied cells ranked densely, so
a block file holds no holes). It is kept behind this one module so that it
can be swapped for :class:`curves.layout.ExpertLayout` without touching the
measures.
"""

from __future__ import annotations

import numpy as np

from inference.locality.errors import LocalityError

CURVES = ("layer-major", "morton", "hilbert")


def _morton2(y: np.ndarray, x: np.ndarray, bits: int) -> np.ndarray:
    out = np.zeros_like(x)
    for i in range(bits):  # y (layer) is the more significant bit of each pair
        out |= ((x >> i) & 1) << (2 * i)
        out |= ((y >> i) & 1) << (2 * i + 1)
    return out


def _hilbert2(y: np.ndarray, x: np.ndarray, bits: int) -> np.ndarray:
    """Hilbert index of ``(y, x)`` on a ``2**bits`` square (the classic xy2d, vectorised)."""
    x = x.copy()
    y = y.copy()
    d = np.zeros_like(x)
    s = 1 << (bits - 1) if bits > 0 else 0
    while s > 0:
        rx = ((x & s) > 0).astype(np.int64)
        ry = ((y & s) > 0).astype(np.int64)
        d += s * s * ((3 * rx) ^ ry)
        flip = ry == 0
        swap_flip = flip & (rx == 1)
        x = np.where(swap_flip, s - 1 - x, x)
        y = np.where(swap_flip, s - 1 - y, y)
        x, y = np.where(flip, y, x), np.where(flip, x, y)
        s >>= 1
    return d


def curve_codes(curve: str, n_layers: int, n_experts: int) -> np.ndarray:
    """Raw curve code of every ``(layer, class)`` cell, ``[L, E]`` int64."""
    layer = np.repeat(np.arange(n_layers, dtype=np.int64), n_experts).reshape(n_layers, n_experts)
    cls = np.tile(np.arange(n_experts, dtype=np.int64), (n_layers, 1))
    if curve == "layer-major":
        return layer * n_experts + cls
    bits = max(1, int(np.ceil(np.log2(max(n_layers, n_experts)))))
    if curve == "morton":
        return _morton2(layer, cls, bits)
    if curve == "hilbert":
        return _hilbert2(layer, cls, bits)
    raise LocalityError(f"unknown curve {curve!r}; expected one of {', '.join(CURVES)}")


def expert_slots(
    curve: str, n_layers: int, n_experts: int, class_of: np.ndarray | None = None
) -> np.ndarray:
    """Slot index ``[L, E]`` of each (layer, router index) expert.

    Parameters
    ----------
    curve : str
        One of :data:`CURVES`.
    n_layers, n_experts : int
        Grid size.
    class_of : np.ndarray, optional
        ``[L, E]`` router index -> class value (identity when omitted).

    Returns
    -------
    np.ndarray
        int64 ``[L, E]``, a permutation of ``range(L*E)``: the dense rank of
        the cell's curve code, so slots are contiguous.
    """
    codes = curve_codes(curve, n_layers, n_experts)
    rank = np.empty(codes.size, dtype=np.int64)
    rank[np.argsort(codes.ravel(), kind="stable")] = np.arange(codes.size)
    rank = rank.reshape(n_layers, n_experts)
    if class_of is None:
        return rank
    class_of = np.asarray(class_of, dtype=np.int64)
    if class_of.shape != (n_layers, n_experts):
        raise LocalityError(f"class_of shape {class_of.shape}, expected {(n_layers, n_experts)}")
    return np.take_along_axis(rank, class_of, axis=1)
