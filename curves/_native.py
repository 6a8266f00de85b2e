"""Loader of the optional C kernel ``curves._curves`` with a numpy fallback.

``LIB`` is the cffi ``lib`` or ``None``. When the kernel is missing (not built
in place, or ``CZYX_CURVES_PURE=1`` in the environment) a single
``RuntimeWarning`` says so and every curve uses its numpy path, which returns
identical results, only slower.
"""

from __future__ import annotations

import os
import warnings

import numpy as np

from czyx.curves.errors import CurveError

try:
    if os.environ.get("CZYX_CURVES_PURE") == "1":
        raise ImportError("CZYX_CURVES_PURE=1")
    from czyx.curves._curves import ffi as FFI
    from czyx.curves._curves import lib as LIB
except ImportError as _exc:  # pragma: no cover - depends on the build
    FFI = None
    LIB = None
    warnings.warn(
        f"curves: C kernel unavailable ({_exc}); using the numpy path "
        "(build it with `python setup.py build_ext --inplace`)",
        RuntimeWarning,
        stacklevel=2,
    )

NATIVE_NDIMS = (2, 3)


def available(ndim: int) -> bool:
    """Whether the C kernel serves curves of ``ndim`` axes."""
    return LIB is not None and ndim in NATIVE_NDIMS


def run(kernel: str, ndim: int, bits: int, src: np.ndarray, out_cols: int, w: int) -> np.ndarray:
    """Run C kernel ``kernel`` over C-contiguous ``uint64`` ``src`` rows.

    Returns a new ``(N, out_cols)`` ``uint64`` array. ``w`` is the word count
    of whichever side holds ordinals. Call only where :func:`available`.
    """
    out = np.empty((src.shape[0], out_cols), dtype=np.uint64)
    rc = getattr(LIB, kernel)(
        ndim,
        bits,
        FFI.cast("const uint64_t *", src.ctypes.data),
        src.shape[0],
        FFI.cast("uint64_t *", out.ctypes.data),
        w,
    )
    if rc != 0:  # pragma: no cover - guarded by available()
        raise CurveError(f"curves C kernel refused ndim={ndim}")
    return out
