"""Trunk window vs resident trunk on the shipped model: ``python bench/bench_trunk_window.py``.

Decodes the same teacher-forced bytes of ``os.py`` on ``czyx-moe-stdlib``
(mounted into a scratch store) with the whole trunk resident and with a
trunk window of 1 and 2 layers (:mod:`inference.trunkwindow`), every routed
expert prewarmed, configurations interleaved round by round. Prints the
median ms per token with its ratio to the resident run of the same rounds,
trunk bytes resident, exposed load wait and load time per token, and
whether the logits are bit-identical to the resident run's.

Usage::

    python bench/bench_trunk_window.py                # 32 tokens x 3 rounds, warm cache
    python bench/bench_trunk_window.py --full         # 128 tokens x 5 rounds
    python bench/bench_trunk_window.py --cold         # evict the trunk file before each token
    python bench/bench_trunk_window.py --wide 1024    # a random Mixtral, 1024 wide (MiB layers)
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy: recorded below

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._evidence_trunk import make_wide_checkpoint, measure, table  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=None, help="decoded tokens per round")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (configs interleaved)")
    ap.add_argument("--full", action="store_true", help="128 tokens x 5 rounds")
    ap.add_argument("--io", default="pread", help="expert I/O path (experts are prewarmed)")
    ap.add_argument("--windows", default="1,2", help="window sizes, comma-separated")
    ap.add_argument("--cold", action="store_true", help="drop the trunk file cache per token")
    ap.add_argument(
        "--wide", type=int, default=None, metavar="H", help="a random H-wide Mixtral instead"
    )
    ap.add_argument("--layers", type=int, default=4, help="layers of the --wide model")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    args = ap.parse_args(argv)
    tokens = args.tokens or (128 if args.full else 32)
    rounds = args.rounds or (5 if args.full else 3)
    windows = tuple(int(w) for w in args.windows.split(","))
    scratch = Path(tempfile.mkdtemp(prefix="trunkwin-", dir=args.dir))
    try:
        model_dir = None
        if args.wide:
            model_dir = make_wide_checkpoint(scratch / "wide", args.wide, args.layers)
        runs, facts = measure(scratch, args.io, tokens, rounds, windows, args.cold, model_dir)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    name = f"random Mixtral {args.wide} wide" if args.wide else "czyx-moe-stdlib"
    print(
        f"{name}, {facts['n_layers']} layers; {tokens} tokens x {rounds} rounds; "
        f"experts prewarmed (`{args.io}`); {'cold' if args.cold else 'warm'} trunk cache; "
        f"OPENBLAS_NUM_THREADS={facts['blas_threads']}; stored trunk bytes per layer "
        f"{facts['stored_layer_bytes']} (window-loaded {facts['window_layer_bytes']})"
    )
    print(table(runs))
    return 0 if all(r.identical for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
