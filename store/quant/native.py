"""The C quantizer: whole matrices in their stored dtype, threaded, same bytes as numpy.

Scope: :func:`quantize_native` calls ``czyx_quantize`` (built from
``store/quant/_quantizer_build.py``) on one matrix and returns the planar packed
buffer of :mod:`czyx.store.quant.formats`; :func:`default_threads` is the
thread count a quantizing mount uses. The numpy implementation in
:mod:`czyx.store.quant.quantizer` stays the reference: the C search repeats its
arithmetic operation for operation, so the bytes are identical (checked by
``tests/store/quant/test_native.py``), and the C one only changes how fast.

Sources are read in their own dtype (float32, float16 or bfloat16 bit
patterns, widened exactly inside the C loop), so a mount never materialises a
float32 copy of a tensor.
"""

from __future__ import annotations

import os

import numpy as np

from czyx.store.quant.errors import FormatError, QuantError, ShapeError

try:  # built by setup.py; absent only in a source tree nobody installed
    from czyx.store.quant._quantizer import ffi as _ffi
    from czyx.store.quant._quantizer import lib as _lib
except ImportError:  # pragma: no cover - exercised only without the build
    _ffi = _lib = None

#: Source dtype codes of ``czyx_quantize``: numpy dtypes and safetensors names.
_DTYPE_CODE = {"F32": 0, "F16": 1, "BF16": 2}
FP16_SAFE = 60000.0


def available() -> bool:
    """Whether the C quantizer extension is built."""
    return _lib is not None


def default_threads() -> int:
    """The cores this process may run on (its CPU affinity), at least one."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def _source(w: np.ndarray, dtype: str | None) -> tuple[np.ndarray, int]:
    """``(contiguous source array, dtype code)``; float64 and others become float32."""
    if dtype is not None:
        if dtype not in _DTYPE_CODE:
            raise FormatError(f"quantize: source dtype {dtype!r} not one of {sorted(_DTYPE_CODE)}")
        want = np.float32 if dtype == "F32" else np.uint16
        arr = np.ascontiguousarray(w).view(want) if w.dtype != want else np.ascontiguousarray(w)
        return arr, _DTYPE_CODE[dtype]
    if w.dtype == np.float16:
        return np.ascontiguousarray(w), 1
    return np.ascontiguousarray(w, dtype=np.float32), 0


def quantize_native(
    w: np.ndarray,
    shape: tuple[int, int],
    bits: int,
    group: int,
    weights: np.ndarray | None,
    *,
    search: bool = True,
    dtype: str | None = None,
    threads: int | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Quantize one ``[R, C]`` matrix in C into its planar packed buffer.

    Parameters
    ----------
    w : numpy.ndarray
        The weights, ``R * C`` elements row-major: float32 or float16 values, or
        (with ``dtype``) the raw elements of a safetensors tensor.
    shape : tuple of int
        ``(R, C)``.
    bits, group : int
        The format's code width and group size (validated by the caller's
        :class:`~czyx.store.quant.formats.QuantFormat`).
    weights : numpy.ndarray or None
        ``float32 [C]`` per-column error weights, already floored
        (:func:`czyx.store.quant.formats.quantize` prepares them), or ``None``.
    search : bool
        The weighted search (``True``) or plain min-max groups.
    dtype : {"F32", "F16", "BF16"} or None
        How to read ``w``'s bytes; ``None`` uses ``w``'s numpy dtype.
    threads : int or None
        Threads of the call (default :func:`default_threads`); the bytes do not
        depend on it.
    out : numpy.ndarray or None
        ``uint8`` buffer of exactly the packed size to fill (else a new one).

    Raises
    ------
    FormatError
        A non-finite weight or one beyond ``FP16_SAFE`` (the numpy reference's errors).
    ShapeError
        If ``w`` does not hold ``R * C`` elements.
    QuantError
        If the extension is not built or runs out of memory.
    """
    if _lib is None:
        raise QuantError("the C quantizer is not built (pip install -e . builds it)")
    rows, cols = (int(s) for s in shape)
    src, code = _source(np.asarray(w), dtype)
    if src.size != rows * cols:
        raise ShapeError(f"quantize: {src.size} source elements do not make [{rows}, {cols}]")
    per = rows * (cols // group) * 2
    nbytes = rows * cols * bits // 8 + 2 * per
    if out is None:
        out = np.empty(nbytes, np.uint8)
    elif out.dtype != np.uint8 or out.size != nbytes or not out.flags.c_contiguous:
        raise ShapeError(f"quantize: out must be contiguous uint8 x {nbytes}")
    imp = None
    if weights is not None:
        imp = np.ascontiguousarray(weights, dtype=np.float32)
        if imp.shape != (cols,):
            raise ShapeError(f"quantize: weights shape {imp.shape} != ({cols},)")
    bad = _ffi.new("int64_t *")
    rc = _lib.czyx_quantize(
        _ffi.from_buffer(src),
        code,
        rows,
        cols,
        bits,
        group,
        _ffi.NULL if imp is None else _ffi.cast("float *", _ffi.from_buffer(imp)),
        1 if search else 0,
        _ffi.from_buffer(out),
        default_threads() if threads is None else int(threads),
        bad,
    )
    if rc == 0:
        return out
    gi, ii = divmod(int(bad[0]), group)
    if rc == -1:
        raise FormatError(f"fit_groups: non-finite weight at group {gi}, index {ii}")
    if rc == -2:
        raise FormatError(f"fit_groups: weight magnitude beyond {FP16_SAFE} cannot use fp16 scales")
    if rc == -3:
        raise QuantError("quantize: the C quantizer ran out of memory")
    raise ShapeError(f"quantize: bad arguments [{rows}, {cols}] bits={bits} group={group}")
