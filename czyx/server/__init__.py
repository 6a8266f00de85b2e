"""The OpenAI-compatible server: portals as bearer tokens, continuous batching.

Public API: :func:`create_app` ``(store_dir, refs, options, extra_routes=...)``
returns a Starlette app (serve it with uvicorn on 127.0.0.1), configured by
:class:`ServeOptions`; ``czyx serve`` is a thin layer over it. Names load
lazily so that importing the package costs nothing until used.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "create_app": "czyx.server.app",
    "ServeOptions": "czyx.server.app",
    "ServerError": "czyx.server.app",
    "BatchOptions": "czyx.inference.batch",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'czyx.server' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = sorted(_EXPORTS)
