"""Multi-word ordinals: how vectorised curves carry codes wider than 64 bits.

A curve of ``ndim`` axes of ``bits`` bits has ordinals of ``ndim * bits`` bits
(183 for the key's 3 x 61). Vectorised methods represent ``N`` ordinals as an
``(N, W)`` ``uint64`` array of **big-endian words**: column 0 holds the most
significant 64 bits, ``W = ceil(ndim * bits / 64)``, unused high bits are zero.
Lexicographic order of the rows equals numeric order of the ordinals, and
``arr.astype(">u8").view(np.uint8)`` is the ordinal's big-endian byte string,
which is how :mod:`czyx.key` packs keys without a per-key loop.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from czyx.curves.errors import CurveError

WORD_BITS = 64
_MASK64 = (1 << 64) - 1


def n_words(total_bits: int) -> int:
    """Number of 64-bit words that hold an ordinal of ``total_bits`` bits (at least 1)."""
    return max(1, -(-total_bits // WORD_BITS))


def ints_to_words(values: Iterable[int], total_bits: int) -> np.ndarray:
    """Python ints -> ``(N, W)`` big-endian ``uint64`` words.

    Raises
    ------
    CurveError
        If a value is negative or does not fit in ``total_bits`` bits.
    """
    w = n_words(total_bits)
    vals = list(values)
    out = np.zeros((len(vals), w), dtype=np.uint64)
    for row, v in enumerate(vals):
        if not 0 <= v < (1 << total_bits):
            raise CurveError(f"ordinal[{row}]: {v} outside [0, 2**{total_bits})")
        for col in range(w - 1, -1, -1):
            out[row, col] = v & _MASK64
            v >>= WORD_BITS
    return out


def words_to_ints(words: np.ndarray) -> list[int]:
    """``(N, W)`` big-endian ``uint64`` words -> list of Python ints."""
    arr = np.asarray(words, dtype=np.uint64)
    if arr.ndim == 1:
        arr = arr[:, None]
    out = []
    for row in arr.tolist():
        v = 0
        for word in row:
            v = (v << WORD_BITS) | word
        out.append(v)
    return out


def check_words(ordinals: np.ndarray, total_bits: int) -> np.ndarray:
    """Validate and normalise vectorised ordinals to a C-contiguous ``(N, W)`` uint64 array.

    A 1-D array is accepted when ``W == 1``. Signed input must be non-negative.

    Raises
    ------
    CurveError
        On a wrong shape or dtype, or an ordinal outside ``[0, 2**total_bits)``.
    """
    w = n_words(total_bits)
    arr = np.asarray(ordinals)
    if arr.ndim == 1 and w == 1:
        arr = arr[:, None]
    if arr.ndim != 2 or arr.shape[1] != w:
        raise CurveError(f"ordinals: expected shape (N, {w}), got {arr.shape}")
    if arr.dtype.kind not in "ui":
        raise CurveError(f"ordinals: expected an integer array, got dtype {arr.dtype}")
    if arr.dtype.kind == "i" and arr.size and arr.min() < 0:
        raise CurveError(f"ordinals[{int(np.argwhere(arr < 0)[0][0])}]: negative value")
    arr = np.ascontiguousarray(arr, dtype=np.uint64)
    top_bits = total_bits - WORD_BITS * (w - 1)
    if top_bits < WORD_BITS and arr.size and int(arr[:, 0].max()) >> top_bits:
        bad = int(np.flatnonzero(arr[:, 0] >> np.uint64(top_bits))[0])
        raise CurveError(f"ordinals[{bad}]: outside [0, 2**{total_bits})")
    return arr


def check_coords(coords: np.ndarray, ndim: int, bits: int) -> np.ndarray:
    """Validate and normalise vectorised coordinates to a C-contiguous ``(N, ndim)`` uint64 array.

    Raises
    ------
    CurveError
        On a wrong shape or dtype, or a coordinate outside ``[0, 2**bits)``; the
        message names the axis and the first offending row.
    """
    arr = np.asarray(coords)
    if arr.ndim != 2 or arr.shape[1] != ndim:
        raise CurveError(f"coords: expected shape (N, {ndim}), got {arr.shape}")
    if arr.dtype.kind not in "ui":
        raise CurveError(f"coords: expected an integer array, got dtype {arr.dtype}")
    # One min/max pass on the fast path; locate the culprit only on failure.
    if arr.dtype.kind == "i" and arr.size and arr.min() < 0:
        row, axis = np.argwhere(arr < 0)[0]
        raise CurveError(f"coords[{row}, {axis}]: negative value {int(arr[row, axis])}")
    arr = np.ascontiguousarray(arr, dtype=np.uint64)
    if bits < WORD_BITS and arr.size and int(arr.max()) >> bits:
        row, axis = np.argwhere((arr >> np.uint64(bits)) != 0)[0]
        raise CurveError(f"coords[{row}, {axis}]: {int(arr[row, axis])} outside [0, 2**{bits})")
    return arr
