"""The permission a token grants: the intersection of its caveats.

:class:`Permission` is a pure value computed from a verified token, with no
I/O. It answers "may this (space, right, tenant, time, class, layer) access
happen?" and "is this permission contained in that one?". A
:class:`Scope` is the class/layer part for one space: a 256-bit class mask
and an inclusive layer range, which a :class:`~portals.view.SpaceView`
turns into an O(1) check.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from czyx.portals.caveats import (
    ALL_RIGHTS,
    FULL_CLASS_MASK,
    MAX_LAYER,
    Caveat,
    ClassRange,
    ClassSet,
    Expires,
    LayerRange,
    PortalId,
    Rights,
    Spaces,
    Tenant,
)
from czyx.portals.errors import CaveatError


@dataclass(frozen=True)
class Scope:
    """Allowed classes (bit i = class i) and inclusive layer range inside one space."""

    classes: int = FULL_CLASS_MASK
    layer_lo: int = 0
    layer_hi: int = MAX_LAYER

    @property
    def empty(self) -> bool:
        """True when no (class, layer) pair is allowed."""
        return self.classes == 0 or self.layer_lo > self.layer_hi

    def narrow(self, other: Scope) -> Scope:
        """The intersection of two scopes."""
        return Scope(
            self.classes & other.classes,
            max(self.layer_lo, other.layer_lo),
            min(self.layer_hi, other.layer_hi),
        )

    def allows(self, cls: int, layer: int) -> bool:
        """Whether class ``cls`` at layer ``layer`` is inside the scope."""
        return bool(self.classes >> cls & 1) and self.layer_lo <= layer <= self.layer_hi

    def is_subset_of(self, other: Scope) -> bool:
        """Every (class, layer) allowed here is allowed by ``other``."""
        if self.empty:
            return True
        return (
            self.classes & ~other.classes == 0
            and other.layer_lo <= self.layer_lo
            and self.layer_hi <= other.layer_hi
        )


def _scope_of(cav: Caveat) -> Scope:
    if isinstance(cav, ClassRange | ClassSet):
        return Scope(classes=cav.mask)
    if not isinstance(cav, LayerRange):  # a new scope caveat must be handled here
        raise CaveatError(f"caveat {type(cav).__name__} has no scope")
    return Scope(layer_lo=cav.lo, layer_hi=cav.hi)


@dataclass(frozen=True)
class Permission:
    """What a verified token permits.

    Attributes
    ----------
    ids:
        The lineage of registered portal ids, root first; the last one is the
        portal this token *is* (offline attenuations share their parent's id).
    spaces:
        Selectors that may be opened, or ``None`` for any space (root).
    rights:
        Subset of ``{"read", "infer", "grant"}``.
    tenants:
        ``None`` for any tenant (the owner); otherwise the tenants it is bound
        to; an empty set (two conflicting tenant caveats) permits nobody.
    expires:
        Unix seconds before which it is valid, or ``None``.
    scope:
        Class/layer scope applying to every space.
    space_scopes:
        Extra per-space scopes, sorted by selector.
    """

    ids: tuple[bytes, ...]
    spaces: frozenset[bytes] | None = None
    rights: frozenset[str] = ALL_RIGHTS
    tenants: frozenset[str] | None = None
    expires: int | None = None
    scope: Scope = field(default_factory=Scope)
    space_scopes: tuple[tuple[bytes, Scope], ...] = ()

    @property
    def portal_id(self) -> bytes:
        """The id of the portal this token is (the last registered id in its lineage)."""
        return self.ids[-1]

    @property
    def tenant(self) -> str | None:
        """The single tenant the portal is bound to, or ``None`` (owner or conflicting)."""
        if self.tenants is not None and len(self.tenants) == 1:
            return next(iter(self.tenants))
        return None

    def with_caveat(self, cav: Caveat) -> Permission:
        """This permission narrowed by one more caveat."""
        if isinstance(cav, PortalId):
            return replace(self, ids=(*self.ids, cav.portal_id))
        if isinstance(cav, Spaces):
            spaces = cav.selectors if self.spaces is None else self.spaces & cav.selectors
            return replace(self, spaces=spaces)
        if isinstance(cav, Rights):
            return replace(self, rights=self.rights & cav.rights)
        if isinstance(cav, Tenant):
            names = frozenset((cav.name,))
            return replace(self, tenants=names if self.tenants is None else self.tenants & names)
        if isinstance(cav, Expires):
            at = cav.at if self.expires is None else min(self.expires, cav.at)
            return replace(self, expires=at)
        if isinstance(cav, ClassRange | ClassSet | LayerRange):
            sc = _scope_of(cav)
            if cav.space is None:
                return replace(self, scope=self.scope.narrow(sc))
            d = dict(self.space_scopes)
            d[cav.space] = d.get(cav.space, Scope()).narrow(sc)
            return replace(self, space_scopes=tuple(sorted(d.items())))
        raise TypeError(f"unknown caveat type {type(cav).__name__}")  # pragma: no cover

    @classmethod
    def from_caveats(cls, root_id: bytes, caveats: Iterable[Caveat]) -> Permission:
        """The permission of a token with header id ``root_id`` and ``caveats``."""
        perm = cls(ids=(root_id,))
        for cav in caveats:
            perm = perm.with_caveat(cav)
        return perm

    def scope_for(self, space: bytes) -> Scope:
        """The class/layer scope inside ``space`` (empty if the space is not named)."""
        if self.spaces is not None and space not in self.spaces:
            return Scope(0, 1, 0)
        for sel, sc in self.space_scopes:
            if sel == space:
                return self.scope.narrow(sc)
        return self.scope

    def allows_open(
        self, space: bytes, right: str, *, tenant: str | None = None, now: float = 0.0
    ) -> bool:
        """Whether ``space`` may be opened for ``right`` by ``tenant`` at ``now``."""
        if self.spaces is not None and space not in self.spaces:
            return False
        if right not in self.rights:
            return False
        if self.tenants is not None and (
            not self.tenants or (tenant and tenant not in self.tenants)
        ):
            return False
        return self.expires is None or now < self.expires

    def allows(
        self,
        space: bytes,
        right: str,
        cls: int,
        layer: int,
        *,
        tenant: str | None = None,
        now: float = 0.0,
    ) -> bool:
        """Whether one read of ``(cls, layer)`` in ``space`` is permitted."""
        return self.allows_open(space, right, tenant=tenant, now=now) and self.scope_for(
            space
        ).allows(cls, layer)

    def is_subset_of(self, other: Permission) -> bool:
        """Structural containment: everything this permits, ``other`` permits."""
        if self.spaces is None:
            if other.spaces is not None:
                return False
        elif other.spaces is not None and not self.spaces <= other.spaces:
            return False
        if not self.rights <= other.rights:
            return False
        if other.tenants is not None and (
            self.tenants is None or not self.tenants <= other.tenants
        ):
            return False
        if other.expires is not None and (self.expires is None or self.expires > other.expires):
            return False
        if self.spaces is not None:
            # Only the named spaces can be opened at all: compare their scopes.
            return all(self.scope_for(s).is_subset_of(other.scope_for(s)) for s in self.spaces)
        if not self.scope.is_subset_of(other.scope):
            return False
        named = {s for s, _ in self.space_scopes} | {s for s, _ in other.space_scopes}
        return all(self.scope_for(s).is_subset_of(other.scope_for(s)) for s in named)
