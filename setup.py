"""Build hook: one ``czyx`` namespace over the repository's top-level folders, and the
cffi extensions.

The repository keeps the design card's folders (``czyx curves store portals inference``)
at its top level; installed, they all live under ``czyx`` (``czyx.store`` is the folder
``store/``), so nothing generic lands in site-packages. Each package that owns C code
ships a builder module named ``_*_build.py`` exposing ``ffibuilder`` (cffi API mode);
they are discovered here so that a package can add a kernel without editing this file.
"""

from __future__ import annotations

import glob
import os

from setuptools import setup

here = os.path.dirname(os.path.abspath(__file__))

# import name of each top-level folder
FOLDERS = {
    "czyx": "czyx",
    "czyx.curves": "curves",
    "czyx.store": "store",
    "czyx.portals": "portals",
    "czyx.inference": "inference",
}


def _packages() -> tuple[list[str], dict[str, str]]:
    packages, package_dir = [], {}
    for name, folder in FOLDERS.items():
        package_dir[name] = folder
        for root, dirs, files in os.walk(os.path.join(here, folder)):
            dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
            if "__init__.py" not in files:
                continue
            rel = os.path.relpath(root, os.path.join(here, folder))
            packages.append(name if rel == "." else name + "." + rel.replace(os.sep, "."))
    return sorted(packages), package_dir


packages, package_dir = _packages()
builders = sorted(
    os.path.relpath(p, here) + ":ffibuilder"
    for folder in FOLDERS.values()
    for p in glob.glob(os.path.join(here, folder, "**", "_*_build.py"), recursive=True)
)

setup(packages=packages, package_dir=package_dir, cffi_modules=builders)
