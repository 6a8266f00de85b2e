"""256-bit space selectors.

A model version's selector is derived from a hash of its canonical content
manifest, so the same import twice is the same space. Names (``name@version``)
are tags that point at selectors; they are resolved once, at open.
Selectors starting with 0xFF are reserved for association edges, 0xFE for
portal descriptors.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

SELECTOR_SIZE = 32
EDGE_PREFIX = 0xFF
PORTAL_PREFIX = 0xFE
RESERVED_PREFIXES = frozenset({EDGE_PREFIX, PORTAL_PREFIX})


@dataclass(frozen=True, order=True)
class Selector:
    """A 32-byte space selector."""

    raw: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.raw, bytes | bytearray) or len(self.raw) != SELECTOR_SIZE:
            got = len(self.raw) if isinstance(self.raw, bytes | bytearray) else type(self.raw)
            raise ValueError(f"selector: expected {SELECTOR_SIZE} bytes, got {got}")
        object.__setattr__(self, "raw", bytes(self.raw))

    @property
    def reserved(self) -> bool:
        """Whether the first byte is a reserved prefix (0xFF edges, 0xFE portals)."""
        return self.raw[0] in RESERVED_PREFIXES

    def hex(self) -> str:
        """The 64-character lowercase hex form."""
        return self.raw.hex()

    @classmethod
    def from_hex(cls, text: str) -> Selector:
        """Parse the hex form (any selector, reserved or not)."""
        try:
            raw = bytes.fromhex(text)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"selector: not hex: {text!r}") from exc
        return cls(raw)

    @classmethod
    def for_space(cls, raw: bytes) -> Selector:
        """An ordinary space's selector; refuses the reserved prefixes."""
        sel = cls(raw)
        if sel.reserved:
            raise ValueError(f"selector: prefix 0x{sel.raw[0]:02X} is reserved")
        return sel

    @classmethod
    def from_content(cls, canonical: bytes) -> Selector:
        """Selector of a space whose canonical manifest bytes are ``canonical``.

        The first byte is re-hashed away from the reserved prefixes, so a
        content selector is never mistaken for an edge or portal space.
        """
        return cls(
            _unreserved(hashlib.blake2b(canonical, digest_size=32, person=b"czyx-content").digest())
        )

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any]) -> Selector:
        """Content selector of a manifest: :meth:`from_content` of :func:`canonical_manifest`."""
        return cls.from_content(canonical_manifest(manifest))

    @classmethod
    def from_name(cls, name: str) -> Selector:
        """Selector derived from a name (for spaces that are named, not content-addressed)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"selector name: {name!r} is not a non-empty string")
        return cls(
            _unreserved(
                hashlib.blake2b(name.encode(), digest_size=32, person=b"czyx-name").digest()
            )
        )

    @classmethod
    def reserved_space(cls, prefix: int, name: str = "") -> Selector:
        """The selector of a reserved space (0xFF edges, 0xFE portal descriptors)."""
        if prefix not in RESERVED_PREFIXES:
            raise ValueError(f"selector: prefix {prefix!r} is not a reserved prefix (0xFE, 0xFF)")
        tail = hashlib.blake2b(name.encode(), digest_size=31, person=b"czyx-reserved").digest()
        return cls(bytes((prefix,)) + tail)


def canonical_manifest(manifest: dict[str, Any]) -> bytes:
    """The canonical bytes of a manifest: UTF-8 JSON, sorted keys, no whitespace.

    Two manifests with the same content give the same bytes whatever their key
    order, so the same import twice gets the same selector.

    Raises
    ------
    ValueError
        ``manifest`` if it is not a dict or holds a value JSON cannot carry
        (bytes, NaN, non-string keys...): put hashes in as hex strings.
    """
    if not isinstance(manifest, dict):
        raise ValueError(f"manifest: expected a dict, got {type(manifest).__name__}")
    try:
        text = json.dumps(
            manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(f"manifest: not canonical JSON: {exc}") from None
    return text.encode()


def _unreserved(digest: bytes) -> bytes:
    if digest[0] in RESERVED_PREFIXES:
        # Clearing the top bit maps 0xFE/0xFF to 0x7E/0x7F; the remaining 255
        # bits stay the hash, so collisions stay at 2**-255 scale.
        digest = bytes((digest[0] & 0x7F,)) + digest[1:]
    return digest
