"""Helpers shared by the portal CLI commands (store opening, expiry parsing,
model-space resolution). Kept apart from the command modules so each command module
stays a thin argparse layer; the ``--store`` option itself is the one every
command uses (:mod:`czyx.cli.commands._storearg`)."""

from __future__ import annotations

import argparse
import datetime as dt
import re
from typing import Any

from czyx.cli.commands._storearg import add_store_arg, store_dir
from czyx.portals.errors import CaveatError
from czyx.portals.model import model_spaces, resolve_space  # re-exported for the commands

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def open_store(args: argparse.Namespace, *, create: bool = False) -> Any:
    """Open the store named by ``args`` (an existing one unless ``create``)."""
    from czyx.store import Store

    return Store.open(store_dir(args), create=create)


def parse_expiry(text: str, now: float) -> int:
    """Unix seconds from ``24h``/``30m``/``7d``/``90s``/``2w``, an ISO 8601 time, or ``@UNIX``."""
    when = _parse_expiry(text, now)
    if when <= now:
        raise CaveatError(
            f"expires: {text!r} is not in the future ({fmt_time(when)}): the portal would "
            "be dead on arrival"
        )
    return when


def _parse_expiry(text: str, now: float) -> int:
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


def fmt_time(t: float | None) -> str:
    """``YYYY-MM-DD HH:MM:SSZ`` (UTC) for unix seconds ``t``; ``-`` for none."""
    if t is None:
        return "-"
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


__all__ = [
    "add_store_arg",
    "fmt_time",
    "model_spaces",
    "open_store",
    "parse_expiry",
    "resolve_space",
    "store_dir",
]
