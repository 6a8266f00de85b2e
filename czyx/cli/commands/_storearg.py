"""Shared ``--store DIR`` option of the model commands (``$CZYX_STORE`` or ``./czyx-store``)."""

from __future__ import annotations

import argparse
import os

DEFAULT_STORE = "czyx-store"


def add_store_arg(parser: argparse.ArgumentParser) -> None:
    """Add ``--store DIR`` to ``parser``."""
    parser.add_argument(
        "--store",
        default=None,
        metavar="DIR",
        help=f"store directory (default: $CZYX_STORE or ./{DEFAULT_STORE})",
    )


def store_dir(args: argparse.Namespace) -> str:
    """The store directory the user asked for."""
    return args.store or os.environ.get("CZYX_STORE") or DEFAULT_STORE
