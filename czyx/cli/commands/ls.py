"""``czyx ls``: the model versions in a store (tags, kind, architecture, size)."""

from __future__ import annotations

import argparse
from typing import Any

from czyx.cli.commands._storearg import add_store_arg, store_dir


def register(subparsers: Any) -> None:
    """Add the ``ls`` subcommand."""
    p = subparsers.add_parser("ls", help="list mounted model versions")
    add_store_arg(p)
    p.add_argument("--json", action="store_true", help="one JSON object per version")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print one line per tag: tag, selector prefix, kind, arch, experts, bytes."""
    from czyx.store import Store
    from czyx.store.models.mount import ADAPTER_KIND, MODEL_KIND

    with Store.open(store_dir(args), create=False, readonly=True) as store:
        rows = []
        for tag, sel in sorted(store.tags().items()):
            m = store.manifest(sel) if store.has_space(sel) else {}
            if m.get("kind") not in (MODEL_KIND, ADAPTER_KIND):
                continue
            n, nbytes = store.aggregate(sel)
            kind = "adapter" if m["kind"] == ADAPTER_KIND else "model"
            rows.append((tag, sel.hex(), kind, m["arch"], n, nbytes))
    if getattr(args, "json", False):
        import json

        keys = ("tag", "selector", "kind", "arch", "experts", "expert_bytes")
        for r in rows:
            print(json.dumps(dict(zip(keys, r))))
        return 0
    if not rows:
        print("no model versions")
        return 0
    rows = [(t, s[:16], k, a, str(n), f"{b / 1e6:.1f} MB") for t, s, k, a, n, b in rows]
    rows.insert(0, ("TAG", "SELECTOR", "KIND", "ARCH", "EXPERTS", "EXPERT BYTES"))
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0
