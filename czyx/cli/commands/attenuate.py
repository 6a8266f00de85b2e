"""``czyx attenuate TOKEN ...``: narrow a portal offline (no store, no secret)."""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``attenuate`` subcommand."""
    p = subparsers.add_parser(
        "attenuate",
        help="narrow a portal token offline (add caveats; never widens)",
        description=(
            "Append caveats to TOKEN and print the narrower token. Needs no store: the "
            "HMAC chain lets any holder narrow a portal. Asking for more than the token "
            "holds is an error. The result is revoked with its parent."
        ),
    )
    p.add_argument("token", help="the portal token ('-' reads it from stdin)")
    p.add_argument("--classes", help="allowed classes, e.g. 0-15 or 1,5")
    p.add_argument("--layers", help="allowed layers, e.g. 0-1")
    p.add_argument("--expires", help="lifetime (1h, 30m), ISO time or @UNIX")
    p.add_argument("--rights", help="comma list of read, infer, grant")
    p.add_argument("--tenant", help="bind to this tenant")
    p.add_argument(
        "--space",
        action="append",
        default=[],
        metavar="HEX",
        help="restrict to this space selector (repeatable); also scopes --classes/--layers "
        "when given once",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the narrowed token."""
    import time

    from czyx.cli.commands._portalargs import parse_expiry
    from czyx.portals import attenuate
    from czyx.portals.caveats import (
        Expires,
        Spaces,
        Tenant,
        parse_classes,
        parse_layers,
        parse_rights,
    )
    from czyx.space import Selector

    token = sys.stdin.read().strip() if args.token == "-" else args.token
    spaces = [Selector.from_hex(s).raw for s in args.space]
    scoped = spaces[0] if len(spaces) == 1 else None
    cavs = []
    if spaces:
        cavs.append(Spaces(frozenset(spaces)))
    if args.rights:
        cavs.append(parse_rights(args.rights))
    if args.classes:
        cavs.append(parse_classes(args.classes, scoped))
    if args.layers:
        cavs.append(parse_layers(args.layers, scoped))
    if args.expires:
        cavs.append(Expires(parse_expiry(args.expires, time.time())))
    if args.tenant:
        cavs.append(Tenant(args.tenant))
    if not cavs:
        raise ValueError("attenuate: give at least one caveat (--classes, --layers, ...)")
    print(attenuate(token, cavs))
    return 0
