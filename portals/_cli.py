"""Helpers shared by the portal CLI commands (store location, expiry parsing,
model-space resolution). Kept out of czyx/commands so each command module
stays a thin argparse layer."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
from pathlib import Path
from typing import Any

from czyx.space import SELECTOR_SIZE, Selector
from portals.errors import CaveatError

DEFAULT_STORE = "czyx-store"
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def add_store_arg(p: argparse.ArgumentParser) -> None:
    """``--store DIR`` (default ``$CZYX_STORE`` or ``./czyx-store``)."""
    p.add_argument(
        "--store",
        default=None,
        metavar="DIR",
        help="store directory (default: $CZYX_STORE or ./czyx-store)",
    )


def store_dir(args: argparse.Namespace) -> Path:
    return Path(args.store or os.environ.get("CZYX_STORE") or DEFAULT_STORE)


def open_store(args: argparse.Namespace, *, create: bool = False) -> Any:
    """Open the store named by ``args`` (an existing one unless ``create``)."""
    from store import Store

    return Store.open(store_dir(args), create=create)


def parse_expiry(text: str, now: float) -> int:
    """Unix seconds from ``24h``/``30m``/``7d``/``90s``/``2w``, an ISO 8601 time, or ``@UNIX``."""
    t = text.strip()
    m = re.fullmatch(r"(\d+)\s*([smhdw])", t)
    if m:
        return int(now) + int(m.group(1)) * _UNITS[m.group(2)]
    if t.startswith("@") and t[1:].isdigit():
        return int(t[1:])
    try:
        when = dt.datetime.fromisoformat(t.replace("Z", "+00:00"))
    except ValueError:
        raise CaveatError(
            f"expires: {text!r} is not a duration (24h, 30m, 7d), an ISO time or @UNIX"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return int(when.timestamp())


def resolve_space(store: Any, name: str) -> Selector:
    """A space from a tag ``NAME@VERSION`` or 64 hex digits."""
    if "@" in name:
        return store.resolve_tag(name)
    return Selector.from_hex(name)


def _as_selector(v: Any) -> Selector | None:
    raw = bytes.fromhex(v) if isinstance(v, str) and len(v) == 2 * SELECTOR_SIZE else v
    if isinstance(raw, bytes) and len(raw) == SELECTOR_SIZE:
        return Selector(raw)
    return None


def model_spaces(store: Any, sel: Selector) -> tuple[list[Selector], list[Selector]]:
    """The spaces a grant on ``sel`` must name: ``(scoped, whole)``.

    ``scoped`` is ``sel`` and, for an adapter or derived version, every base
    it names (manifest ``base``, followed to the full model): the expert
    spaces, where class and layer caveats apply. ``whole`` are the linked
    spaces read whole (manifest ``trunk`` of each version in the chain, and
    any ``spaces`` list or role map), where they do not: a tenant limited to
    some experts still needs the trunk to run the model.
    """
    scoped: list[Selector] = []
    whole: list[Selector] = []
    cur: Selector | None = sel
    while cur is not None and cur not in scoped and len(scoped) < 64:
        scoped.append(cur)
        manifest = store.manifest(cur)
        extra = manifest.get("spaces")
        values = list(extra.values()) if isinstance(extra, dict) else list(extra or [])
        for v in (manifest.get("trunk"), manifest.get("trunk_space"), *values):
            s = _as_selector(v)
            if s is not None and s not in whole:
                whole.append(s)
        cur = _as_selector(manifest.get("base"))
    return scoped, [s for s in whole if s not in scoped]


def fmt_time(t: float | None) -> str:
    if t is None:
        return "-"
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")
