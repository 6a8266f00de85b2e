"""Inference: the numpy MoE engine, the expert slot cache, prefetch, telemetry,
sessions and quantized kernels. It reaches bytes only through ``store``.

The public entry point is :class:`OpenedModel` (store, portal and consumer in one
handle) and :class:`czyx.inference.engine.Engine` over its ``consumer``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["OpenedModel"]


def __getattr__(name: str) -> Any:
    # Lazy, so that importing a submodule does not pull the engine's dependencies.
    if name == "OpenedModel":
        from czyx.inference.opened import OpenedModel

        return OpenedModel
    raise AttributeError(f"module 'czyx.inference' has no attribute {name!r}")
