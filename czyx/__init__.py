"""czyx: the 24-byte key, space selectors, reserved classes and spaces, and the CLI.

This package knows nothing about LMDB, files or models: it defines how a
position in a space is named. ``store`` turns names into bytes, ``portals``
decides who may resolve them, ``inference`` consumes them.
"""

from __future__ import annotations

from czyx.errors import CzyxError
from czyx.key import (
    COORD_BITS,
    EDG,
    KEY_SIZE,
    MEM,
    PRJ,
    SES,
    Key,
    as_void,
    class_prefix,
    class_range_bounds,
    pack_keys,
    unpack_keys,
)
from czyx.space import (
    EDGE_PREFIX,
    PORTAL_PREFIX,
    SELECTOR_SIZE,
    Selector,
    canonical_manifest,
)

__version__ = "0.1.0"

__all__ = [
    "COORD_BITS",
    "EDG",
    "EDGE_PREFIX",
    "KEY_SIZE",
    "MEM",
    "PORTAL_PREFIX",
    "PRJ",
    "SELECTOR_SIZE",
    "SES",
    "CzyxError",
    "Key",
    "Selector",
    "__version__",
    "as_void",
    "canonical_manifest",
    "class_prefix",
    "class_range_bounds",
    "pack_keys",
    "unpack_keys",
]
