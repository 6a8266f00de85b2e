"""Every C extension the packages declare is built and importable.

Each kernel has a numpy/Python fallback that warns once; without this test a
build that silently failed would only make the suite slower (and its C-only
tests skip), never red.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("czyx", "curves", "store", "portals", "inference")
BUILDERS = sorted(p for d in FOLDERS for p in (ROOT / d).rglob("_*_build.py"))


def _module_of(builder: Path) -> str:
    m = re.search(r"set_source\(\s*[\"']([\w.]+)[\"']", builder.read_text())
    assert m, f"{builder}: no set_source(...) module name"
    return m.group(1)


def test_builders_found():
    assert len(BUILDERS) >= 5, BUILDERS


@pytest.mark.parametrize("builder", BUILDERS, ids=lambda p: p.name)
def test_extension_is_built(builder):
    name = _module_of(builder)
    try:
        mod = importlib.import_module(name)
    except ImportError as exc:
        pytest.fail(f"{name} is not built ({exc}); run pip install -e . or setup.py build_ext")
    assert hasattr(mod, "lib") and hasattr(mod, "ffi")
