"""``czyx sync SOURCE DEST NAME@VERSION``: copy a version between two stores.

``SOURCE`` is a replication server (``czyx serve --replicate``, an
``http(s)://`` URL: then this is ``czyx pull``) or a store directory on this
machine (a mounted disk, another node's store reached by a shared path);
``DEST`` is a store directory. Both sources share ``czyx pull``'s code
(:func:`czyx.cli.commands.pull.sync`): the portal must grant ``read`` on the
version at the source, only the extents ``DEST`` lacks move, each is verified
by its checksum, an interrupted copy resumes, and the version is published
atomically. A URL as ``DEST`` (a push) is refused: the server has no
receiving endpoint, so run the copy on the destination's machine.
"""

from __future__ import annotations

import argparse
from typing import Any

from czyx.cli.commands.pull import add_copy_args, copy_and_report


def register(subparsers: Any) -> None:
    """Add the ``sync`` subcommand."""
    p = subparsers.add_parser(
        "sync", help="copy a model version from a server or store directory into a store"
    )
    p.add_argument("source", help="a server URL (http://...) or a store directory")
    p.add_argument("dest", help="the destination store directory")
    p.add_argument("ref", metavar="NAME@VERSION", help="tag (or 64-hex selector) at the source")
    add_copy_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Copy and print the one-line summary."""
    return copy_and_report(args, args.source, args.dest)
