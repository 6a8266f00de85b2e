"""``czyx profile NAME@VERSION --text FILE``: record a routing profile over a text.

Runs the model (opened through a portal with the ``infer`` right) over the
text in chunks, counts each layer's top-k expert choices, and writes them as
JSON; ``czyx run --hot FILE`` prewarms the slot cache with the most used
experts first.
"""

from __future__ import annotations

import argparse
import os
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``profile`` subcommand."""
    p = subparsers.add_parser(
        "profile",
        help="record which experts a text routes to (a hot list for czyx run --hot)",
        description="Record a routing profile of a mounted model over a text.",
    )
    p.add_argument("ref", metavar="NAME@VERSION")
    p.add_argument("--text", required=True, help="UTF-8 text file to run")
    p.add_argument("--out", default="routing-profile.json", help="where to write the profile")
    p.add_argument("--chunk", type=int, default=256, help="tokens per forward pass (KV reset)")
    p.add_argument("--portal", default=os.environ.get("CZYX_PORTAL"))
    p.add_argument("--store", default=None, metavar="DIR", help="store directory")
    p.set_defaults(func=profile)


def profile(args: argparse.Namespace) -> int:
    """Run the text, save the counts, print the top of the hot list."""
    from czyx.commands.run import DEFAULT_STORE, OpenedModel, _tokenizer_source
    from inference.engine import Engine
    from inference.tokenizer import load_tokenizer

    if args.chunk <= 0:
        raise ValueError(f"--chunk {args.chunk} must be positive")
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    store_dir = args.store or os.environ.get("CZYX_STORE") or DEFAULT_STORE
    opened = OpenedModel(store_dir, args.ref, args.portal)
    consumer = opened.consumer
    try:
        engine = Engine(consumer)
        ids = load_tokenizer(_tokenizer_source(consumer), engine.cfg.vocab_size).encode(text)
        if not ids:
            raise ValueError(f"{args.text} has no tokens")
        for start in range(0, len(ids), args.chunk):
            engine.reset()
            engine.prefill(ids[start : start + args.chunk])
        prof = engine.routing_profile()
        prof.save(args.out)
        top = ", ".join(f"L{la}:E{e}" for la, e in prof.hot_list(8))
        print(f"profiled {len(ids)} tokens -> {args.out}; hottest: {top}", file=sys.stderr)
        engine.close()
    finally:
        opened.close()
    return 0
