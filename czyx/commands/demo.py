"""``czyx demo``: mount the bundled model, grant a portal, stream a generation, report."""

from __future__ import annotations

import argparse
import os


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="the whole path in one command, on the bundled trained MoE",
        description=(
            "Mount the bundled byte-level MoE (trained on the Python standard library), "
            "grant a tenant a narrowed portal, generate through it with the expert cache "
            "at a quarter of the expert bytes, and report the figures."
        ),
    )
    p.add_argument(
        "--store",
        default=None,
        metavar="DIR",
        help="store directory (default: $CZYX_STORE or ./czyx-store; created if missing)",
    )
    p.add_argument("--prompt", default=None, help="Python text to continue")
    p.add_argument("--max-tokens", type=int, default=120, help="tokens to generate")
    p.add_argument(
        "--cache-fraction", type=float, default=0.25, help="tiered run's expert budget (0, 1]"
    )
    p.add_argument("--seed", type=int, default=7, help="sampling seed")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from inference.demo import DEFAULT_PROMPT, run_demo

    store_dir = args.store or os.environ.get("CZYX_STORE") or "czyx-store"
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens {args.max_tokens} must be at least 1")
    run_demo(
        store_dir,
        prompt=args.prompt or DEFAULT_PROMPT,
        max_tokens=args.max_tokens,
        cache_fraction=args.cache_fraction,
        seed=args.seed,
    )
    return 0
