"""``czyx portals``: list the portals a store has issued."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``portals`` subcommand."""
    from czyx.cli.commands._storearg import add_store_arg

    p = subparsers.add_parser(
        "portals",
        help="list the portals issued by the store",
        description="List portal descriptors: id, parent, tenant, caveats, expiry, status.",
    )
    p.add_argument("--active", action="store_true", help="only portals that are still valid")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument(
        "--root-token",
        action="store_true",
        help="print the owner's root portal token (needs the store secret) and exit",
    )
    add_store_arg(p)
    p.set_defaults(func=run)


def _caveats(d: dict, tags: dict[str, str]) -> str:
    parts = []
    for c in d.get("caveats", []):
        if c["kind"] == "Spaces":
            parts.append("spaces=" + "+".join(tags.get(s, s[:12]) for s in c["spaces"]))
        elif c["kind"] == "Rights":
            parts.append("rights=" + ",".join(c["rights"]))
        elif "classes" in c:
            parts.append("classes=" + c["classes"])
        elif "layers" in c:
            parts.append("layers=" + c["layers"])
    return " ".join(parts) or "(everything)"


def run(args: argparse.Namespace) -> int:
    """List the store's portals (or print the root token)."""
    import json

    from czyx.cli.commands._portalargs import fmt_time, open_store
    from czyx.portals.authority import PortalAuthority

    with open_store(args) as store:
        auth = PortalAuthority(store)
        if args.root_token:
            print(auth.root_token())
            return 0
        descs = auth.descriptors()
        tags = {sel.hex(): t for t, sel in store.tags().items()}
    if args.active:
        descs = [d for d in descs if d["status"] == "active"]
    if args.json:
        for d in descs:
            print(json.dumps(d, default=str, sort_keys=True))
        return 0
    print(f"{'id':32}  {'status':7}  {'tenant':12}  {'parent':8}  {'expires':20}  caveats")
    for d in descs:
        print(
            f"{d['id']:32}  {d['status']:7}  {d['tenant']:12.12}  "
            f"{(d.get('parent') or '-')[:8]:8}  {fmt_time(d.get('expires')):20}  "
            f"{_caveats(d, tags)}"
        )
    return 0
