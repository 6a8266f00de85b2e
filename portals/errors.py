"""The typed errors of the portals package.

Two families: :class:`TokenFormatError` for input that is not a well-formed
token at all (truncated, garbled, unknown caveat), and :class:`PortalDenied`
for a well-formed request that the capability does not permit (bad
signature, expired, revoked, out of scope). Every refusal made on behalf of a
store is also written to its audit log before the error is raised.

No message here ever contains a token, a signature or the store secret: a
token is a bearer credential and is treated as a secret too.
"""

from __future__ import annotations

from czyx.errors import CzyxError


class PortalError(CzyxError):
    """Base of every error raised by :mod:`portals`."""


class CaveatError(PortalError, ValueError):
    """A caveat value is invalid (empty class set, reversed range, bad tenant name)."""


class SecretError(PortalError):
    """The store secret file is missing, unreadable, malformed or too permissive."""


class PortalDenied(PortalError):
    """A portal does not permit the requested access.

    Attributes
    ----------
    reason:
        A short machine-friendly reason (``"signature"``, ``"expired"``, ...),
        the same string that is written to the audit log.
    """

    reason = "denied"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class TokenFormatError(PortalDenied, ValueError):
    """The text is not a well-formed portal token (truncated, garbled, unknown field).

    A malformed token is a denied access like any other, and also a
    ``ValueError`` for callers that only parse.
    """

    reason = "malformed"


class WideningError(PortalDenied, ValueError):
    """An attenuation asked for more than its parent allows.

    Attenuation can only narrow. The signature chain already guarantees that
    an added caveat never widens the *effective* permission (caveats
    intersect); this error is raised earlier, when the request itself would
    be wider, so that the caller is not silently handed less than asked for.
    """

    reason = "widening"


class InvalidSignature(PortalDenied):
    """The signature chain does not verify (forged, tampered or truncated caveats)."""

    reason = "signature"


class ForeignPortal(PortalDenied):
    """The token was issued by another store (a different secret)."""

    reason = "foreign-store"


class UnknownPortal(PortalDenied):
    """A portal id in the token's chain has no descriptor in this store."""

    reason = "unknown-portal"


class PortalExpired(PortalDenied):
    """The portal's expiry time has passed."""

    reason = "expired"


class PortalRevoked(PortalDenied):
    """The portal, or a portal it was attenuated from, has been revoked."""

    reason = "revoked"


class OutOfScope(PortalDenied):
    """The access is outside the portal's caveats (space, right, tenant, class, layer)."""

    reason = "out-of-scope"


class RecordNotFoundError(PortalError, KeyError):
    """The portal covers the key but the space holds no record there (a ``KeyError`` too)."""

    def __str__(self) -> str:  # KeyError would show the message's repr
        return str(self.args[0]) if self.args else ""


class RootRevocationError(PortalError):
    """The owner's root portal cannot be revoked (rotate the store secret instead)."""
