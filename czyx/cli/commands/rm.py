"""``czyx rm NAME@VERSION``: remove a model version's tag, then collect garbage.

The version's space is content-addressed and may be shared (adapters name their
base, later versions share expert extents), so ``rm`` removes the *name*; the
space's records stay in the index and its block file stays referenced. ``gc``
then removes block files nothing refers to (a killed mount's leftovers).
"""

from __future__ import annotations

import argparse
from typing import Any

from czyx.cli.commands._storearg import add_store_arg, store_dir


def register(subparsers: Any) -> None:
    """Add the ``rm`` subcommand."""
    p = subparsers.add_parser("rm", help="remove a model version's tag (NAME@VERSION)")
    p.add_argument("ref", metavar="NAME@VERSION", help="the tag to remove")
    p.add_argument(
        "--grace", type=float, default=3600.0, help="gc grace for orphan block files (s)"
    )
    add_store_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Untag and gc; print what was done."""
    from czyx.store import Store, collect_garbage
    from czyx.store.models.mount import parse_tag

    parse_tag(args.ref)  # ValueError for anything but NAME@VERSION
    if args.ref.startswith("session:"):
        raise ValueError(f"{args.ref}: a session; use `czyx sessions rm NAME`")
    with Store.open(store_dir(args), create=False) as st:
        sel = st.resolve_tag(args.ref)  # TagNotFoundError: exit 1
        st.remove_tag(args.ref)
        removed = collect_garbage(st, grace_s=args.grace)
        still = [t for t, s in st.tags().items() if s == sel]
    print(
        f"removed {args.ref} (space {sel.hex()[:16]}"
        + (f", still tagged {', '.join(sorted(still))}" if still else "")
        + f"); gc removed {len(removed)} orphan block files"
    )
    return 0
