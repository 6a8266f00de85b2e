"""``czyx revoke ID``: revoke a portal and everything attenuated from it."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``revoke`` subcommand."""
    from czyx.cli.commands._storearg import add_store_arg

    p = subparsers.add_parser(
        "revoke",
        help="revoke a portal and every portal derived from it",
        description="Revoke portal ID (full hex or a unique prefix of at least 6 digits).",
    )
    p.add_argument("id", help="portal id (hex, or a unique prefix)")
    p.add_argument("--reason", default="", help="kept in the descriptor and the audit log")
    add_store_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Revoke a portal (and every portal attenuated from it)."""
    from czyx.cli.commands._portalargs import open_store
    from czyx.portals.authority import PortalAuthority

    with open_store(args) as store:
        marked = PortalAuthority(store).revoke(args.id, reason=args.reason)
    if not marked:
        print(f"portal {args.id} was already revoked")
    for pid in marked:
        print(f"revoked {pid.hex()}")
    return 0
