"""``czyx export NAME@VERSION DIR``: write the version as a Hugging Face checkpoint."""

from __future__ import annotations

import argparse
from typing import Any

from czyx.cli.commands._storearg import add_store_arg, store_dir


def register(subparsers: Any) -> None:
    """Add the ``export`` subcommand."""
    p = subparsers.add_parser("export", help="export a model version as safetensors")
    p.add_argument("ref", metavar="NAME@VERSION", help="tag or 64-hex selector")
    p.add_argument("out", metavar="OUT", help="output directory (gguf: a .gguf file or directory)")
    p.add_argument(
        "--format",
        choices=("safetensors", "gguf"),
        default="safetensors",
        help="safetensors (a Hugging Face checkpoint) or gguf (one file llama.cpp loads)",
    )
    p.add_argument(
        "--dequantize",
        action="store_true",
        help="safetensors export of a quantized version: write its dequantized values "
        "(lossy against the source; the format history is recorded)",
    )
    add_store_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Export and list the files written."""
    from czyx.store import Store
    from czyx.store.models.export import export

    with Store.open(store_dir(args), create=False, readonly=True) as store:
        if args.format == "gguf":
            from czyx.store.models.gguf_export import export_gguf

            files = export_gguf(store, args.ref, args.out)
        else:
            files = export(store, args.ref, args.out, dequantize=args.dequantize)
    total = sum(f.stat().st_size for f in files)
    print(f"exported {args.ref} to {args.out}: {len(files)} files, {total / 1e6:.1f} MB")
    return 0
