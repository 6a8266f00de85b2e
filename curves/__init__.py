"""Space-filling curves behind one ``Curve`` protocol, and two-level layouts.

Pure arithmetic: nothing here does I/O. Curves are named in manifests
(``to_dict``) and rebuilt with :func:`curve_from_dict` / :func:`make_curve`;
:class:`ExpertLayout` numbers the experts of a MoE model in its block file.
Conventions (bit order, multi-word ordinals) are in :mod:`curves.base` and
:mod:`curves.words`.
"""

from __future__ import annotations

from czyx.curves.base import Curve
from czyx.curves.errors import CurveError
from czyx.curves.hilbert import HilbertCurve
from czyx.curves.layout import ExpertLayout
from czyx.curves.morton import MortonCurve
from czyx.curves.permuted import PermutedCurve
from czyx.curves.registry import CURVES, curve_from_dict, make_curve
from czyx.curves.rowmajor import RowMajorCurve

__all__ = [
    "CURVES",
    "Curve",
    "CurveError",
    "ExpertLayout",
    "HilbertCurve",
    "MortonCurve",
    "PermutedCurve",
    "RowMajorCurve",
    "curve_from_dict",
    "make_curve",
]
