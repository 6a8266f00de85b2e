"""The compact, printable portal token and its binary layout.

Binary layout (all fields fixed or length-prefixed, so parsing is strict)::

    version   1 byte   (= 1)
    store id  8 bytes  (public fingerprint of the issuing store's secret)
    root id   16 bytes (the owner's root portal id of that store)
    count     varint   (number of caveats)
    caveats   count x (tag || varint len || body)   see portals.caveats
    signature 32 bytes (HMAC-SHA256 chain, see portals.chain)

Text form: ``czp1_`` followed by the unpadded base64url of the bytes. A token
is a bearer credential: it is never logged, stored in a descriptor or echoed
in an error message.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field

from czyx.portals._wire import Reader, encode_varint
from czyx.portals.caveats import PORTAL_ID_SIZE, Caveat, decode_caveat
from czyx.portals.errors import TokenFormatError
from czyx.portals.permission import Permission

VERSION = 1
PREFIX = "czp1_"
STORE_ID_SIZE = 8
SIGNATURE_SIZE = 32
HEADER_SIZE = 1 + STORE_ID_SIZE + PORTAL_ID_SIZE
MAX_CAVEATS = 64  # bounds verification work on hostile input
MAX_TEXT = 8192


def header_bytes(store_id: bytes, root_id: bytes) -> bytes:
    """The bytes the signature chain starts from (``version || store id || root id``)."""
    return bytes((VERSION,)) + store_id + root_id


@dataclass(frozen=True)
class Token:
    """A decoded portal token. Its signature is not verified by decoding.

    Attributes
    ----------
    store_id, root_id:
        Header fields (see module docstring).
    caveats:
        Caveat values in chain order.
    signature:
        The 32-byte chained HMAC (hidden from ``repr``).
    """

    store_id: bytes
    root_id: bytes
    caveats: tuple[Caveat, ...]
    signature: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.store_id) != STORE_ID_SIZE or len(self.root_id) != PORTAL_ID_SIZE:
            raise TokenFormatError("token: bad header field size")
        if len(self.signature) != SIGNATURE_SIZE:
            raise TokenFormatError("token: bad signature size")
        if len(self.caveats) > MAX_CAVEATS:
            raise TokenFormatError(f"token: more than {MAX_CAVEATS} caveats")

    @property
    def header(self) -> bytes:
        """The bytes the signature chain starts from (``version || store id || root id``)."""
        return header_bytes(self.store_id, self.root_id)

    def encoded_caveats(self) -> list[bytes]:
        """Each caveat's canonical bytes, in chain order.

        Always re-encoded from the caveat values, never cached from parsing:
        the bytes the signature covers must be the ones the permission is
        computed from (decoding is canonical, so for a parsed token they are
        the same bytes).
        """
        return [c.encode() for c in self.caveats]

    def permission(self) -> Permission:
        """The permission the caveats describe (meaningful only once verified)."""
        return Permission.from_caveats(self.root_id, self.caveats)

    def to_bytes(self) -> bytes:
        """The binary form: header, caveat count, caveats, signature."""
        parts = [self.header, encode_varint(len(self.caveats)), *self.encoded_caveats()]
        return b"".join(parts) + self.signature

    def to_text(self) -> str:
        """The printable form: ``czp1_`` + unpadded base64url."""
        return PREFIX + base64.urlsafe_b64encode(self.to_bytes()).rstrip(b"=").decode("ascii")

    def __str__(self) -> str:
        # Never print the credential by accident; to_text() is explicit.
        return f"<portal token {self.root_id.hex()[:8]}.., {len(self.caveats)} caveats>"

    @classmethod
    def from_bytes(cls, data: bytes) -> Token:
        """Strictly decode the binary form; any defect is a :class:`TokenFormatError`."""
        r = Reader(bytes(data))
        version = r.byte("version")
        if version != VERSION:
            raise TokenFormatError(f"token: unsupported version {version}")
        store_id = r.take(STORE_ID_SIZE, "store id")
        root_id = r.take(PORTAL_ID_SIZE, "root id")
        count = r.varint("caveat count")
        if count > MAX_CAVEATS:
            raise TokenFormatError(f"token: {count} caveats (at most {MAX_CAVEATS})")
        caveats = tuple(decode_caveat(r)[0] for _ in range(count))
        sig = r.take(SIGNATURE_SIZE, "signature")
        r.done("signature")
        return cls(store_id, root_id, caveats, sig)

    @classmethod
    def from_text(cls, text: str) -> Token:
        """Decode the printable form (surrounding whitespace is ignored)."""
        if not isinstance(text, str):
            raise TokenFormatError("token: expected text")
        text = text.strip()
        if len(text) > MAX_TEXT:
            raise TokenFormatError(f"token: longer than {MAX_TEXT} characters")
        if not text.startswith(PREFIX):
            raise TokenFormatError(f"token: does not start with {PREFIX!r}")
        body = text[len(PREFIX) :]
        if not body or any(c in body for c in "=+/ \n\t"):
            raise TokenFormatError("token: not unpadded base64url")
        try:
            raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        except (binascii.Error, ValueError) as exc:
            raise TokenFormatError("token: not valid base64url") from exc
        # Reject non-canonical spellings (spare bits set in the last base64
        # character), so that a token has exactly one printable form.
        if base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii") != body:
            raise TokenFormatError("token: non-canonical base64url")
        return cls.from_bytes(raw)
