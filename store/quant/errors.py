"""Typed errors of the quantized formats (``store.quant``).

Every deliberate failure of a format, a shape, a policy or a packed buffer is a
:class:`QuantError`; the concrete classes also derive from ``ValueError`` so
that generic callers (and the CLI) treat them as bad input.
"""

from __future__ import annotations

from czyx.errors import CzyxError


class QuantError(CzyxError):
    """Base of every error raised by ``store.quant`` and the quantized kernels."""


class FormatError(QuantError, ValueError):
    """An unknown or malformed format name, or a format that cannot hold a value."""


class ShapeError(QuantError, ValueError):
    """A matrix shape the format cannot pack (columns not a multiple of the group)."""


class PackedBufferError(QuantError, ValueError):
    """A packed buffer whose size or dtype does not match its format and shape."""


class PolicyError(QuantError, ValueError):
    """An unknown policy name, or a policy mapping a role to an unknown format."""


class CalibrationError(QuantError, ValueError):
    """A malformed importance map, or activations inconsistent with earlier ones."""
