"""The portal authority of one store: grant, verify, open, revoke, list.

:class:`PortalAuthority` binds a :class:`store.Store` to the keys derived from
its secret. It records every portal it issues as a descriptor in the store's
0xFE space (``put_portal_descriptor``) and appends every grant, open, denial
and revocation to the store's audit log, with time (added by the store),
tenant and reason; never a token, a signature or the secret.

Verification is the HMAC chain (no lookup for the caveats) plus one
descriptor read per registered id in the token's lineage, which is how
expiry-independent revocation works: revoking a portal marks it and every
descendant, and a token whose lineage holds a revoked id is refused, so even
offline attenuations (which share their parent's id) die with their parent.

The owner's root portal is deterministic per secret (its id is derived from
the secret), so it needs no file of its own; its descriptor is written the
first time an authority is created for the store.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from czyx.portals.caveats import GRANT, INFER, READ, Caveat, Rights, Tenant, check_tenant, describe
from czyx.portals.chain import ChainKeys, extend_registered, mint, verify_signature
from czyx.portals.errors import (
    InvalidSignature,
    OutOfScope,
    PortalDenied,
    PortalError,
    PortalExpired,
    PortalRevoked,
    RootRevocationError,
    UnknownPortal,
    WideningError,
)
from czyx.portals.permission import Permission
from czyx.portals.secret import load_or_create_secret
from czyx.portals.token import Token
from czyx.portals.view import SpaceView
from czyx.space import Selector
from czyx.store.interfaces import StoreInterface

OWNER = "owner"
# Rights a grant gets when it names none: never "grant" (re-delegation is opt-in).
DEFAULT_GRANT_RIGHTS = frozenset({READ, INFER})


@dataclass(frozen=True)
class Grant:
    """A freshly issued portal: its id and its printable token."""

    portal_id: bytes
    token: str = field(repr=False)

    @property
    def id_hex(self) -> str:
        """The portal id in hex (what ``czyx revoke`` and the audit log name)."""
        return self.portal_id.hex()


def _now_default() -> float:
    return time.time()


class PortalAuthority:
    """Issues and checks the portals of one store.

    Parameters
    ----------
    store:
        An open :class:`store.Store` (anything with the STORE_API portal,
        audit and record methods).
    clock:
        Seconds since the epoch; injectable for tests of expiry.
    """

    def __init__(self, store: StoreInterface, *, clock: Callable[[], float] = _now_default) -> None:
        self.store = store
        self._clock = clock
        self._keys = ChainKeys.from_secret(load_or_create_secret(store.path).reveal())
        self._ensure_root()

    # --- identity ------------------------------------------------------------------

    @property
    def root_id(self) -> bytes:
        """The owner's root portal id."""
        return self._keys.owner_id

    def root_token(self) -> str:
        """The owner's root portal: every space, every right, no expiry."""
        return mint(self._keys, self._keys.owner_id).to_text()

    def _ensure_root(self) -> None:
        # A read-only store cannot record it; its root token then fails closed
        # (unknown portal) until the store is opened writable once.
        if getattr(self.store, "readonly", False):
            return
        if self.store.get_portal_descriptor(self._keys.owner_id) is None:
            self.store.put_portal_descriptor(
                self._keys.owner_id,
                {
                    "id": self._keys.owner_id.hex(),
                    "kind": "root",
                    "parent": None,
                    "lineage": [self._keys.owner_id.hex()],
                    "issuer": "store",
                    "tenant": OWNER,
                    "caveats": [],
                    "created": self._clock(),
                    "expires": None,
                    "revoked": None,
                },
            )
            self._audit("portal.grant", self._keys.owner_id, OWNER, reason="root portal created")

    # --- audit -----------------------------------------------------------------------

    def _audit(self, event: str, portal_id: bytes | None, tenant: str | None, **fields) -> None:
        if getattr(self.store, "readonly", False):
            # Fail closed: an open or a refusal that cannot be audited does not happen.
            raise PortalError(
                f"{event}: the store is open read-only and portal events must be audited; "
                "open it writable"
            )
        fields = {k: v for k, v in fields.items() if v is not None}
        self.store.audit(
            event, portal=portal_id.hex() if portal_id else None, tenant=tenant, **fields
        )

    def deny(
        self,
        exc: PortalDenied,
        *,
        perm: Permission | None,
        space: bytes | None = None,
        right: str | None = None,
        **fields,
    ) -> None:
        """Record a refusal in the audit log (the caller then raises ``exc``)."""
        tenant = (
            None if perm is None else (perm.tenant or (OWNER if perm.tenants is None else None))
        )
        self._audit(
            "portal.deny",
            None if perm is None else perm.portal_id,
            tenant,
            reason=exc.reason,
            detail=str(exc),
            space=space.hex() if space else None,
            right=right,
            **fields,
        )

    # --- verification ----------------------------------------------------------------

    def _check_lineage(self, perm: Permission, tok: Token) -> None:
        parent: str | None = None
        encoded = tok.encoded_caveats()
        for i, pid in enumerate(perm.ids):
            d = self.store.get_portal_descriptor(pid)
            if d is None:
                raise UnknownPortal(f"portal {pid.hex()} is not registered in this store")
            if d.get("revoked"):
                what = "portal" if i == len(perm.ids) - 1 else "parent portal"
                raise PortalRevoked(f"{what} {pid.hex()} has been revoked")
            expected_kind = "root" if i == 0 else "grant"
            if d.get("kind") != expected_kind or d.get("parent") != parent:
                raise UnknownPortal(f"portal {pid.hex()}: lineage does not match its descriptor")
            if i > 0:
                _check_bound(pid, d, encoded)
            parent = pid.hex()

    def verify(
        self,
        token: str,
        *,
        space: Selector | bytes | None = None,
        right: str = READ,
        tenant: str | None = None,
    ) -> Permission:
        """Check ``token`` for ``right`` (on ``space`` when given) and return its permission.

        Every failure is audited (``portal.deny``) and raised as a
        :class:`PortalDenied` subclass; nothing else is returned.

        Raises
        ------
        TokenFormatError, InvalidSignature, ForeignPortal, UnknownPortal,
        PortalExpired, PortalRevoked, OutOfScope
        """
        perm: Permission | None = None
        sel = space.raw if isinstance(space, Selector) else space
        try:
            tok = Token.from_text(token)
            verify_signature(self._keys, tok)
            perm = tok.permission()  # only trusted (and logged) once the chain verified
            now = self._clock()
            if perm.expires is not None and now >= perm.expires:
                raise PortalExpired(
                    f"portal {perm.portal_id.hex()} expired at {_when(perm.expires)}"
                )
            self._check_lineage(perm, tok)
            _check_open(perm, sel, right, tenant)
        except PortalDenied as exc:
            self.deny(exc, perm=perm, space=sel, right=right)
            raise
        return perm

    # --- grant -----------------------------------------------------------------------

    def grant(
        self,
        caveats: Sequence[Caveat],
        *,
        tenant: str,
        parent: str | None = None,
        note: str = "",
    ) -> Grant:
        """Issue a registered portal for ``tenant`` narrowed by ``caveats``.

        Parameters
        ----------
        caveats:
            Restrictions (spaces, rights, classes, layers, expiry); they must
            not ask for more than the parent holds. Without a ``Rights``
            caveat the portal gets ``read`` and ``infer`` (not ``grant``).
        tenant:
            The tenant the portal is bound to.
        parent:
            The issuing token (needs the ``grant`` right); the owner's root
            portal when ``None``.
        note:
            Free text stored in the descriptor.

        Raises
        ------
        PortalDenied
            The parent is invalid or lacks ``grant``.
        WideningError
            A caveat asks for more than the parent holds.
        """
        check_tenant(tenant)
        parent_text = self.root_token() if parent is None else parent
        pperm = self.verify(parent_text, right=GRANT)
        caveats = list(caveats)
        if not any(isinstance(c, Rights) for c in caveats):
            # Fail closed: re-granting is never implied; ask for "grant" by name.
            caveats.append(Rights(DEFAULT_GRANT_RIGHTS & pperm.rights))
        new_id = secrets.token_bytes(16)
        try:
            tok = extend_registered(
                Token.from_text(parent_text), new_id, [Tenant(tenant), *caveats]
            )
        except WideningError as exc:
            self.deny(exc, perm=pperm, right=GRANT, requested_tenant=tenant)
            raise
        perm = tok.permission()
        created = self._clock()
        self.store.put_portal_descriptor(
            new_id,
            {
                "id": new_id.hex(),
                "kind": "grant",
                "parent": pperm.portal_id.hex(),
                "lineage": [i.hex() for i in perm.ids],
                "issuer": pperm.tenant or OWNER,
                "tenant": tenant,
                "caveats": [describe(c) for c in tok.caveats if c.TAG != 0x01],
                # The id is bound to the exact caveats it was issued with (see
                # _check_bound): a holder cannot append it by hand to a wider token.
                "bound": bind_digest(tok.encoded_caveats()),
                "bound_n": len(tok.caveats),
                "created": created,
                "expires": perm.expires,
                "revoked": None,
                "note": note,
            },
        )
        self._audit(
            "portal.grant",
            new_id,
            tenant,
            parent=pperm.portal_id.hex(),
            issuer=pperm.tenant or OWNER,
            reason=note or None,
        )
        return Grant(new_id, tok.to_text())

    # --- revocation --------------------------------------------------------------------

    def revoke(self, portal_id: bytes | str, *, reason: str = "") -> list[bytes]:
        """Revoke a portal and every portal attenuated from it; returns the ids marked.

        Raises
        ------
        UnknownPortal
            No such portal (an id prefix must be unique).
        RootRevocationError
            ``portal_id`` is the owner's root portal.
        """
        pid = self.resolve_id(portal_id)
        if pid == self._keys.owner_id:
            raise RootRevocationError(
                "the owner's root portal cannot be revoked; rotate the store secret instead"
            )
        children: dict[str, list[str]] = {}
        descs: dict[str, dict] = {}
        for raw, d in self.store.portal_descriptors():
            descs[raw.hex()] = d
            if d.get("parent"):
                children.setdefault(d["parent"], []).append(raw.hex())
        now = self._clock()
        marked: list[bytes] = []
        todo = [pid.hex()]
        while todo:
            h = todo.pop()
            todo.extend(children.get(h, ()))
            d = descs[h]
            if d.get("revoked"):
                continue
            d = dict(d)
            d["revoked"] = {"at": now, "reason": reason, "by": pid.hex()}
            self.store.put_portal_descriptor(bytes.fromhex(h), d)
            marked.append(bytes.fromhex(h))
            self._audit(
                "portal.revoke",
                bytes.fromhex(h),
                d.get("tenant"),
                reason=reason or None,
                cascade_from=None if h == pid.hex() else pid.hex(),
            )
        return marked

    def resolve_id(self, portal_id: bytes | str) -> bytes:
        """A full portal id from bytes, full hex or a unique hex prefix (>= 6 chars)."""
        if isinstance(portal_id, bytes):
            if self.store.get_portal_descriptor(portal_id) is None:
                raise UnknownPortal(f"no portal {portal_id.hex()}")
            return portal_id
        text = portal_id.strip().lower()
        if len(text) < 6 or any(c not in "0123456789abcdef" for c in text):
            raise UnknownPortal(f"portal id {portal_id!r}: give at least 6 hex digits")
        hits = [raw for raw, _ in self.store.portal_descriptors() if raw.hex().startswith(text)]
        if len(hits) != 1:
            raise UnknownPortal(
                f"portal id {text!r}: {'no' if not hits else 'more than one'} portal matches"
            )
        return hits[0]

    # --- listing -----------------------------------------------------------------------

    def descriptors(self) -> list[dict]:
        """Every portal descriptor, oldest first, with a computed ``status``."""
        now = self._clock()
        out = []
        for _, d in self.store.portal_descriptors():
            d = dict(d)
            if d.get("revoked"):
                d["status"] = "revoked"
            elif d.get("expires") is not None and now >= d["expires"]:
                d["status"] = "expired"
            else:
                d["status"] = "active"
            out.append(d)
        out.sort(key=lambda d: (d.get("created") or 0, d.get("id", "")))
        return out

    # --- opening -----------------------------------------------------------------------

    def open_space(
        self,
        token: str,
        space: Selector | bytes | str | None = None,
        *,
        right: str = READ,
        tenant: str | None = None,
        requires: Sequence[Selector] = (),
        narrow_by: Sequence[Selector] = (),
    ) -> SpaceView:
        """Verify ``token`` and open one of its spaces as a read-only :class:`SpaceView`.

        Parameters
        ----------
        token:
            The portal token.
        space:
            A :class:`Selector`, 32 raw bytes, a tag ``NAME@VERSION`` or 64 hex
            digits; may be omitted when the portal names exactly one space.
        right:
            ``"read"`` (records and extents) or ``"infer"`` (the store's model
            consumer opens with this).
        tenant:
            The tenant the caller acts for, checked against the portal's.
        requires:
            Further spaces the portal must also cover for ``right`` (a model
            version's trunk and bases), else the open is refused.
        narrow_by:
            Spaces whose class/layer scopes are intersected into the view's
            (a version's base expert spaces), so one O(1) check is valid for
            all of them.

        Raises
        ------
        PortalDenied
            Any refusal (audited).
        """
        sel = self.resolve_space(token, space)
        perm = self.verify(token, space=sel, right=right, tenant=tenant)
        scope = perm.scope_for(sel.raw)
        for other in (*requires, *narrow_by):
            try:
                _check_open(perm, other.raw, right, tenant)
            except PortalDenied as exc:
                self.deny(exc, perm=perm, space=other.raw, right=right, opening=sel.hex())
                raise
        for other in narrow_by:
            scope = scope.narrow(perm.scope_for(other.raw))
        if scope.empty:
            exc = OutOfScope("portal's class/layer caveats leave nothing of this model")
            self.deny(exc, perm=perm, space=sel.raw, right=right)
            raise exc
        who = tenant or perm.tenant or OWNER
        manifest = self.store.manifest(sel)  # SpaceNotFoundError for an unknown space
        view = SpaceView(self, sel, perm, scope, right=right, tenant=who, manifest=manifest)
        self._audit("portal.open", perm.portal_id, who, space=sel.hex(), right=right)
        return view

    def resolve_space(self, token: str, space: Selector | bytes | str | None) -> Selector:
        """The selector ``space`` names (tag, hex, bytes), or the portal's only space."""
        if isinstance(space, Selector):
            return space
        if isinstance(space, bytes):
            return Selector(space)
        if isinstance(space, str):
            if "@" in space:
                return self.store.resolve_tag(space)
            if not re.fullmatch(r"[0-9a-fA-F]{64}", space):
                raise PortalError(
                    f"{space!r} is neither NAME@VERSION (a tag) nor a 64-hex space selector"
                )
            return Selector.from_hex(space)
        # No space named: the portal must name exactly one. Parse only; verify
        # (with its audit) happens next against the chosen space.
        try:
            spaces = Token.from_text(token).permission().spaces
        except PortalDenied as exc:
            self.deny(exc, perm=None)
            raise
        if spaces is None or len(spaces) != 1:
            raise PortalError(
                "open_space: the portal names "
                f"{'every' if spaces is None else len(spaces)} space(s); say which one to open"
            )
        return Selector(next(iter(spaces)))


def _when(t: float) -> str:
    """A Unix time as ``YYYY-MM-DD HH:MM:SSZ`` (UTC) for messages."""
    import datetime as dt

    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def bind_digest(encoded: Sequence[bytes]) -> str:
    """SHA-256 (hex) over length-prefixed encoded caveats: what a portal id is bound to."""
    h = hashlib.sha256()
    for c in encoded:
        h.update(len(c).to_bytes(4, "big"))
        h.update(c)
    return h.hexdigest()


def _check_bound(pid: bytes, d: dict, encoded: Sequence[bytes]) -> None:
    """The token's caveats up to the end of portal ``pid``'s own must be exactly those
    it was issued with.

    Why: a chain can be extended by anyone holding it, so without this a holder of a
    wider portal could append a child's :class:`PortalId` by hand and be audited
    (and revoked, or not) as that child. The descriptor records a digest of the
    issued token's caveats (parent's, the id, the grant's own); a token naming the
    id must begin with exactly those.
    """
    n, want = d.get("bound_n"), d.get("bound")
    if not isinstance(n, int) or not isinstance(want, str):
        raise UnknownPortal(
            f"portal {pid.hex()} was issued before portal ids were bound to their caveats; "
            "grant it again"
        )
    if len(encoded) < n or not hmac.compare_digest(bind_digest(encoded[:n]), want):
        raise InvalidSignature(
            f"portal id {pid.hex()} is not followed by the caveats it was issued with "
            "(appended by hand?)"
        )


def _check_open(perm: Permission, space: bytes | None, right: str, tenant: str | None) -> None:
    if right not in perm.rights:
        raise OutOfScope(f"portal lacks the {right!r} right (has {sorted(perm.rights)})")
    if perm.tenants is not None:
        if not perm.tenants:
            raise OutOfScope("portal is bound to conflicting tenants and permits nobody")
        if tenant is not None and tenant not in perm.tenants:
            raise OutOfScope(f"portal is not for tenant {tenant!r}")
    if space is not None:
        if perm.spaces is not None and space not in perm.spaces:
            raise OutOfScope(f"portal does not cover space {space.hex()[:16]}..")
        if perm.scope_for(space).empty:
            raise OutOfScope(
                f"portal's class/layer caveats leave nothing of space {space.hex()[:16]}.."
            )


# --- module-level conveniences (one authority per open store) ---------------------------

_AUTHORITIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def open_authority(store: StoreInterface) -> PortalAuthority:
    """The (cached) :class:`PortalAuthority` of ``store``.

    Named ``open_authority``, not ``authority``: the module is ``portals.authority``,
    and a function of the same name made ``from czyx.portals import authority``
    ambiguous (the submodule or the function, depending on import order).
    """
    try:
        auth = _AUTHORITIES.get(store)
    except TypeError:  # not weak-referenceable: no caching
        return PortalAuthority(store)
    if auth is None:
        auth = PortalAuthority(store)
        _AUTHORITIES[store] = auth
    return auth


def authority(store: StoreInterface) -> PortalAuthority:
    """Deprecated spelling of :func:`open_authority` (warns)."""
    warnings.warn(
        "czyx.portals.authority.authority() is deprecated: use czyx.portals.open_authority()",
        DeprecationWarning,
        stacklevel=2,
    )
    return open_authority(store)


def open_space(
    store: StoreInterface,
    token: str,
    space: Selector | bytes | str | None = None,
    *,
    right: str = READ,
    tenant: str | None = None,
) -> SpaceView:
    """Open ``space`` of ``store`` through ``token``; see :meth:`PortalAuthority.open_space`."""
    return open_authority(store).open_space(token, space, right=right, tenant=tenant)


def root_token(store: StoreInterface) -> str:
    """The owner's root portal of ``store`` (created with the store's secret)."""
    return open_authority(store).root_token()


def grant(
    store: StoreInterface, caveats: Iterable[Caveat], *, tenant: str, parent: str | None = None
) -> Grant:
    """Issue a portal; see :meth:`PortalAuthority.grant`."""
    return open_authority(store).grant(list(caveats), tenant=tenant, parent=parent)
