"""The numpy reference of the quantized products (and the fallback without C).

Scope: ``y = x @ W.T`` for a packed matrix, computed the same way the C kernel
does (per group ``d * (q . x) + m * sum(x)``, float32), row block by row block
so that the unpacked codes of at most ``ROW_BLOCK`` rows exist at once.
"""

from __future__ import annotations

import numpy as np

from czyx.store.quant.formats import QuantFormat, unpack_codes

#: Rows unpacked per step (bounds the temporary to ROW_BLOCK * cols floats).
ROW_BLOCK = 256


def ref_matmul(
    codes: np.ndarray,
    scales: np.ndarray,
    mins: np.ndarray,
    fmt: QuantFormat,
    cols: int,
    x: np.ndarray,
    out: np.ndarray,
) -> np.ndarray:
    """``out[b, r] = sum_c W[r, c] x[b, c]`` from the planar parts of a packed matrix.

    Parameters
    ----------
    codes, scales, mins : numpy.ndarray
        The views of :func:`store.quant.formats.views`.
    fmt : QuantFormat
        The matrix's format.
    cols : int
        Columns of the logical matrix.
    x : numpy.ndarray
        ``float32 [B, cols]``.
    out : numpy.ndarray
        ``float32 [B, rows]``, written in place and returned.
    """
    rows = codes.shape[0]
    g = fmt.group_size
    n_groups = cols // g
    xg = x.reshape(x.shape[0], n_groups, g)
    xsum = xg.sum(axis=2, dtype=np.float32)  # [B, G]
    for r0 in range(0, rows, ROW_BLOCK):
        r1 = min(rows, r0 + ROW_BLOCK)
        q = unpack_codes(codes[r0:r1], fmt.bits, cols).astype(np.float32)
        q = q.reshape(r1 - r0, n_groups, g)
        dots = np.einsum("rgk,bgk->brg", q, xg, dtype=np.float32)
        d = scales[r0:r1].astype(np.float32)[None]
        m = mins[r0:r1].astype(np.float32)[None]
        out[:, r0:r1] = (dots * d + m * xsum[:, None, :]).sum(axis=2, dtype=np.float32)
    return out
