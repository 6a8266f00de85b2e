"""The ``czyx`` command line: discovery of subcommands and one-line errors."""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
from collections.abc import Sequence

import czyx
from czyx.cli import commands
from czyx.errors import CzyxError


def build_parser() -> argparse.ArgumentParser:
    """The ``czyx`` parser, with one subcommand per module in :mod:`czyx.cli.commands`."""
    parser = argparse.ArgumentParser(
        prog="czyx",
        description="Coordinate-addressed storage for model weights, with an MoE engine.",
    )
    parser.add_argument("--version", action="version", version=f"czyx {czyx.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"czyx.cli.commands.{info.name}")
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("czyx: interrupted", file=sys.stderr)
        return 130
    except (CzyxError, ValueError, OSError) as exc:
        if os.environ.get("CZYX_DEBUG"):
            raise
        print(f"czyx: error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # a bug: still one line, with the way to see more
        if os.environ.get("CZYX_DEBUG"):
            raise
        print(
            f"czyx: internal error: {type(exc).__name__}: {exc} (set CZYX_DEBUG=1 for a traceback)",
            file=sys.stderr,
        )
        return 70


if __name__ == "__main__":
    raise SystemExit(main())
