"""Space-filling curves behind one ``Curve`` protocol, and two-level layouts.

Pure arithmetic: nothing here does I/O.
"""

from __future__ import annotations

from curves.base import Curve
from curves.morton import MortonCurve

__all__ = ["Curve", "MortonCurve"]
