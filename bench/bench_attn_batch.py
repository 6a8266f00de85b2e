"""The batched C attention call: weight rows shared by a group of tokens vs each token alone.

On the bundled ``czyx-moe-stdlib`` (mounted in a temporary store, resident, as
``czyx serve`` opens it), eight sequences are prefilled (30 to 51 tokens) and
decode one step; then ``DecodeKernels.attention_batch`` (attention, residual,
post-norm and routing of every layer for the batch's tokens, one C call per
layer) is called repeatedly on that state, in blocks of ``--calls`` calls
cycling through the layers, alternately with sharing on (each q/k/v, o and
router row read once for a group of up to four tokens) and off (each token the
one-token kernel, the code before sharing): the in-run baseline. Also B=1 (the
one-token call, the same either way) for scale. Figures: per token and layer
call, the median over ``--blocks`` blocks of wall and process-CPU microseconds,
per thread count. Both paths give every token's solo results bit for bit
(tests/inference/test_batch_c.py); this measures only their cost.

Run: ``OPENBLAS_NUM_THREADS=1 python bench/bench_attn_batch.py`` (``--threads 1,2``,
``--blocks``, ``--calls``, ``--out``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np


def _engine(store_dir: str, threads: int):
    from czyx.inference.engine import Engine
    from czyx.inference.options import BATCHED_OPTIONS
    from czyx.portals import open_consumer
    from czyx.store import Store

    st = Store.open(store_dir, create=False)
    consumer = open_consumer(st, None, "stdlib@1", direct=True)
    return st, Engine(consumer, cache_fraction=1.0, options=BATCHED_OPTIONS, threads=threads)


def _measure(model, B: int, blocks: int, calls: int, modes: list[bool]) -> dict[bool, tuple]:
    from czyx.inference.batch import forward_batch
    from czyx.inference.kernels import fused

    cfg = model.cfg
    rng = np.random.default_rng(0)
    kvs = [model.new_kv() for _ in range(B)]
    forward_batch(model, [rng.integers(0, cfg.vocab_size, 30 + 3 * b) for b in range(B)], kvs)
    forward_batch(model, [np.array([5]) for _ in range(B)], kvs)  # the batch state: B tokens
    kern = model.kernels()
    args = (model.rotary, cfg.rms_eps, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, *model._c_qkv)
    wall: dict[bool, list[float]] = {m: [] for m in modes}
    cpu: dict[bool, list[float]] = {m: [] for m in modes}
    try:
        for _ in range(blocks):
            for share in modes:  # interleaved: each block runs both paths
                fused.set_attn_share(share)
                c0, w0 = time.process_time(), time.perf_counter()
                for it in range(calls):
                    i = it % cfg.n_layers
                    kern.attention_batch(
                        model.layers[i], i, B, cfg.sliding_windows[i], *args, cfg.top_k,
                        cfg.renormalize,
                    )  # fmt: skip
                wall[share].append((time.perf_counter() - w0) / calls / B * 1e6)
                cpu[share].append((time.process_time() - c0) / calls / B * 1e6)
    finally:
        fused.set_attn_share(True)
    return {m: (statistics.median(wall[m]), statistics.median(cpu[m])) for m in modes}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2", help="the engine's thread counts, one run each")
    ap.add_argument("--blocks", type=int, default=15)
    ap.add_argument("--calls", type=int, default=400, help="layer calls per block")
    ap.add_argument("--out", default=None, help="write the markdown table here")
    args = ap.parse_args(argv)

    from czyx.inference.assets import bundled_model_dir
    from czyx.store import Store
    from czyx.store.models.mount import mount

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        store_dir = os.path.join(tmp, "store")
        with Store.open(store_dir) as st:
            mount(st, str(bundled_model_dir()), "stdlib@1")
        for t in (int(x) for x in args.threads.split(",")):
            st, eng = _engine(store_dir, t)
            try:
                load0 = os.getloadavg()[0]
                one = _measure(eng.model, 1, args.blocks, args.calls, [True])[True]
                eight = _measure(eng.model, 8, args.blocks, args.calls, [False, True])
                load1 = os.getloadavg()[0]
            finally:
                eng.close()
                st.close()
            each, shared = eight[False], eight[True]
            rows.append(
                f"| {t} | {one[0]:.2f} / {one[1]:.2f} | {each[0]:.2f} / {each[1]:.2f} | "
                f"{shared[0]:.2f} / {shared[1]:.2f} | {shared[0] / each[0]:.3f} / "
                f"{shared[1] / each[1]:.3f} | {load0:.2f}-{load1:.2f} |"
            )
            print(rows[-1], flush=True)
    head = (
        "| threads | B=1 wall / CPU us | B=8 each token alone | B=8 shared rows | "
        "shared / alone (wall / CPU) | load avg |\n|---|---|---|---|---|---|"
    )
    table = head + "\n" + "\n".join(rows)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
