"""Portals: capabilities that grant a tenant access to a space (grant, attenuate,
verify, revoke, audit). A portal never reads weights itself.

Public entry points:

- :func:`open_space` ``(store, token, space=None) -> SpaceView``: the only way
  to read a space through a portal;
- :func:`open_model` ``(store, token, "name@version") -> SpaceView``: the same
  for a model version (all its spaces covered, ``infer`` right), for consumers;
- :func:`open_authority` ``(store) -> PortalAuthority``: grant, verify, revoke, list;
- :func:`attenuate`: offline narrowing of a token (no store, no secret).

Names are imported lazily (PEP 562) so that the CLI's ``--help`` does not
pay for numpy.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Grant": "czyx.portals.authority",
    "PortalAuthority": "czyx.portals.authority",
    "open_authority": "czyx.portals.authority",
    "grant": "czyx.portals.authority",
    "open_space": "czyx.portals.authority",
    "root_token": "czyx.portals.authority",
    "model_spaces": "czyx.portals.model",
    "open_model": "czyx.portals.model",
    "remove_version": "czyx.portals.model",
    "Removal": "czyx.portals.model",
    "open_consumer": "czyx.portals.model",
    "GRANT": "czyx.portals.caveats",
    "INFER": "czyx.portals.caveats",
    "READ": "czyx.portals.caveats",
    "ClassRange": "czyx.portals.caveats",
    "ClassSet": "czyx.portals.caveats",
    "Expires": "czyx.portals.caveats",
    "LayerRange": "czyx.portals.caveats",
    "Rights": "czyx.portals.caveats",
    "Spaces": "czyx.portals.caveats",
    "Tenant": "czyx.portals.caveats",
    "parse_classes": "czyx.portals.caveats",
    "parse_layers": "czyx.portals.caveats",
    "parse_rights": "czyx.portals.caveats",
    "PortalDenied": "czyx.portals.errors",
    "PortalError": "czyx.portals.errors",
    "Permission": "czyx.portals.permission",
    "Scope": "czyx.portals.permission",
    "Token": "czyx.portals.token",
    "SpaceView": "czyx.portals.view",
}


def attenuate(token: str, caveats: list, *, strict: bool = True) -> str:
    """Offline attenuation of a printable token; see :func:`portals.chain.attenuate`."""
    from czyx.portals.chain import attenuate as _attenuate
    from czyx.portals.token import Token

    return _attenuate(Token.from_text(token), caveats, strict=strict).to_text()


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'czyx.portals' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = sorted([*_EXPORTS, "attenuate"])
