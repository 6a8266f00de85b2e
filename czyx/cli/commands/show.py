"""``czyx show NAME@VERSION``: layers, experts, bytes per class, formats, shared bytes."""

from __future__ import annotations

import argparse
import json
from typing import Any

from czyx.cli.commands._storearg import add_store_arg, store_dir


def register(subparsers: Any) -> None:
    """Add the ``show`` subcommand."""
    p = subparsers.add_parser("show", help="describe a mounted model version")
    p.add_argument("ref", metavar="NAME@VERSION", help="tag or 64-hex selector")
    add_store_arg(p)
    p.add_argument("--json", action="store_true", help="print the full description as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the version's summary."""
    from czyx.store import Store
    from czyx.store.models.mount import summarize

    with Store.open(store_dir(args), create=False, readonly=True) as store:
        info = summarize(store, args.ref)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    per_class = info["bytes_per_class"]
    lo, hi = (min(per_class.values()), max(per_class.values())) if per_class else (0, 0)
    lines = [
        f"{args.ref}  {info['selector']}",
        f"  kind {info['kind']}, arch {info['arch']}"
        + (f", base {info['base'][:16]}" if info["base"] else ""),
        f"  layers {info['layers']} (sparse {len(info['sparse_layers'])}), "
        f"{info['experts_per_layer']} experts/layer, {info['experts']} expert extents",
        f"  experts: {info['expert_format']}, {info['expert_bytes']} bytes each, "
        f"layout {info['layout']}",
        f"  bytes per class: {len(per_class)} classes, {lo}..{hi} bytes"
        + (
            f" ({info['experts_per_class']} consecutive experts a class per layer)"
            if info["experts_per_class"] > 1
            else ""
        ),
        f"  expert bytes: {info['expert_bytes_own']} own, {info['expert_bytes_shared']} shared",
        f"  trunk: {info['trunk_tensors']} tensors, {info['trunk_bytes']} bytes",
        "  formats: " + ", ".join(f"{k} x{v}" for k, v in sorted(info["formats"].items())),
        "  tags: " + ", ".join(info["tags"]),
    ]
    print("\n".join(lines))
    return 0
