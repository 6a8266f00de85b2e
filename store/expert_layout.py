"""The swap point for the expert space's two-level layout.

Mount, open and export construct layouts only through :func:`make_layout` and
:func:`layout_from_manifest`. They use ``curves.layout.ExpertLayout`` (outer
curve over ``(layer, class value)``, rank-compacted, row-major inside an
extent). Where that module is not present yet, a row-major stand-in with the
same interface and the same manifest record is used: ``slot = layer *
n_classes + class``, which is exactly what ``ExpertLayout`` computes for
``outer="rowmajor"``, so a manifest written by either reads back in both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from store.mount_errors import ModelSpaceError, MountError

try:
    from curves.layout import ExpertLayout
except ImportError:  # pragma: no cover - depends on which branches are merged
    ExpertLayout = None

HAVE_CURVE_LAYOUT = ExpertLayout is not None
DEFAULT_OUTER = "morton" if HAVE_CURVE_LAYOUT else "rowmajor"


def make_layout(n_layers: int, n_classes: int, outer: str, class_perm: Any = None) -> Any:
    """The layout of ``n_layers x n_classes`` experts under outer curve ``outer``."""
    if ExpertLayout is not None:
        return ExpertLayout(n_layers, n_classes, outer, class_perm)
    if outer != "rowmajor":
        raise MountError(f"outer curve {outer!r} needs curves.layout; only 'rowmajor' here")
    return _RowMajorLayout.create(n_layers, n_classes, class_perm)


def layout_from_manifest(manifest: dict[str, Any]) -> Any:
    """Rebuild the layout a model manifest records."""
    spec = manifest.get("layout")
    if not isinstance(spec, dict):
        raise ModelSpaceError("model manifest has no layout")
    if ExpertLayout is not None:
        return ExpertLayout.from_dict(spec)
    return make_layout(spec["n_layers"], spec["n_classes"], spec["outer"], spec["class_perm"])


@dataclass(frozen=True)
class _RowMajorLayout:
    """Row-major stand-in for ``ExpertLayout`` (same methods mount and open use)."""

    n_layers: int
    n_classes: int
    cls: np.ndarray  # [n_layers, n_classes] router byte -> class value
    class_perm: Any

    @classmethod
    def create(cls, n_layers: int, n_classes: int, perm: Any) -> _RowMajorLayout:
        table = np.tile(np.arange(n_classes), (n_layers, 1))
        if perm is not None:
            table = np.array(perm, dtype=np.int64)
            ok = table.shape == (n_layers, n_classes) and all(
                sorted(row) == list(range(n_classes)) for row in table.tolist()
            )
            if not ok:
                raise MountError(f"class_perm is not {n_layers} permutations of {n_classes}")
            perm = table.tolist()
        return cls(n_layers, n_classes, table, perm)

    def ordinal(self, layer: int, expert: int) -> int:
        return layer * self.n_classes + int(self.cls[layer, expert])

    def class_of(self, layer: int, expert: int) -> int:
        return int(self.cls[layer, expert])

    def class_array(self, layers: Any, experts: Any) -> np.ndarray:
        return self.cls[np.asarray(layers), np.asarray(experts)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "n_layers": self.n_layers,
            "n_classes": self.n_classes,
            "outer": "rowmajor",
            "inner": "rowmajor",
            "compaction": "rank",
            "class_perm": self.class_perm,
        }
