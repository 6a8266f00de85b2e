"""Quantized kernels: products directly on packed q2/q3/q4/q8 matrices.

``ops`` chooses the compiled C kernel (``inference._qkernels``) or the numpy
reference (``reference``); see :func:`inference.kernels.ops.prepare`.
``fused`` wraps the engine's decode kernels (``inference._czk``, source
``czk.c``): its thread pool and one-call-per-block decode step.
"""

from __future__ import annotations

from czyx.inference.kernels.ops import (
    PackedMatrix,
    force_portable,
    have_c,
    prepare,
    qmatmul,
    qmatvec,
    simd_level,
)

__all__ = [
    "PackedMatrix",
    "force_portable",
    "have_c",
    "prepare",
    "qmatmul",
    "qmatvec",
    "simd_level",
]
