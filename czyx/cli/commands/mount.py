"""``czyx mount PATH --as NAME@VERSION``: publish a Hugging Face MoE checkpoint as a version."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from czyx.cli.commands._storearg import add_store_arg, store_dir


def register(subparsers: Any) -> None:
    """Add the ``mount`` subcommand."""
    p = subparsers.add_parser("mount", help="mount a checkpoint directory as NAME@VERSION")
    p.add_argument(
        "path",
        help="checkpoint directory (config.json + *.safetensors), a .gguf file, a directory "
        "of split .gguf files, or ORG/NAME: that repository's snapshot in the local Hugging "
        "Face cache (as huggingface-cli download left it; nothing is downloaded)",
    )
    p.add_argument(
        "--revision",
        default=None,
        help="with ORG/NAME: the cached branch, tag or commit to mount (default main)",
    )
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
    p.add_argument(
        "--quant",
        metavar="POLICY",
        default=None,
        help=(
            "store quantized: none, q2-all, q4-all, selective (routed experts q2, trunk q4, "
            "embed/head q8, routers and norms float), optionally with CLASS=FMT overrides "
            "(e.g. selective,embed=q4); see store/quant/README.md"
        ),
    )
    p.add_argument(
        "--importance",
        metavar="REF",
        default=None,
        help="calibration importance map (a tag or selector from `czyx calibrate`) for --quant",
    )
    p.add_argument(
        "--convert",
        metavar="POLICY",
        default=None,
        help=(
            "conversion of source formats with no native store format (GGUF K-quants etc., "
            "FP8 and MXFP4 weights): f32, f16, bf16 (dequantize) or q8, q4 (requantize); "
            "the drift of each converted tensor is printed and recorded. Default: refuse them"
        ),
    )
    p.add_argument(
        "--allow-requantize",
        action="store_true",
        help=(
            "with --quant on a quantized GGUF: requantize the classes the policy names a "
            "format for (e.g. none,expert=q2: the file's Q8_0 experts as q2, the rest as "
            "stored); lossy, the drift of each tensor is printed and recorded"
        ),
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Mount and print the one-line summary."""
    from czyx.store import Store
    from czyx.store.models.mount import DEFAULT_OUTER, mount, resolve

    if args.importance is not None and args.quant is None:
        raise ValueError("--importance needs --quant POLICY")
    if args.allow_requantize and args.quant is None:
        raise ValueError("--allow-requantize needs --quant POLICY")
    path = _local_path(args.path, args.revision)
    class_perm = None
    if args.class_order:
        from czyx.inference.locality.ordering import class_order_from_trace

        class_perm = class_order_from_trace(args.class_order).tolist()
    with Store.open(store_dir(args)) as store:
        codec = None
        if args.quant is not None:
            from czyx.store.quant.codec import QuantCodec
            from czyx.store.quant.policy import parse_policy

            policy = parse_policy(args.quant)
            imp, prov = None, None
            if args.importance is not None:
                from czyx.inference.calibration import ImportanceCollector
                from czyx.store.quant.importance import load_importance

                sel = resolve(store, args.importance)
                data, _model = load_importance(store, sel)
                col, provenance = ImportanceCollector.from_dict(data)
                imp = col.importance_map()
                prov = {**provenance.__dict__, "space": sel.hex()}
            codec = QuantCodec(policy, imp, prov) if policy.quantizes else None
        result = mount(
            store,
            path,
            args.tag,
            outer=args.layout or DEFAULT_OUTER,
            adapter_of=args.adapter_of,
            class_perm=class_perm,
            progress=not args.no_progress and sys.stderr.isatty(),
            quant=codec,
            convert=args.convert,
            # a policy that quantizes nothing (--quant none) has nothing to requantize
            allow_requantize=args.allow_requantize and codec is not None,
        )
    print(result.summary())
    return 0


def _local_path(path: str, revision: str | None) -> str:
    """``path`` itself, or where the Hugging Face cache holds repository ``path``
    (a path that exists wins over a repository of the same spelling)."""
    import os

    from czyx.store.models.hf_cache import looks_like_repo_id, snapshot_dir

    if os.path.exists(path) or not looks_like_repo_id(path):
        if revision is not None:
            raise ValueError(f"--revision is for ORG/NAME in the Hugging Face cache, not {path}")
        return path
    from czyx.store.models.mount_errors import CheckpointError

    try:
        snap = snapshot_dir(path, revision or "main")
    except CheckpointError as exc:
        raise CheckpointError(f"no file or directory {path!r}, and {exc}") from None
    print(f"czyx mount: {path} from the Hugging Face cache: {snap}", file=sys.stderr)
    return str(snap)
