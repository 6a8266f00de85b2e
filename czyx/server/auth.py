"""Portals as bearer tokens: verify once, then an O(1) check per request.

Scope: ``Authorization: Bearer <portal token>`` -> the caller (tenant, portal
id, permission). The first sight of a token runs the portal authority's full
verification (HMAC chain, lineage descriptors, audited on refusal); the
verified permission is cached by token, and each later request re-checks only
what can change after a signature was verified: expiry (one comparison) and
revocation (one descriptor read per portal in the token's lineage, typically
two; no HMAC), so a revocation by ``czyx revoke`` in another process takes
effect on the caller's next request.

Refusals: no or malformed header, a bad signature, a foreign or unknown
portal -> :class:`Unauthenticated` (HTTP 401); a valid portal that is
expired, revoked, lacks the ``infer`` right or does not cover the requested
version -> :class:`Forbidden` (HTTP 403). Every refusal is audited through the
authority (``portal.deny``). A portal narrowed to some expert classes or
layers is served with its routing narrowed (:meth:`TokenGate.routing_mask`:
the experts whose class and layer the scope permits; the batch routes that
sequence among them only), never with the engine's whole expert set.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from czyx.errors import CzyxError
from czyx.portals.caveats import INFER
from czyx.portals.errors import (
    OutOfScope,
    PortalDenied,
    PortalExpired,
    PortalRevoked,
    TokenFormatError,
)
from czyx.portals.permission import Permission, Scope

# Reasons that mean "we do not know who you are" (401); the rest are 403.
UNAUTHENTICATED = frozenset({"malformed", "signature", "foreign-store", "unknown-portal"})
MAX_CACHED = 4096


class AuthError(CzyxError):
    """A request's bearer token was refused; ``status`` is the HTTP status."""

    status = 403
    code = "permission_denied"


class Unauthenticated(AuthError):
    """No token, or one this store cannot verify (HTTP 401)."""

    status = 401
    code = "invalid_api_key"


class Forbidden(AuthError):
    """A verified portal that does not allow this request (HTTP 403)."""

    status = 403
    code = "permission_denied"


@dataclass(frozen=True)
class Caller:
    """Who a request is: the portal's tenant and id, and its verified permission."""

    tenant: str
    portal_id: str
    permission: Permission
    token: str = field(default="", repr=False, compare=False)  # the bearer token itself


@dataclass(frozen=True)
class ServedVersion:
    """The spaces a grant must cover to use a served version: expert spaces and whole ones."""

    ref: str
    scoped: tuple[bytes, ...]
    whole: tuple[bytes, ...]
    #: ``int [n_layers, n_experts]``: the class value of each routed expert (the router
    #: byte, or its mount-time permutation): what a class caveat names.
    classes: np.ndarray | None = field(default=None, compare=False, repr=False)


def _error_for(exc: PortalDenied) -> AuthError:
    cls = Unauthenticated if exc.reason in UNAUTHENTICATED else Forbidden
    return cls(f"portal refused ({exc.reason}): {exc}")


class TokenGate:
    """Bearer-token checks for one store, with a cache of verified tokens.

    Parameters
    ----------
    store
        The open store (its portal authority verifies and audits).
    versions
        The served versions by tag.
    clock
        Seconds since the epoch (the authority's own clock is used for
        verification; this one for the cached expiry check).
    """

    def __init__(
        self,
        store,
        versions: dict[str, ServedVersion],
        clock: Callable[[], float] = time.time,
    ) -> None:
        from czyx.portals.authority import open_authority

        self.store = store
        self.authority = open_authority(store)
        self.versions = versions
        self.clock = clock
        self._cache: collections.OrderedDict[str, Caller] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.verifications = 0  # full verifications (first sight of a token)

    def authenticate(self, header: str | None) -> Caller:
        """The caller of a request with ``Authorization: header``.

        Raises
        ------
        Unauthenticated, Forbidden
        """
        token = _bearer(header)
        if token is None:
            exc = TokenFormatError("no bearer token (send Authorization: Bearer <portal token>)")
            self.authority.deny(exc, perm=None, right=INFER)
            raise Unauthenticated(str(exc))
        with self._lock:
            caller = self._cache.get(token)
            if caller is not None:
                self._cache.move_to_end(token)
        if caller is None:
            try:
                perm = self.authority.verify(token, right=INFER)  # audits its refusals
            except PortalDenied as exc:
                raise _error_for(exc) from None
            self.verifications += 1
            caller = Caller(perm.tenant or "owner", perm.portal_id.hex(), perm)
            with self._lock:
                self._cache[token] = caller
                while len(self._cache) > MAX_CACHED:
                    self._cache.popitem(last=False)
        else:
            self._recheck(token, caller.permission)
        return replace(caller, token=token)

    def _recheck(self, token: str, perm: Permission) -> None:
        """Expiry and revocation of a cached permission (audited on refusal)."""
        exc: PortalDenied | None = None
        if perm.expires is not None and self.clock() >= perm.expires:
            exc = PortalExpired(f"portal {perm.portal_id.hex()} expired at {perm.expires}")
        else:
            for i, pid in enumerate(perm.ids):
                d = self.store.get_portal_descriptor(pid)
                if d is None or d.get("revoked"):
                    what = "portal" if i == len(perm.ids) - 1 else "parent portal"
                    exc = PortalRevoked(f"{what} {pid.hex()} has been revoked")
                    break
        if exc is not None:
            with self._lock:
                self._cache.pop(token, None)
            self.authority.deny(exc, perm=perm, right=INFER)
            raise _error_for(exc)

    def covers(self, caller: Caller, ref: str) -> str | None:
        """Why ``caller`` may not use version ``ref`` (None: it may)."""
        perm = caller.permission
        v = self.versions.get(ref)
        if v is None:
            return f"version {ref!r} is not served"
        for space in (*v.scoped, *v.whole):
            if not perm.allows_open(space, INFER, now=self.clock()):
                return f"portal does not cover {ref} (space {space.hex()[:16]}..) for infer"
        return None

    def routing_mask(self, caller: Caller, ref: str) -> np.ndarray | None:
        """``bool [n_layers, n_experts]``: the experts of ``ref`` the caller's scope permits
        (None: every one). The scopes of every expert space in the version's chain
        are intersected, as the portal's view does for a consumer."""
        v = self.versions[ref]
        scope = Scope()
        for space in v.scoped:
            scope = scope.narrow(caller.permission.scope_for(space))
        if scope == Scope():
            return None
        if v.classes is None:
            raise Forbidden(f"portal is narrowed but {ref} records no expert classes")
        raw = scope.classes.to_bytes(32, "little")
        bits = np.unpackbits(np.frombuffer(raw, np.uint8), bitorder="little").astype(bool)
        layers = np.arange(v.classes.shape[0])
        in_range = (layers >= scope.layer_lo) & (layers <= scope.layer_hi)
        return bits[v.classes] & in_range[:, None]

    def authorize(self, caller: Caller, ref: str) -> None:
        """Refuse (403, audited) unless ``caller`` may run version ``ref``."""
        why = self.covers(caller, ref)
        if why is not None:
            exc = OutOfScope(why)
            v = self.versions.get(ref)
            self.authority.deny(
                exc, perm=caller.permission, space=v.scoped[0] if v else None, right=INFER
            )
            raise Forbidden(f"portal refused (out-of-scope): {why}")

    def visible(self, caller: Caller) -> list[str]:
        """The served versions ``caller`` may run."""
        return [ref for ref in self.versions if self.covers(caller, ref) is None]


def _bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
