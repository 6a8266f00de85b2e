"""Quantized formats on disk: group-wise q2/q3/q4/q8, the weighted quantizer, policies.

``formats`` defines the packed layout and ``quantize`` / ``dequantize``;
``quantizer`` chooses scales and offsets (importance-weighted least squares);
``policy`` maps tensor roles to formats. See each module's docstring.
"""

from __future__ import annotations

from czyx.store.quant.errors import (
    FormatError,
    PackedBufferError,
    PolicyError,
    QuantError,
    ShapeError,
)
from czyx.store.quant.formats import (
    FORMATS,
    QuantFormat,
    dequantize,
    get_format,
    is_quant_format,
    quantize,
    views,
)
from czyx.store.quant.policy import POLICIES, Decision, Policy, parse_policy, role_class

__all__ = [
    "FORMATS",
    "POLICIES",
    "Decision",
    "FormatError",
    "PackedBufferError",
    "Policy",
    "PolicyError",
    "QuantError",
    "QuantFormat",
    "ShapeError",
    "dequantize",
    "get_format",
    "is_quant_format",
    "parse_policy",
    "quantize",
    "role_class",
    "views",
]
