"""Typed errors of the ``curves`` package.

Every deliberate refusal here is a :class:`CurveError`, which is both a
:class:`czyx.errors.CzyxError` (so the CLI prints it as one line) and a
:class:`ValueError` (so callers that only know "bad input" still catch it).
"""

from __future__ import annotations

from czyx.errors import CzyxError


class CurveError(CzyxError, ValueError):
    """Bad input to a curve or layout: out-of-range coordinate, ordinal, shape or spec."""
