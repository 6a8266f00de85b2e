"""Quantized matvec / small matmul: the C kernel when compiled, numpy otherwise.

Scope: the Python face of ``inference._qkernels``. :func:`prepare` validates a
packed buffer once and returns a :class:`PackedMatrix` whose ``matvec`` /
``matmul`` do no validation of the matrix, no views and no allocation beyond
the result (pass ``out=`` to avoid even that): the engine prepares each
quantized tensor once (trunk at load, an expert when its slot is filled).
:func:`qmatvec` / :func:`qmatmul` are the one-shot conveniences.

Without the compiled extension (``python setup.py build_ext --inplace`` not
run) every product runs the numpy reference, with one warning per process.
The C call releases the GIL, so products on different matrices can run in
threads.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from czyx.inference.kernels.reference import ref_matmul
from czyx.store.quant.errors import QuantError, ShapeError
from czyx.store.quant.formats import QuantFormat, get_format, views

try:  # the compiled kernel; absent until build_ext has run
    from czyx.inference._qkernels import ffi as _ffi
    from czyx.inference._qkernels import lib as _lib
except ImportError:  # pragma: no cover - exercised where the extension is not built
    _ffi = None
    _lib = None

_warned = False
_F32 = np.dtype(np.float32)


def have_c() -> bool:
    """Whether the compiled kernel is importable."""
    return _lib is not None


#: The C kernel's SIMD levels, lowest first.
SIMD_LEVELS = ("portable", "avx2", "avx512")


def simd_level() -> str:
    """``"avx512"``, ``"avx2"``, ``"portable"`` (plain C) or ``"numpy"`` (no extension)."""
    if _lib is None:
        return "numpy"
    return SIMD_LEVELS[_lib.qk_simd_level()]


def set_simd_cap(level: str) -> None:
    """Use at most SIMD ``level`` (one of :data:`SIMD_LEVELS`); for tests and benchmarks."""
    if level not in SIMD_LEVELS:
        raise ValueError(f"unknown SIMD level {level!r}; one of {SIMD_LEVELS}")
    if _lib is not None:
        _lib.qk_set_simd_cap(SIMD_LEVELS.index(level))


def force_portable(on: bool) -> None:
    """Force the C kernel's portable path (``on``) or restore the best one."""
    set_simd_cap("portable" if on else "avx512")


def _warn_fallback() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            "inference._qkernels is not compiled (run `python setup.py build_ext --inplace`); "
            "quantized products use the slower numpy reference",
            RuntimeWarning,
            stacklevel=3,
        )


@dataclass(frozen=True)
class PackedMatrix:
    """A validated packed matrix ready for products.

    Attributes
    ----------
    fmt : QuantFormat
        Its format.
    shape : tuple of int
        The logical ``(rows, cols)``.
    buf : numpy.ndarray
        The whole packed ``uint8`` buffer.
    codes, scales, mins : numpy.ndarray
        Zero-copy views of its three parts.
    """

    fmt: QuantFormat
    shape: tuple[int, int]
    buf: np.ndarray
    codes: np.ndarray
    scales: np.ndarray
    mins: np.ndarray
    _ptrs: tuple[Any, Any, Any] | None = field(default=None, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        """Packed bytes of the matrix."""
        return self.fmt.nbytes(*self.shape)

    def matvec(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``W @ x`` for ``x float32 [cols]``; returns ``float32 [rows]``.

        The decode hot path: a float32 contiguous ``x`` and ``out`` go to C
        with two buffer wraps and no other allocation.
        """
        if not isinstance(x, np.ndarray) or x.dtype != _F32 or not x.flags.c_contiguous:
            x = np.ascontiguousarray(x, dtype=_F32)
        rows, cols = self.shape
        if x.shape != (cols,):
            raise ShapeError(f"matvec: x shape {x.shape} != ({cols},)")
        if out is None:
            out = np.empty(rows, _F32)
        elif out.shape != (rows,) or out.dtype != _F32 or not out.flags.c_contiguous:
            raise ShapeError(f"matvec: out must be float32 C-contiguous ({rows},)")
        if self._ptrs is None or rows == 0:
            self._run(x.reshape(1, -1), out.reshape(1, -1), "matvec: out")
            return out
        pc, ps, pm = self._ptrs
        rc = _lib.qk_matmul(
            self.fmt.bits,
            self.fmt.group_size,
            rows,
            cols,
            pc,
            ps,
            pm,
            _ffi.from_buffer("float[]", x),
            1,
            _ffi.from_buffer("float[]", out),
            0,
            rows,
        )
        if rc != 0:
            raise QuantError(f"qk_matmul failed with code {rc} ({self.fmt.name} {self.shape})")
        return out

    def matmul(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``x @ W.T`` for ``x float32 [B, cols]``; returns ``float32 [B, rows]``."""
        x = np.asarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.shape[1]:
            raise ShapeError(f"matmul: x shape {x.shape} != (B, {self.shape[1]})")
        if out is None:
            out = np.empty((x.shape[0], self.shape[0]), dtype=np.float32)
        self._run(x, out, "matmul: out")
        return out

    def _run(self, x: np.ndarray, out: np.ndarray, what: str) -> None:
        rows, cols = self.shape
        if out.shape != (x.shape[0], rows) or out.dtype != np.float32:
            raise ShapeError(
                f"{what} must be float32 {(x.shape[0], rows)}, got {out.dtype} {out.shape}"
            )
        if not out.flags.c_contiguous:
            raise ShapeError(f"{what} must be C-contiguous")
        if x.shape[0] == 0 or rows == 0:
            return
        x = np.ascontiguousarray(x)
        if self._ptrs is None:
            _warn_fallback()
            ref_matmul(self.codes, self.scales, self.mins, self.fmt, cols, x, out)
            return
        pc, ps, pm = self._ptrs
        rc = _lib.qk_matmul(
            self.fmt.bits,
            self.fmt.group_size,
            rows,
            cols,
            pc,
            ps,
            pm,
            _ffi.from_buffer("float[]", x),
            x.shape[0],
            _ffi.from_buffer("float[]", out),
            0,
            rows,
        )
        if rc != 0:
            raise QuantError(f"qk_matmul failed with code {rc} ({self.fmt.name} {self.shape})")

    def reference(self, x: np.ndarray) -> np.ndarray:
        """The numpy reference of ``matmul`` (or ``matvec`` for 1-D ``x``)."""
        x = np.asarray(x, dtype=np.float32)
        x2 = np.ascontiguousarray(x.reshape(-1, self.shape[1]))
        out = np.empty((x2.shape[0], self.shape[0]), dtype=np.float32)
        ref_matmul(self.codes, self.scales, self.mins, self.fmt, self.shape[1], x2, out)
        return out.reshape(-1) if x.ndim == 1 else out


def prepare(
    buf: np.ndarray | bytes | bytearray | memoryview,
    fmt: str | QuantFormat,
    shape: tuple[int, int],
) -> PackedMatrix:
    """Validate a packed buffer once and return its :class:`PackedMatrix`.

    Raises
    ------
    QuantError
        (its subclasses) on an unknown format, a bad shape or a buffer size mismatch.
    """
    fmt = get_format(fmt)
    shape = (int(shape[0]), int(shape[1]))
    codes, scales, mins = views(buf, fmt, shape)
    ptrs = None
    if _lib is not None:
        ptrs = (
            _ffi.cast("const uint8_t *", _ffi.from_buffer(codes)),
            _ffi.cast("const uint16_t *", _ffi.from_buffer(scales)),
            _ffi.cast("const uint16_t *", _ffi.from_buffer(mins)),
        )
    raw = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8)
    return PackedMatrix(fmt, shape, raw.reshape(-1).view(np.uint8), codes, scales, mins, ptrs)


def qmatvec(
    buf: np.ndarray | bytes | bytearray | memoryview,
    fmt: str | QuantFormat,
    shape: tuple[int, int],
    x: np.ndarray,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """One-shot ``W @ x`` on a packed buffer (see :func:`prepare` for repeated use)."""
    return prepare(buf, fmt, shape).matvec(x, out)


def qmatmul(
    buf: np.ndarray | bytes | bytearray | memoryview,
    fmt: str | QuantFormat,
    shape: tuple[int, int],
    x: np.ndarray,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """One-shot ``x @ W.T`` for ``x [B, cols]`` on a packed buffer."""
    return prepare(buf, fmt, shape).matmul(x, out)
