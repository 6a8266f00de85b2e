"""Widening fp16/bf16 tensors to float32 for the lazy trunk: exact, and fast in C.

Scope: one function, :func:`widen`, that the lazy trunk mode of
:mod:`store.model` uses for every per-layer tensor it serves (the eager mode
keeps :func:`store.checkpoint.to_float32`). Results are the same bits as
``to_float32`` (numpy's conversion) for every input; the C kernel
(``store._widen``, see :mod:`store._widen_build`) is about an order of
magnitude faster than numpy's cast (``bench/bench_widen.py``) and releases the GIL, so a trunk
window's loader thread widens while the decoder computes. Without the build,
``to_float32`` is used and a ``RuntimeWarning`` says so once.
"""

from __future__ import annotations

import warnings

import numpy as np

from czyx.store.models.checkpoint import to_float32

try:
    from czyx.store.io import _widen as _c
except ImportError as _exc:  # not built in place
    _c = None
    _C_IMPORT_ERROR: ImportError | None = _exc
else:
    _C_IMPORT_ERROR = None

_warned = False
_KERNELS = {"F16": "czyx_f16_to_f32", "BF16": "czyx_bf16_to_f32"}


def c_available() -> bool:
    """Whether the compiled widening kernel could be imported."""
    return _c is not None


def widen(array: np.ndarray, dtype: str) -> np.ndarray:
    """A new float32 array of ``array`` (a view of safetensors ``dtype``), exactly.

    Parameters
    ----------
    array
        The tensor as stored: ``float16`` for ``F16``, ``uint16`` bits for
        ``BF16``, any numpy dtype for the others.
    dtype
        The safetensors dtype name.

    Returns
    -------
    numpy.ndarray
        Same shape, float32, bit-identical to :func:`store.checkpoint.to_float32`.
    """
    kernel = _KERNELS.get(dtype)
    if kernel is None or _c is None:
        if kernel is not None:
            _warn_fallback()
        return to_float32(array, dtype)
    src = np.ascontiguousarray(array).view(np.uint16)
    out = np.empty(array.shape, np.float32)
    ffi = _c.ffi
    getattr(_c.lib, kernel)(
        ffi.cast("const uint16_t *", ffi.from_buffer(src)),
        ffi.cast("uint32_t *", ffi.from_buffer(out, require_writable=True)),
        src.size,
    )
    return out


def widen_into(out: np.ndarray, array: np.ndarray, dtype: str) -> None:
    """Widen ``array`` (``F16`` or ``BF16``, as :func:`widen`) into float32 ``out``, exactly.

    The expert cache's per-use path: ``out`` is preallocated, C-contiguous
    float32 with as many elements as ``array``. Falls back to numpy without
    the C kernel.

    Raises
    ------
    ValueError
        ``dtype`` is not F16/BF16, or the arrays do not match.
    """
    kernel = _KERNELS.get(dtype)
    if kernel is None:
        raise ValueError(f"widen_into: dtype {dtype!r} is not one of {sorted(_KERNELS)}")
    if out.dtype != np.float32 or out.size != array.size or not out.flags.c_contiguous:
        raise ValueError("widen_into: out must be C-contiguous float32 of the same size")
    if _c is None:
        _warn_fallback()
        np.copyto(out, to_float32(array, dtype).reshape(out.shape))
        return
    src = np.ascontiguousarray(array).view(np.uint16)
    ffi = _c.ffi
    getattr(_c.lib, kernel)(
        ffi.cast("const uint16_t *", ffi.from_buffer(src)),
        ffi.cast("uint32_t *", ffi.from_buffer(out, require_writable=True)),
        src.size,
    )


def _warn_fallback() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"store: C widening kernel unavailable ({_C_IMPORT_ERROR}); using numpy's "
            "slower cast. Build it with `python setup.py build_ext --inplace`.",
            RuntimeWarning,
            stacklevel=3,
        )
