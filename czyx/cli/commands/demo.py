"""``czyx demo``: mount the bundled model, grant a portal, stream a generation, report."""

from __future__ import annotations

import argparse

from czyx.cli.commands._storearg import add_store_arg, store_dir


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``demo`` subcommand."""
    p = subparsers.add_parser(
        "demo",
        help="the whole path in one command, on the bundled trained MoE",
        description=(
            "Mount the bundled byte-level MoE (trained on the Python standard library), "
            "grant a tenant a narrowed portal, generate through it with the expert cache "
            "at a quarter of the expert bytes, and report the figures."
        ),
    )
    add_store_arg(p)  # created if missing
    p.add_argument("--prompt", default=None, help="Python text to continue")
    p.add_argument("--max-tokens", type=int, default=120, help="tokens to generate")
    p.add_argument(
        "--cache-fraction", type=float, default=0.25, help="tiered run's expert budget (0, 1]"
    )
    p.add_argument("--seed", type=int, default=7, help="sampling seed")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the demo; 0 when every check held."""
    from czyx.inference.demo import DEFAULT_PROMPT, run_demo

    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens {args.max_tokens} must be at least 1")
    run_demo(
        store_dir(args),
        prompt=args.prompt or DEFAULT_PROMPT,
        max_tokens=args.max_tokens,
        cache_fraction=args.cache_fraction,
        seed=args.seed,
    )
    return 0
