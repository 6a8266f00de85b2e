"""The HMAC chain: minting, offline attenuation and signature verification.

In the manner of macaroons (Birgisson et al., NDSS 2014): a store derives a
root key from its secret with an HKDF step (RFC 5869, SHA-256), then

    sig_0 = HMAC(root_key, header)            header = version || store id || root id
    sig_i = HMAC(sig_{i-1}, caveat_i bytes)

and a token carries only the final ``sig_n``. Anyone holding a token can
append a caveat (``sig_{n+1} = HMAC(sig_n, c)``) without the secret, but
nobody can remove or change one: that would need an earlier ``sig_i``, which
is never revealed. Verification recomputes the chain from the secret and
compares in constant time (:func:`hmac.compare_digest`); no lookup is needed
to check the caveats themselves.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from dataclasses import dataclass, field

from czyx.portals.caveats import Caveat as _Caveat
from czyx.portals.caveats import (
    ClassRange,
    ClassSet,
    Expires,
    LayerRange,
    PortalId,
    Rights,
    Spaces,
    Tenant,
    format_mask,
)
from czyx.portals.errors import CaveatError, ForeignPortal, InvalidSignature, WideningError
from czyx.portals.permission import Permission
from czyx.portals.token import SIGNATURE_SIZE, STORE_ID_SIZE, Token, header_bytes

_SALT = b"czyx-portals-v1"


def hkdf(secret: bytes, info: bytes, length: int = 32) -> bytes:
    """HKDF-SHA256 (extract with a fixed salt, then expand ``length`` bytes of ``info``)."""
    prk = hmac.digest(_SALT, secret, "sha256")
    out, block, i = b"", b"", 1
    while len(out) < length:
        block = hmac.digest(prk, block + info + bytes((i,)), "sha256")
        out += block
        i += 1
    return out[:length]


@dataclass(frozen=True)
class ChainKeys:
    """Keys derived from a store secret. The secret itself is not kept.

    ``root_key`` signs; ``store_id`` is a public 8-byte fingerprint that lets a
    store tell "issued elsewhere" from "forged" (an HKDF output reveals nothing
    about the secret or the root key).
    """

    root_key: bytes = field(repr=False)
    store_id: bytes
    owner_id: bytes  # the owner's root portal id, deterministic per secret

    @classmethod
    def from_secret(cls, secret: bytes) -> ChainKeys:
        """Derive the root key, store id and owner portal id from the store secret (HKDF)."""
        return cls(
            root_key=hkdf(secret, b"portal root key"),
            store_id=hkdf(secret, b"store id", STORE_ID_SIZE),
            owner_id=hkdf(secret, b"owner root portal id", 16),
        )


def _extend(sig: bytes, caveat_bytes: bytes) -> bytes:
    return hmac.digest(sig, caveat_bytes, "sha256")


def chain_signature(root_key: bytes, header: bytes, caveat_bytes: Iterable[bytes]) -> bytes:
    """Recompute ``sig_n`` for ``header`` and the encoded caveats."""
    sig = hmac.digest(root_key, header, "sha256")
    for c in caveat_bytes:
        sig = hmac.digest(sig, c, "sha256")
    return sig


def mint(keys: ChainKeys, root_id: bytes, caveats: Iterable[_Caveat] = ()) -> Token:
    """Issue a token under ``keys`` with header id ``root_id`` and ``caveats``."""
    cavs = tuple(caveats)
    header = header_bytes(keys.store_id, root_id)
    sig = chain_signature(keys.root_key, header, (c.encode() for c in cavs))
    return Token(keys.store_id, root_id, cavs, sig)


def verify_signature(keys: ChainKeys, token: Token) -> None:
    """Raise unless ``token`` was issued under ``keys`` and its chain is intact.

    Raises
    ------
    ForeignPortal
        The store id is not this store's (the token comes from another secret).
    InvalidSignature
        The chain does not reproduce the signature (forged or tampered).
    """
    # The store id is public and compared first only to give a better reason;
    # the signature check below is what actually decides.
    if not hmac.compare_digest(token.store_id, keys.store_id):
        raise ForeignPortal("portal was issued by another store")
    expect = chain_signature(keys.root_key, token.header, token.encoded_caveats())
    if len(token.signature) != SIGNATURE_SIZE or not hmac.compare_digest(expect, token.signature):
        raise InvalidSignature("portal signature does not verify (forged or tampered)")


def _widening(perm: Permission, cav: _Caveat) -> str | None:
    """Why ``cav`` asks for more than ``perm`` grants, or ``None`` if it only narrows."""
    if isinstance(cav, Rights):
        extra = cav.rights - perm.rights
        return f"rights {sorted(extra)} not held (has {sorted(perm.rights)})" if extra else None
    if isinstance(cav, Spaces):
        if perm.spaces is not None and not cav.selectors <= perm.spaces:
            return "spaces outside the portal's spaces"
        return None
    if isinstance(cav, Tenant):
        if perm.tenants is not None and cav.name not in perm.tenants:
            return f"tenant {cav.name!r} differs from the portal's tenant"
        return None
    if isinstance(cav, Expires):
        if perm.expires is not None and cav.at > perm.expires:
            return f"expiry {_when(cav.at)} later than the portal's {_when(perm.expires)}"
        return None
    if isinstance(cav, ClassRange | ClassSet | LayerRange):
        have = perm.scope if cav.space is None else perm.scope_for(cav.space)
        if cav.space is not None and perm.spaces is not None and cav.space not in perm.spaces:
            return "caveat names a space the portal does not cover"
        if isinstance(cav, LayerRange):
            if cav.lo < have.layer_lo or cav.hi > have.layer_hi:
                return f"layers {cav.lo}-{cav.hi} outside {have.layer_lo}-{have.layer_hi}"
            return None
        if cav.mask & ~have.classes:
            return f"classes {format_mask(cav.mask & ~have.classes)} not held"
        return None
    return None


def _when(t: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def attenuate(token: Token, caveats: Iterable[_Caveat], *, strict: bool = True) -> Token:
    """Offline attenuation: append ``caveats`` and extend the signature chain.

    Needs no secret and no store. The result can never permit more than
    ``token`` (caveats intersect). With ``strict`` (the default) a caveat that
    *asks* for more than the token has (for example classes 0-255 on a 0-63
    token) raises :class:`WideningError` instead of being silently narrowed.

    Raises
    ------
    WideningError
        A caveat asks for more than the token grants (``strict`` only).
    CaveatError
        A :class:`PortalId` caveat: ids are assigned by the store at grant time.
    """
    perm = token.permission()
    sig = token.signature
    out = list(token.caveats)
    for cav in caveats:
        if isinstance(cav, PortalId):
            raise CaveatError("portal ids are assigned by the store (use grant)")
        if strict:
            why = _widening(perm, cav)
            if why:
                raise WideningError(f"attenuation would widen the portal: {why}")
        perm = perm.with_caveat(cav)
        sig = _extend(sig, cav.encode())
        out.append(cav)
    return Token(token.store_id, token.root_id, tuple(out), sig)


def extend_registered(token: Token, portal_id: bytes, caveats: Iterable[_Caveat]) -> Token:
    """Append a store-assigned :class:`PortalId` then ``caveats`` (strict). Store use only."""
    first = PortalId(portal_id)
    t = Token(
        token.store_id,
        token.root_id,
        (*token.caveats, first),
        _extend(token.signature, first.encode()),
    )
    return attenuate(t, caveats, strict=True)
