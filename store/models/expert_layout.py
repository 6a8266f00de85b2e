"""The one place mount, open and export construct the expert space's layout.

``curves.layout.ExpertLayout`` is the two-level layout: an outer curve over
``(layer, class value)`` (Morton by default), rank-compacted so the block file
has no holes between curve cells, and row-major order inside an extent. Its
``to_dict()`` is what a model manifest records under ``"layout"``, and
``from_dict`` is how an opened model gets it back, so the offset arithmetic at
open is the arithmetic used at mount. :func:`expert_record_key` is where an
expert's record sits (``czyx.expert_key``: the class byte, and ``y`` for the
high bits of a class value above 255).
"""

from __future__ import annotations

from typing import Any

from czyx.curves.layout import ExpertLayout
from czyx.expert_key import class_shift, expert_key
from czyx.store.models.mount_errors import ModelSpaceError

DEFAULT_OUTER = "morton"


def make_layout(n_layers: int, n_classes: int, outer: str, class_perm: Any = None) -> ExpertLayout:
    """The layout of ``n_layers x n_classes`` experts under outer curve ``outer``.

    ``class_perm[layer][router byte]`` is the class value of that expert
    (``None``: identity). Bad input raises ``curves.errors.CurveError``.
    """
    return ExpertLayout(n_layers, n_classes, outer, class_perm)


def layout_from_manifest(manifest: dict[str, Any]) -> ExpertLayout:
    """Rebuild the layout a model manifest records."""
    spec = manifest.get("layout")
    if not isinstance(spec, dict):
        raise ModelSpaceError("model manifest has no layout")
    return ExpertLayout.from_dict(spec)


def expert_record_key(layout: ExpertLayout, layer: int, expert: int) -> bytes:
    """The packed key of router index ``expert``'s record in ``layer`` (``czyx.expert_key``)."""
    shift = class_shift(layout.n_classes)
    return expert_key(layout.class_of(layer, expert), layer, shift).pack()
