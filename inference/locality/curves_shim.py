"""Physical slot of each expert under an outer curve over ``(layer, class)``.

Scope: the one place the locality analysis turns a curve name and a class
order into slot indices. It delegates to :class:`curves.layout.ExpertLayout`,
the layout the store writes block files with (occupied cells ranked densely
along the curve, so a block file has no holes), so what is measured here is
what a mounted space would do.
"""

from __future__ import annotations

import numpy as np

from czyx.inference.locality.errors import LocalityError

CURVES = ("layer-major", "morton", "hilbert")
_OUTER = {"layer-major": "rowmajor", "morton": "morton", "hilbert": "hilbert"}


def expert_slots(
    curve: str, n_layers: int, n_experts: int, class_of: np.ndarray | None = None
) -> np.ndarray:
    """Slot index ``[L, E]`` of each (layer, router index) expert.

    Parameters
    ----------
    curve : str
        One of :data:`CURVES` (``layer-major`` is the row-major curve:
        ``slot = layer * E + class``).
    n_layers, n_experts : int
        Grid size.
    class_of : np.ndarray, optional
        ``[L, E]`` router index -> class value (identity when omitted).

    Returns
    -------
    np.ndarray
        int64 ``[L, E]``, a permutation of ``range(L*E)``.
    """
    from czyx.curves.errors import CurveError
    from czyx.curves.layout import ExpertLayout

    if curve not in _OUTER:
        raise LocalityError(f"unknown curve {curve!r}; expected one of {', '.join(CURVES)}")
    if class_of is not None:
        class_of = np.asarray(class_of, dtype=np.int64)
        if class_of.shape != (n_layers, n_experts):
            raise LocalityError(
                f"class_of shape {class_of.shape}, expected {(n_layers, n_experts)}"
            )
    try:
        layout = ExpertLayout(n_layers, n_experts, outer=_OUTER[curve], class_perm=class_of)
    except CurveError as exc:
        raise LocalityError(f"layout {curve}: {exc}") from exc
    return np.array(layout.slot_table, dtype=np.int64)
