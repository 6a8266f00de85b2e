"""``czyx mount PATH --as NAME@VERSION``: publish a Hugging Face MoE checkpoint as a version."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from czyx.commands._storearg import add_store_arg, store_dir


def register(subparsers: Any) -> None:
    """Add the ``mount`` subcommand."""
    p = subparsers.add_parser("mount", help="mount a checkpoint directory as NAME@VERSION")
    p.add_argument("path", help="checkpoint directory (config.json + *.safetensors)")
    p.add_argument("--as", dest="tag", required=True, metavar="NAME@VERSION")
    add_store_arg(p)
    p.add_argument(
        "--layout",
        default=None,
        choices=("morton", "hilbert", "rowmajor"),
        help="outer curve of the expert layout over (layer, class) (default morton)",
    )
    p.add_argument(
        "--adapter-of",
        metavar="BASE",
        help="mount as an adapter of BASE (NAME@VERSION): only the tensors it replaces",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--class-order",
        metavar="TRACE",
        help=(
            "per-layer class permutation learned from a routing trace (.npz from czyx "
            "profile) or a saved order (.npy [L, E] from czyx locality --out)"
        ),
    )
    # `--quant POLICY` is added by the quantization work (store.quant).
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Mount and print the one-line summary."""
    from store import Store
    from store.mount import DEFAULT_OUTER, mount

    class_perm = None
    if args.class_order:
        from inference.locality.ordering import class_order_from_trace

        class_perm = class_order_from_trace(args.class_order).tolist()
    with Store.open(store_dir(args)) as store:
        result = mount(
            store,
            args.path,
            args.tag,
            outer=args.layout or DEFAULT_OUTER,
            adapter_of=args.adapter_of,
            class_perm=class_perm,
            progress=not args.no_progress and sys.stderr.isatty(),
        )
    print(result.summary())
    return 0
