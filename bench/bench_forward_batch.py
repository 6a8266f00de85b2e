"""``forward_batch`` alone on decode steps: CPU and wall per token at B=1 and B=8, by C call.

On the bundled ``czyx-moe-stdlib`` (mounted in a temporary store, resident,
the engine as ``czyx serve`` opens it), each round prefills B sequences (12 to
26 tokens, bench_serve's prompt sizes) and runs 64 decode steps of B tokens
through ``inference.batch.forward_batch`` (the scheduler's step without the
scheduler); ``--rounds`` rounds per B. (The prefills take the numpy path, so
the C calls counted are the decode steps'.) Printed: per decode token, process CPU
and wall microseconds, and the process CPU inside each of the step's C calls
(``DecodeKernels.attention_batch``, ``moe_batch``, ``head_batch``; the rest is
Python). The ratio B=8 / B=1 per token is the batch's in-run gain; to compare
two versions, run this script from each checkout in alternation.

Run: ``OPENBLAS_NUM_THREADS=1 python bench/bench_forward_batch.py`` (``--rounds``,
``--threads``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="0: the engine's default")
    args = ap.parse_args(argv)

    from czyx.inference.assets import bundled_model_dir
    from czyx.inference.batch import forward_batch
    from czyx.inference.engine import Engine
    from czyx.inference.kernels import fused
    from czyx.inference.options import BATCHED_OPTIONS
    from czyx.portals import open_consumer
    from czyx.store import Store
    from czyx.store.models.mount import mount

    acc: dict[str, float] = {}

    def timed(name: str) -> None:
        fn = getattr(fused.DecodeKernels, name)

        def call(*a, **k):
            c0 = time.process_time()
            try:
                return fn(*a, **k)
            finally:
                acc[name] = acc.get(name, 0.0) + time.process_time() - c0

        setattr(fused.DecodeKernels, name, call)

    for name in ("attention_batch", "moe_batch", "head_batch"):
        timed(name)
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        with Store.open(os.path.join(tmp, "s")) as st:
            mount(st, str(bundled_model_dir()), "stdlib@1")
        st = Store.open(os.path.join(tmp, "s"), create=False)
        kw = {"threads": args.threads} if args.threads else {}
        eng = Engine(
            open_consumer(st, None, "stdlib@1", direct=True),
            cache_fraction=1.0, options=BATCHED_OPTIONS, **kw,
        )  # fmt: skip
        m = eng.model
        rng = np.random.default_rng(0)
        vocab = m.cfg.vocab_size
        load0 = os.getloadavg()[0]
        try:
            for B in (1, 8):
                cpu = wall = 0.0
                acc.clear()
                for _ in range(args.rounds):
                    kvs = [m.new_kv() for _ in range(B)]
                    forward_batch(m, [rng.integers(0, vocab, 12 + 2 * b) for b in range(B)], kvs)
                    toks = rng.integers(0, vocab, (64, B))
                    c0, w0 = time.process_time(), time.perf_counter()
                    for s in range(64):
                        forward_batch(m, [np.array([t]) for t in toks[s]], kvs)
                    cpu += time.process_time() - c0
                    wall += time.perf_counter() - w0
                n = args.rounds * 64 * B
                res[B] = (cpu / n * 1e6, wall / n * 1e6, {k: v / n * 1e6 for k, v in acc.items()})
        finally:
            eng.close()
            st.close()
    for B, (c, w, calls) in res.items():
        parts = " ".join(f"{k} {v:.1f}" for k, v in calls.items())
        print(f"B={B}: {c:.1f} us CPU/token, {w:.1f} us wall/token; C calls, CPU us/token: {parts}")
    print(
        f"B=8 / B=1 per token: CPU {res[8][0] / res[1][0]:.3f}, wall {res[8][1] / res[1][1]:.3f}; "
        f"load {load0:.2f}-{os.getloadavg()[0]:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
