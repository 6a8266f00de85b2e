"""``czyx grant NAME@VERSION --tenant T ...``: issue a portal to a tenant."""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``grant`` subcommand."""
    from czyx.cli.commands._storearg import add_store_arg

    p = subparsers.add_parser(
        "grant",
        help="issue a portal (capability) on a model version or space to a tenant",
        description=(
            "Issue a portal on NAME@VERSION (or a 64-hex space selector) to a tenant, "
            "recorded in the store and revocable. Prints the token on stdout. Class "
            "and layer caveats narrow the routed experts; the version's trunk stays "
            "readable."
        ),
    )
    p.add_argument("space", metavar="NAME@VERSION", help="model version tag or space selector")
    p.add_argument("--tenant", required=True, help="the tenant the portal is bound to")
    p.add_argument("--classes", help="allowed classes, e.g. 0-63 or 1,5,7-9")
    p.add_argument("--layers", help="allowed layers, e.g. 0-3")
    p.add_argument("--expires", help="lifetime (24h, 30m, 7d), ISO time or @UNIX")
    p.add_argument(
        "--rights",
        default="read,infer",
        help="comma list of read, infer, grant (default read,infer)",
    )
    p.add_argument("--portal", help="issue under this portal (needs 'grant'); default: owner root")
    p.add_argument("--note", default="", help="free text kept in the descriptor")
    add_store_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Grant a portal and print its token."""
    import time

    from czyx.cli.commands._portalargs import open_store, parse_expiry, resolve_space
    from czyx.portals.model import grant_model, model_spaces

    with open_store(args) as store:
        main = resolve_space(store, args.space)
        scoped, whole = model_spaces(store, main)
        expires = parse_expiry(args.expires, time.time()) if args.expires else None
        g = grant_model(
            store,
            main,
            tenant=args.tenant,
            classes=args.classes,
            layers=args.layers,
            expires_at=expires,
            rights=args.rights,
            parent=args.portal,
            note=args.note,
        )
    print(
        f"granted portal {g.id_hex} to {args.tenant} on {args.space}"
        + (f" ({len(scoped) + len(whole)} spaces)" if whole or len(scoped) > 1 else ""),
        file=sys.stderr,
    )
    print(g.token)
    return 0
