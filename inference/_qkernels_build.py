"""cffi builder of ``inference._qkernels``: matvec/matmul on packed q2/q3/q4/q8.

Compiled by ``python setup.py build_ext --inplace`` (setup.py discovers this
module). Flags: ``-O3`` only, no ``-march``: the C source selects an
AVX-512 (matvec) or AVX2/FMA/F16C path at run time (function target
attributes and ``__builtin_cpu_supports``) and otherwise runs its portable
autovectorised loops, so one build works on every x86-64 (and compiles
elsewhere).
"""

from __future__ import annotations

import os

from cffi import FFI

_HERE = os.path.dirname(os.path.abspath(__file__))
_SRC = os.path.join(_HERE, "kernels", "qkernels.c")

CDEF = """
int qk_matmul(int bits, int64_t group, int64_t rows, int64_t cols, const uint8_t *codes,
              const uint16_t *scales, const uint16_t *mins, const float *x, int64_t nvec,
              float *y, int64_t r0, int64_t r1);
int qk_simd_level(void);
void qk_set_simd_cap(int level);
"""

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
with open(_SRC, encoding="utf-8") as fh:
    _source = fh.read()
ffibuilder.set_source(
    "czyx.inference._qkernels",
    _source,
    include_dirs=[os.path.join(_HERE, "kernels")],
    extra_compile_args=["-O3", "-std=c99", "-fno-strict-aliasing"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
