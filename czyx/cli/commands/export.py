"""``czyx export NAME@VERSION DIR``: write the version as a Hugging Face checkpoint."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

from czyx.cli.commands._progress import byte_progress
from czyx.cli.commands._storearg import add_store_arg, store_dir

# What an export writes: removed from a non-empty target under --force, so a shard
# of an earlier, larger checkpoint cannot survive beside the new index.
_CHECKPOINT_FILES = ("*.safetensors", "*.safetensors.index.json", "config.json")


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
    p.add_argument(
        "--force",
        action="store_true",
        help="export into a non-empty OUT directory: its checkpoint files (*.safetensors, the "
        "index, config.json) are removed first, so no stale shard survives",
    )
    add_store_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Export and list the files written."""
    from czyx.store import Store
    from czyx.store.models.export import export, staging_leftovers

    out = Path(args.out)
    if args.format == "gguf" and out.suffix == ".gguf":
        if out.exists() and not args.force:
            raise ValueError(f"{out}: exists; pass --force to replace it")
    elif out.exists() and not out.is_dir():
        raise ValueError(f"{out}: exists and is not a directory")
    elif out.is_dir() and any(out.iterdir()):
        if not args.force:
            raise ValueError(
                f"{out}: not empty; export into a new directory, or pass --force to replace "
                "its checkpoint files"
            )
        for pattern in _CHECKPOINT_FILES:
            for f in out.glob(pattern):
                if f.is_file() or f.is_symlink():
                    f.unlink()
    if args.force:  # also what an export killed midway left there
        for left in staging_leftovers(out):
            if left.is_dir() and not left.is_symlink():
                shutil.rmtree(left)
            else:
                left.unlink()
    with (
        Store.open(store_dir(args), create=False, readonly=True) as store,
        byte_progress(f"export {args.ref}") as progress,
    ):
        if args.format == "gguf":
            from czyx.store.models.gguf_export import export_gguf

            files = export_gguf(store, args.ref, args.out, progress=progress)
        else:
            files = export(store, args.ref, args.out, dequantize=args.dequantize, progress=progress)
    total = sum(f.stat().st_size for f in files)
    print(f"exported {args.ref} to {args.out}: {len(files)} files, {total / 1e6:.1f} MB")
    return 0
