"""The root of every typed error czyx raises on purpose.

Each package derives its own small hierarchy from :class:`CzyxError`
(``store.errors``, ``portals.errors``, ...). The CLI prints any ``CzyxError``
as one line and exits non-zero; anything else is a bug and says so.
"""

from __future__ import annotations


class CzyxError(Exception):
    """Base class of all deliberate czyx errors (bad input, faults, refusals)."""
