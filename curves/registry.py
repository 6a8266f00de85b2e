"""Curves by name: the registry that manifests use to record and rebuild a space's curve."""

from __future__ import annotations

from typing import Any

from czyx.curves.base import Curve
from czyx.curves.errors import CurveError
from czyx.curves.hilbert import HilbertCurve
from czyx.curves.morton import MortonCurve
from czyx.curves.permuted import PermutedCurve
from czyx.curves.rowmajor import RowMajorCurve

CURVES: dict[str, type] = {
    "morton": MortonCurve,
    "hilbert": HilbertCurve,
    "rowmajor": RowMajorCurve,
}


def make_curve(name: str, ndim: int = 3, bits: int = 61) -> Curve:
    """The curve called ``name`` (``morton``, ``hilbert``, ``rowmajor``).

    Raises
    ------
    CurveError
        For an unknown name or a bad ``ndim``/``bits``.
    """
    try:
        cls = CURVES[name]
    except (KeyError, TypeError):
        raise CurveError(f"curve name: {name!r} is not one of {sorted(CURVES)}") from None
    return cls(ndim=ndim, bits=bits)


def curve_from_dict(spec: dict[str, Any]) -> Curve:
    """Rebuild a curve from its ``to_dict()`` description.

    Raises
    ------
    CurveError
        If the description is malformed.
    """
    if not isinstance(spec, dict) or "name" not in spec:
        raise CurveError(f"curve spec: {spec!r} has no 'name'")
    if spec["name"] == "permuted":
        if "inner" not in spec or "perms" not in spec:
            raise CurveError("curve spec: a permuted curve needs 'inner' and 'perms'")
        return PermutedCurve(curve_from_dict(spec["inner"]), tuple(spec["perms"]))
    try:
        return make_curve(spec["name"], int(spec["ndim"]), int(spec["bits"]))
    except KeyError as exc:
        raise CurveError(f"curve spec: missing {exc.args[0]!r}") from None
