"""Portals: capabilities that grant a tenant access to a space (grant, attenuate,
verify, revoke, audit). A portal never reads weights itself.

Public entry points:

- :func:`open_space` ``(store, token, space=None) -> SpaceView``: the only way
  to read a space through a portal;
- :class:`PortalAuthority` (``authority(store)``): grant, verify, revoke, list;
- :func:`attenuate`: offline narrowing of a token (no store, no secret).
"""

from __future__ import annotations

from portals.authority import Grant, PortalAuthority, authority, grant, open_space, root_token
from portals.caveats import (
    GRANT,
    INFER,
    READ,
    ClassRange,
    ClassSet,
    Expires,
    LayerRange,
    Rights,
    Spaces,
    Tenant,
    parse_classes,
    parse_layers,
    parse_rights,
)
from portals.errors import PortalDenied, PortalError
from portals.permission import Permission, Scope
from portals.token import Token
from portals.view import SpaceView


def attenuate(token: str, caveats: list, *, strict: bool = True) -> str:
    """Offline attenuation of a printable token; see :func:`portals.chain.attenuate`."""
    from portals.chain import attenuate as _attenuate

    return _attenuate(Token.from_text(token), caveats, strict=strict).to_text()


__all__ = [
    "GRANT",
    "INFER",
    "READ",
    "ClassRange",
    "ClassSet",
    "Expires",
    "Grant",
    "LayerRange",
    "Permission",
    "PortalAuthority",
    "PortalDenied",
    "PortalError",
    "Rights",
    "Scope",
    "SpaceView",
    "Spaces",
    "Tenant",
    "Token",
    "attenuate",
    "authority",
    "grant",
    "open_space",
    "parse_classes",
    "parse_layers",
    "parse_rights",
    "root_token",
]
