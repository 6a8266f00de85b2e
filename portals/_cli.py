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

from czyx.space import Selector
from portals.errors import CaveatError
from portals.model import model_spaces  # re-exported for the grant command

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


__all__ = ["add_store_arg", "fmt_time", "model_spaces", "open_store", "parse_expiry"]


def fmt_time(t: float | None) -> str:
    if t is None:
        return "-"
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")
