"""``czyx profile NAME@VERSION --text FILE --out TRACE``: record a routing trace.

Runs the model (opened through a portal with the ``infer`` right) over the
text in chunks and records, for every token and MoE layer, the selected
router bytes and their weights, as a routing trace (``.npz``, the format
documented in :mod:`inference.trace`). ``czyx locality TRACE`` analyses it,
``czyx mount --class-order TRACE`` lays experts out by it, and
``czyx run --hot TRACE`` prewarms the slot cache with the most used experts.
"""

from __future__ import annotations

import argparse
import os
import sys

from czyx.cli.commands._storearg import add_store_arg, store_dir


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``profile`` subcommand."""
    p = subparsers.add_parser(
        "profile",
        help="record which experts a text routes to, per token (a routing trace)",
        description="Record a routing trace of a mounted model over a text.",
    )
    p.add_argument("ref", metavar="NAME@VERSION")
    p.add_argument("--text", required=True, help="UTF-8 text file to run")
    p.add_argument("--out", default="routing-trace.npz", help="where to write the trace (.npz)")
    p.add_argument("--chunk", type=int, default=256, help="tokens per forward pass (KV reset)")
    p.add_argument("--portal", default=os.environ.get("CZYX_PORTAL"))
    add_store_arg(p)
    p.set_defaults(func=profile)


def profile(args: argparse.Namespace) -> int:
    """Run the text, save the counts, print the top of the hot list."""
    import hashlib

    from czyx.inference.engine import Engine
    from czyx.inference.opened import OpenedModel
    from czyx.inference.profile import RouteRecorder, RoutingProfile
    from czyx.inference.tokenizer import tokenizer_for

    if args.chunk <= 0:
        raise ValueError(f"--chunk {args.chunk} must be positive")
    if not args.out.endswith(".npz"):
        raise ValueError(f"--out {args.out!r}: a routing trace is an .npz file")
    with open(args.text, "rb") as f:
        raw = f.read()
    text = raw.decode("utf-8")
    opened = OpenedModel(store_dir(args), args.ref, args.portal)
    consumer = opened.consumer
    try:
        engine = Engine(consumer)
        cfg = engine.cfg
        ids = tokenizer_for(consumer, cfg.vocab_size).encode(text)
        if not ids:
            raise ValueError(f"{args.text} has no tokens")
        rec = RouteRecorder(cfg.sparse_layers, cfg.n_experts, cfg.top_k)
        engine.model.recorder = rec
        from czyx.cli.commands._progress import progress

        for start in progress(range(0, len(ids), args.chunk), "profile"):
            chunk = ids[start : start + args.chunk]
            engine.reset()
            rec.new_segment(len(chunk))
            engine.prefill(chunk)
        engine.model.recorder = None
        kind = "topk_renormalized" if cfg.renormalize else "softmax"
        trace = rec.trace(
            f"{args.ref} {consumer.info.selector.hex()}", hashlib.sha256(raw).hexdigest(), kind
        )
        trace.save(args.out)
        prof = RoutingProfile.from_trace(trace, cfg.n_layers, cfg.n_experts)
        top = ", ".join(f"L{la}:E{e}" for la, e in prof.hot_list(8))
        print(
            f"profiled {len(ids)} tokens x {trace.n_layers} MoE layers -> {args.out}; "
            f"hottest: {top}",
            file=sys.stderr,
        )
        engine.close()
    finally:
        opened.close()
    return 0
