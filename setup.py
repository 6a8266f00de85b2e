"""Build hook: compiles every cffi extension the packages declare.

Each package that owns C code ships a builder module named ``_*_build.py``
exposing ``ffibuilder`` (cffi API mode). They are discovered here so that a
package can add a kernel without editing this file.
"""

from __future__ import annotations

import glob
import os

from setuptools import setup

here = os.path.dirname(os.path.abspath(__file__))
builders = sorted(
    os.path.relpath(p, here) + ":ffibuilder"
    for pkg in ("czyx", "curves", "store", "portals", "inference")
    for p in glob.glob(os.path.join(here, pkg, "_*_build.py"))
)

setup(cffi_modules=builders)
