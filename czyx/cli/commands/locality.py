"""``czyx locality TRACE``: the routing-locality analysis of one trace, held out.

The trace is split at the segment boundary nearest ``--learn-frac``: class
orders and hot sets are learned on the first part and everything is measured
on the second. Prints Markdown tables; with ``--out DIR`` also writes
``report.json``, ``report.md`` and ``class_order.npy`` (the per-layer
router-index -> class permutation, learned on the whole trace, that ``czyx
mount --class-order`` accepts).
"""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``locality`` subcommand."""
    p = subparsers.add_parser(
        "locality",
        help="analyse a routing trace: usage, co-occurrence, reuse, layouts, cache policies",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("trace", help="routing trace (.npz, see inference.trace)")
    p.add_argument("--out", help="directory for report.json, report.md, class_order.npy")
    p.add_argument("--learn-frac", type=float, default=0.5, help="share of tokens to learn on")
    p.add_argument(
        "--budgets", help="comma-separated cache budgets in expert slots (default: 1/16..3/4)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Execute ``czyx locality``."""
    import json
    from pathlib import Path

    import numpy as np

    from czyx.inference.locality.ordering import learn_class_order
    from czyx.inference.locality.report import analyze, to_markdown
    from czyx.inference.trace import RoutingTrace

    trace = RoutingTrace.load(args.trace)
    learn, measure = trace.split(args.learn_frac)
    budgets = None
    if args.budgets:
        try:
            budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
        except ValueError as exc:
            raise ValueError(f"--budgets: expected integers, got {args.budgets!r}") from exc
    res = analyze(learn, measure, budgets)
    text = to_markdown(res)
    print(text, end="")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(res, indent=1) + "\n")
        (out / "report.md").write_text(text)
        np.save(out / "class_order.npy", learn_class_order(trace))
        print(f"wrote {out / 'report.json'}, {out / 'report.md'}, {out / 'class_order.npy'}")
    return 0
