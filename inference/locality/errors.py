"""Typed errors of routing traces and the locality analysis.

``TraceError`` is raised for a malformed or inconsistent trace file (it names
the file and the field); ``LocalityError`` for analysis inputs that cannot be
honoured (a cache budget below ``top_k``, a layout of the wrong shape, ...).
Both are also ``ValueError`` so generic callers that catch bad input keep working.
"""

from __future__ import annotations

from czyx.errors import CzyxError


class LocalityError(CzyxError, ValueError):
    """Bad input to the locality analysis (shapes, budgets, layouts)."""


class TraceError(LocalityError):
    """A routing trace that is malformed, inconsistent or of an unknown format version."""
