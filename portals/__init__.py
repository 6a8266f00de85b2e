"""Portals: capabilities that grant a tenant access to a space (grant, attenuate,
verify, revoke, audit). A portal never reads weights itself.

Public entry points:

- :func:`open_space` ``(store, token, space=None) -> SpaceView``: the only way
  to read a space through a portal;
- :func:`open_model` ``(store, token, "name@version") -> SpaceView``: the same
  for a model version (all its spaces covered, ``infer`` right), for consumers;
- :class:`PortalAuthority` (``portals.authority.authority(store)``; not re-exported
  here, since the name is also the submodule's): grant, verify, revoke, list;
- :func:`attenuate`: offline narrowing of a token (no store, no secret).

Names are imported lazily (PEP 562) so that the CLI's ``--help`` does not
pay for numpy.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Grant": "portals.authority",
    "PortalAuthority": "portals.authority",
    "grant": "portals.authority",
    "open_space": "portals.authority",
    "root_token": "portals.authority",
    "model_spaces": "portals.model",
    "open_model": "portals.model",
    "GRANT": "portals.caveats",
    "INFER": "portals.caveats",
    "READ": "portals.caveats",
    "ClassRange": "portals.caveats",
    "ClassSet": "portals.caveats",
    "Expires": "portals.caveats",
    "LayerRange": "portals.caveats",
    "Rights": "portals.caveats",
    "Spaces": "portals.caveats",
    "Tenant": "portals.caveats",
    "parse_classes": "portals.caveats",
    "parse_layers": "portals.caveats",
    "parse_rights": "portals.caveats",
    "PortalDenied": "portals.errors",
    "PortalError": "portals.errors",
    "Permission": "portals.permission",
    "Scope": "portals.permission",
    "Token": "portals.token",
    "SpaceView": "portals.view",
}


def attenuate(token: str, caveats: list, *, strict: bool = True) -> str:
    """Offline attenuation of a printable token; see :func:`portals.chain.attenuate`."""
    from portals.chain import attenuate as _attenuate
    from portals.token import Token

    return _attenuate(Token.from_text(token), caveats, strict=strict).to_text()


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'portals' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = sorted([*_EXPORTS, "attenuate"])
