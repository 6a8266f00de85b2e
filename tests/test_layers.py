"""The layering contract of DESIGN.md, checked on every import in the source tree.

    curves  <-  czyx core (key, selectors, errors)  <-  store  <-  portals  <-  inference
            <-  CLI / server / testing

A module may import its own package and the layers below it, never one above: the
check reads every ``import`` statement (lazy ones inside functions and
``TYPE_CHECKING`` blocks included) with :mod:`ast`, so it fails on the commit that
introduces a violation or a cycle between packages.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# import prefix -> (folder, layer); the most specific prefix wins
LAYERS = {
    "czyx.curves": ("curves", 0),
    "czyx": ("czyx", 1),
    "czyx.store": ("store", 2),
    "czyx.portals": ("portals", 3),
    "czyx.inference": ("inference", 4),
    "czyx.cli": ("czyx/cli", 5),
    "czyx.server": ("czyx/server", 5),
    "czyx.testing": ("czyx/testing", 5),
    "czyx.__main__": ("czyx/__main__.py", 5),
}
NAMES = {0: "curves", 1: "czyx core", 2: "store", 3: "portals", 4: "inference", 5: "CLI/server"}


def layer_of(module: str) -> int | None:
    """The layer of a ``czyx.*`` module name (``None``: not ours)."""
    best = None
    for prefix, (_, layer) in LAYERS.items():
        if (module == prefix or module.startswith(prefix + ".")) and (
            best is None or len(prefix) > len(best[0])
        ):
            best = (prefix, layer)
    return None if best is None else best[1]


def module_of(path: Path) -> str:
    """The installed module name of a source file."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if parts[0] != "czyx":
        parts = ["czyx", *parts]
    return ".".join(parts)


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """Every module an import statement names, with its line."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            # `from czyx import store` imports the package czyx.store
            out.extend((node.lineno, f"{node.module}.{a.name}") for a in node.names)
    return out


SOURCES = sorted(
    p
    for folder in ("curves", "czyx", "store", "portals", "inference")
    for p in (ROOT / folder).rglob("*.py")
)


def violations() -> list[str]:
    found = []
    for path in SOURCES:
        me = module_of(path)
        mine = layer_of(me)
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for line, target in imported_modules(tree):
            if target.split(".")[0] not in ("czyx", "curves", "store", "portals", "inference"):
                continue
            if target.split(".")[0] != "czyx":
                found.append(f"{path.relative_to(ROOT)}:{line}: imports {target} (not under czyx.)")
                continue
            theirs = layer_of(target)
            if theirs is not None and mine is not None and theirs > mine:
                found.append(
                    f"{path.relative_to(ROOT)}:{line}: {NAMES[mine]} imports {target} "
                    f"({NAMES[theirs]}, a layer above)"
                )
    return found


def test_sources_found():
    assert len(SOURCES) > 100
    assert layer_of("czyx.store.core.writer") == 2 and layer_of("czyx.key") == 1


def test_imports_follow_the_layers():
    bad = violations()
    assert not bad, "layer violations:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("source", "expect"),
    [
        ("from czyx.portals import open_space\n", True),
        ("from czyx import inference\n", True),
        ("def f():\n    import czyx.cli.commands\n", True),
        ("from czyx.key import Key\n", False),
        ("import numpy\n", False),
    ],
)
def test_the_check_catches_an_upward_import(source, expect):
    """The checker itself: a store module importing portals or above is caught."""
    tree = ast.parse(source)
    ups = [t for _, t in imported_modules(tree) if (layer_of(t) or 0) > layer_of("czyx.store")]
    assert bool(ups) == expect
