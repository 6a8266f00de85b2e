"""Typed errors of the ``curves`` package.

Every deliberate refusal here is a :class:`CurveError`, a :class:`ValueError`
(bad input). ``curves`` is the bottom layer and knows nothing of czyx, so it does
not derive from :class:`czyx.errors.CzyxError`; the CLI prints a ``ValueError`` as
one line all the same.
"""

from __future__ import annotations


class CurveError(ValueError):
    """Bad input to a curve or layout: out-of-range coordinate, ordinal, shape or spec."""
