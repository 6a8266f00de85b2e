"""``czyx audit``: print the store's audit log (grants, opens, denials, revocations)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``audit`` subcommand."""
    from czyx.cli.commands._storearg import add_store_arg

    p = subparsers.add_parser(
        "audit",
        help="show the audit log",
        description="Print audit entries, oldest first (time, event, tenant, portal, reason).",
    )
    p.add_argument("--tenant", help="only entries for this tenant")
    p.add_argument("--event", help="only this event (e.g. portal.deny)")
    p.add_argument("--limit", type=int, default=0, help="only the last N entries")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    add_store_arg(p)
    p.set_defaults(func=run)


_TIMES = ("expires", "at", "created")  # Unix times printed as dates


def run(args: argparse.Namespace) -> int:
    """Print the audit log entries asked for."""
    import json

    from czyx.cli.commands._portalargs import fmt_time, open_store

    with open_store(args) as store:
        rows = [
            e
            for e in store.audit_log()
            if (not args.tenant or e.get("tenant") == args.tenant)
            and (not args.event or e.get("event") == args.event)
        ]
    if args.limit > 0:
        rows = rows[-args.limit :]
    fixed = ("seq", "time", "event", "tenant", "portal", "reason")
    for e in rows:
        if args.json:
            print(json.dumps(e, default=str, sort_keys=True))
            continue
        rest = " ".join(
            f"{k}={fmt_time(e[k]) if k in _TIMES and isinstance(e[k], int | float) else e[k]}"
            for k in sorted(e)
            if k not in fixed and e[k] is not None
        )
        print(
            f"{e.get('seq', ''):>6}  {fmt_time(e.get('time'))}  {e.get('event', ''):14}  "
            f"{e.get('tenant') or '-':12}  {(e.get('portal') or '-')[:12]:12}  "
            f"{e.get('reason') or ''}  {rest}".rstrip()
        )
    return 0
