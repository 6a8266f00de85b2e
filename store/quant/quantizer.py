"""Choosing each group's fp16 scale and offset: importance-weighted least squares.

Scope: given groups of float weights and per-weight importance, find codes
``q``, a scale ``d`` and an offset ``m`` (both representable in fp16) that
minimise the weighted squared error ``sum_i w_i (d q_i + m - x_i)^2`` of each
group. This is the method of llama.cpp's importance-matrix quantization
(``make_qkx2_quants`` / ``make_qkx3_quants``):

1. start from min-max (every weight within half a step; kept as a candidate,
   so the search is never worse than min-max on the weighted error);
2. for a small grid of candidate inverse scales around ``qmax / (max - min)``
   (``qmax + rmin + k * rdelta`` steps per range: five points spanning
   llama.cpp's grid, whose 21 points cost four times the passes for a few
   percent of error), assign codes by rounding, then solve the 2x2 weighted
   normal equations for the ``(d, m)`` that best fit those codes;
3. round ``(d, m)`` to fp16, reassign every code to the nearest grid point of
   the rounded pair, measure the weighted error, keep the best candidate;
4. alternate "codes -> least-squares fit -> codes" a few times on the winner.

The weights of the error are the calibration importance (mean squared
activation of each input column) broadcast over rows; a column that carries
signal pulls the grid towards its values and the rarely used ones absorb the
error. Without importance all weights are one: plain least squares.

Everything is vectorised over groups, in chunks that bound the temporaries.
"""

from __future__ import annotations

import numpy as np

from czyx.store.quant.errors import FormatError, ShapeError

#: Largest magnitude accepted: comfortably inside fp16's 65504 so that an
#: offset snapped downwards and a scale snapped upwards stay finite.
FP16_SAFE = 60000.0
_F16 = np.float16
_F32 = np.float32
# The candidate grid: llama.cpp's make_qkx2_quants span (qmax - 1 .. qmax + 1) at 5 points.
_RMIN, _RDELTA, _NSTEP = -1.0, 0.5, 4
_REFINE_ROUNDS = 2
_CHUNK_ELEMS = 1 << 20


def _snap_minmax(xmin: np.ndarray, xmax: np.ndarray, qmax: int) -> tuple[np.ndarray, np.ndarray]:
    """fp16 ``(d, m)`` with ``m <= xmin`` and ``d * qmax + m >= xmax`` (float32 arithmetic)."""
    m = xmin.astype(_F16)
    high = m.astype(_F32) > xmin
    m[high] = np.nextafter(m[high], _F16(-np.inf))
    mf = m.astype(_F32)
    d = ((xmax - mf) / _F32(qmax)).astype(_F16)
    # A few fp16 ulps may be needed when the range is tiny; four rounds suffice
    # (each moves d up one ulp, and a single ulp already covers the rounding).
    for _ in range(4):
        short = d.astype(_F32) * _F32(qmax) + mf < xmax
        if not short.any():
            break
        d[short] = np.nextafter(d[short], _F16(np.inf))
    return d, m


def _assign(x: np.ndarray, d: np.ndarray, m: np.ndarray, qmax: int) -> np.ndarray:
    """Nearest codes of ``x [N, g]`` on the grid ``d * q + m`` (float32 codes)."""
    df = d.astype(_F32)
    mf = m.astype(_F32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(df > 0, _F32(1.0) / df, _F32(0.0)).astype(_F32)[:, None]
    q = x - mf
    q *= inv
    np.rint(q, out=q)
    return np.clip(q, 0, qmax, out=q)


def _werr(
    x: np.ndarray, w: np.ndarray | None, q: np.ndarray, d: np.ndarray, m: np.ndarray
) -> np.ndarray:
    """Weighted squared error per group (float64 sums of float32 residuals)."""
    r = q * d.astype(_F32)[:, None] + m.astype(_F32)[:, None] - x
    r = r * r
    if w is not None:
        r = r * w
    return r.sum(axis=1, dtype=np.float64)


class _Sums:
    """The code-independent sums of one chunk's weighted fit, computed once."""

    def __init__(self, x: np.ndarray, w: np.ndarray | None) -> None:
        self.x = x
        self.w = w
        self.wx = x if w is None else w * x
        self.sw = (
            np.full(x.shape[0], float(x.shape[1])) if w is None else w.sum(1, dtype=np.float64)
        )
        self.sx = self.wx.sum(1, dtype=np.float64)


def _wls(sums: _Sums, q: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Weighted least-squares ``(d, m)`` for fixed codes; ``ok`` masks solvable groups.

    Products in float32 (codes are small integers), sums in float64.
    """
    wq = q if sums.w is None else sums.w * q
    sl = wq.sum(1, dtype=np.float64)
    sll = (wq * q).sum(1, dtype=np.float64)
    slx = (sums.wx * q).sum(1, dtype=np.float64)
    sw, sx = sums.sw, sums.sx
    det = sw * sll - sl * sl
    ok = det > 1e-12 * np.maximum(sw * sll, 1e-300)
    with np.errstate(divide="ignore", invalid="ignore"):
        d = np.where(ok, (sw * slx - sl * sx) / det, 0.0)
        m = np.where(ok, (sll * sx - sl * slx) / det, 0.0)
    ok &= (d > 0) & np.isfinite(d) & np.isfinite(m)
    ok &= (np.abs(m) < FP16_SAFE) & (d * 255 < FP16_SAFE)
    return d, m, ok


def _try(sums: _Sums, qmax: int, cand: np.ndarray, best: list[np.ndarray]) -> None:
    """Fit ``(d, m)`` to candidate codes, snap to fp16, reassign, keep where better."""
    d, m, ok = _wls(sums, cand)
    if not ok.any():
        return
    dh = np.where(ok, d, 0.0).astype(_F16)
    mh = np.where(ok, m, 0.0).astype(_F16)
    ok &= dh > 0
    q = _assign(sums.x, dh, mh, qmax)
    err = _werr(sums.x, sums.w, q, dh, mh)
    better = ok & (err < best[3])
    if better.any():
        best[0][better] = q[better]
        best[1][better] = dh[better]
        best[2][better] = mh[better]
        best[3][better] = err[better]


def _fit_chunk(
    x: np.ndarray, w: np.ndarray | None, qmax: int, search: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    xmin, xmax = x.min(axis=1), x.max(axis=1)
    d, m = _snap_minmax(xmin, xmax, qmax)
    q = _assign(x, d, m, qmax)
    best = [q, d, m, _werr(x, w, q, d, m)]
    if search:
        rng = (xmax - xmin).astype(_F32)
        live = rng > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            inv = np.where(live, 1.0 / rng, 0.0).astype(_F32)[:, None]
        shifted = x - xmin[:, None]
        sums = _Sums(x, w)
        cand = np.empty_like(x)
        for k in range(_NSTEP + 1):
            iscale = _F32(qmax + _RMIN + _RDELTA * k) * inv
            np.multiply(iscale, shifted, out=cand)
            np.rint(cand, out=cand)
            np.clip(cand, 0, qmax, out=cand)
            _try(sums, qmax, cand, best)
        for _ in range(_REFINE_ROUNDS):
            _try(sums, qmax, best[0].copy(), best)
    return best[0].astype(np.uint8), best[1], best[2]


def fit_groups(
    x: np.ndarray,
    bits: int,
    weights: np.ndarray | None = None,
    *,
    method: str = "search",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes, fp16 scales and fp16 offsets for groups of weights.

    Parameters
    ----------
    x : numpy.ndarray
        ``float32 [N, g]``: N groups of g weights.
    bits : int
        Code width; codes lie in ``[0, 2**bits - 1]``.
    weights : numpy.ndarray or None
        Non-negative ``float32 [N, g]`` (or broadcastable) error weights;
        ``None`` is plain least squares.
    method : {"search", "minmax"}
        ``"minmax"`` returns the min-max grid (every weight within half a step
        of its reconstruction); ``"search"`` returns, per group, the candidate
        with the smallest weighted error, min-max included.

    Returns
    -------
    codes : numpy.ndarray
        ``uint8 [N, g]``.
    scales, mins : numpy.ndarray
        ``float16 [N]`` each; the weight is ``scale * code + min`` in float32.

    Raises
    ------
    FormatError
        On non-finite weights or magnitudes beyond :data:`FP16_SAFE`.
    ShapeError
        On a malformed ``x`` or ``weights``.
    """
    if method not in ("search", "minmax"):
        raise FormatError(f"fit_groups: unknown method {method!r} (search or minmax)")
    x = np.asarray(x, dtype=_F32)
    if x.ndim != 2 or x.shape[1] == 0:
        raise ShapeError(f"fit_groups: need [N, g] groups, got shape {x.shape}")
    if not np.isfinite(x).all():
        bad = np.argwhere(~np.isfinite(x))[0]
        raise FormatError(f"fit_groups: non-finite weight at group {bad[0]}, index {bad[1]}")
    if x.size and float(np.abs(x).max()) > FP16_SAFE:
        raise FormatError(f"fit_groups: weight magnitude beyond {FP16_SAFE} cannot use fp16 scales")
    w = None
    if weights is not None:
        w = np.broadcast_to(np.asarray(weights, dtype=_F32), x.shape)
        if not (np.isfinite(w).all() and (w >= 0).all()):
            raise FormatError("fit_groups: error weights must be finite and non-negative")
    qmax = (1 << bits) - 1
    n, g = x.shape
    codes = np.empty((n, g), dtype=np.uint8)
    scales = np.empty(n, dtype=_F16)
    mins = np.empty(n, dtype=_F16)
    step = max(1, _CHUNK_ELEMS // g)
    for s in range(0, n, step):
        e = min(n, s + step)
        wc = None if w is None else np.ascontiguousarray(w[s:e])
        codes[s:e], scales[s:e], mins[s:e] = _fit_chunk(x[s:e], wc, qmax, method == "search")
    return codes, scales, mins


def weighted_error(
    x: np.ndarray,
    weights: np.ndarray | None,
    codes: np.ndarray,
    scales: np.ndarray,
    mins: np.ndarray,
) -> np.ndarray:
    """Per-group ``sum w (scale * code + min - x)^2`` (float64), as the search measures it."""
    x = np.asarray(x, dtype=_F32)
    w = None if weights is None else np.broadcast_to(np.asarray(weights, dtype=_F32), x.shape)
    return _werr(x, w, np.asarray(codes, dtype=_F32), np.asarray(scales), np.asarray(mins))
