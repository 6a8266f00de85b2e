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
    # Also accepted before the command (`czyx --store X ls`); a command's own --store wins.
    parser.add_argument("--store", dest="global_store", metavar="DIR", help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"czyx.cli.commands.{info.name}")
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code.

    Ctrl-C at any point (also while the command's modules import) ends with one
    line and exit 130; a closed stdout (``czyx audit | head -1``) ends quietly.
    """
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("czyx: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _quiet_stdout()
        return 141  # 128 + SIGPIPE, as a process killed by the signal reports


def _quiet_stdout() -> None:
    # Python flushes stdout at exit; point it at /dev/null so that flush cannot
    # raise (and print) BrokenPipeError a second time.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


#: Tags a "not found" error lists at most (the rest counted).
_TAGS_SHOWN = 12
#: Commands whose NAME@VERSION is looked up at another store or server.
_REMOTE_REF_COMMANDS = frozenset({"pull", "sync"})


def _tags_hint(exc: BaseException, args: argparse.Namespace) -> str:
    """For a tag the local store does not have: the tags it has (this process may read
    the whole store, so listing them shows nothing a portal hides); "" otherwise."""
    from czyx.store.errors import TagNotFoundError

    if not isinstance(exc, TagNotFoundError) or not hasattr(args, "store"):
        return ""
    if getattr(args, "command", None) in _REMOTE_REF_COMMANDS:
        return ""  # their tag names a version at the source, not in this store
    from czyx.cli.commands._storearg import store_dir
    from czyx.store import Store

    where = store_dir(args)
    try:
        with Store.open(where, create=False) as st:
            tags = sorted(st.tags())
    except Exception:  # no store there, or unreadable: the error alone says enough
        return ""
    if not tags:
        return f" (the store {where} has no tags)"
    more = len(tags) - _TAGS_SHOWN
    shown = ", ".join(tags[:_TAGS_SHOWN]) + (f" and {more} more" if more > 0 else "")
    return f" (tags in {where}: {shown})"


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # argparse binds an optional positional (run's PROMPT) at its first chance,
        # so `czyx run M --store S "text"` leaves the text over: take it here.
        if len(extra) == 1 and getattr(args, "prompt_arg", "") is None and extra[0] != "--":
            args.prompt_arg = extra[0]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    if args.global_store and getattr(args, "store", None) is None:
        args.store = args.global_store
    try:
        return int(args.func(args) or 0)
    except (KeyboardInterrupt, BrokenPipeError):
        raise
    except (CzyxError, ValueError, OSError) as exc:
        if os.environ.get("CZYX_DEBUG"):
            raise
        print(f"czyx: error: {exc}{_tags_hint(exc, args)}", file=sys.stderr)
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
