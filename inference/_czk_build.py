"""cffi builder of ``inference._czk``: the engine's threaded decode kernels.

Compiled with the other ``_*_build.py`` modules by ``pip install -e .`` (setup.py
discovers it). Flags: ``-O3 -ffp-contract=off`` and no ``-march``: the C source
chooses its AVX-512 VNNI, AVX2 or portable path at run time (function target
attributes and ``__builtin_cpu_supports``), and no multiply-add is fused unless
written as one, so every path's float operations are the ones its docstring
states (the tests rebuild them in numpy exactly).
"""

from __future__ import annotations

import os

from cffi import FFI

_HERE = os.path.dirname(os.path.abspath(__file__))
_SRC = os.path.join(_HERE, "kernels", "czk.c")
_API = os.path.join(_HERE, "kernels", "czk_api.h")

with open(_API, encoding="utf-8") as fh:
    CDEF = fh.read()

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
with open(_SRC, encoding="utf-8") as fh:
    _source = fh.read()
ffibuilder.set_source(
    "czyx.inference._czk",
    _source,
    include_dirs=[os.path.join(_HERE, "kernels")],
    extra_compile_args=["-O3", "-std=gnu99", "-ffp-contract=off", "-fno-strict-aliasing"],
    libraries=["m", "pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
