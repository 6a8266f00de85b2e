"""``czyx rm NAME@VERSION``: remove a model version's tag and the spaces only it used, then gc.

A version spans several content-addressed spaces that other versions may share
(another tag on the same space, the same trunk, an adapter's base): those stay,
the rest are deleted with their block files
(:func:`czyx.portals.model.remove_version`; ``--keep-space`` removes only the
name). ``gc`` then removes block files nothing refers to (a killed mount's
leftovers).
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
    p.add_argument(
        "--keep-space", action="store_true", help="remove only the name; keep the space's bytes"
    )
    add_store_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Untag and gc; print what was done."""
    from czyx.portals.model import remove_version
    from czyx.store import Store, collect_garbage
    from czyx.store.models.mount import parse_tag

    parse_tag(args.ref)  # ValueError for anything but NAME@VERSION
    if args.ref.startswith("session:"):
        raise ValueError(f"{args.ref}: a session; use `czyx sessions rm NAME`")
    with Store.open(store_dir(args), create=False) as st:
        r = remove_version(st, args.ref, keep_spaces=args.keep_space)
        removed = collect_garbage(st, grace_s=args.grace)
    if r.still_tagged:
        done = f"the space stays, still tagged {', '.join(r.still_tagged)}"
    elif args.keep_space:
        done = "its spaces stay (--keep-space)"
    else:
        done = f"deleted {len(r.deleted)} spaces ({len(r.freed)} block files)" + (
            f", kept {len(r.kept)} still used by other versions" if r.kept else ""
        )
    print(f"removed {args.ref}: {done}; gc removed {len(removed)} orphan block files")
    return 0
