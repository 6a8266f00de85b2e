"""Qwen3-MoE decode with the C attention call vs the decoder's numpy attention, one run.

A tiny random Qwen3-MoE (hidden 128, 4 layers, 8 experts top-2, 4 query heads
of 32 over 2 KV heads; transformers' initialisation): 16-token prefill, then
128 greedy decode steps, on one engine per attention path (the C path is
``czk_attn_decode`` with per-head q/k norms, mode 2; the numpy path is the
same engine with ``model._fast_attn = False``: routing and experts stay in C).
Rounds interleave the two; figures are medians of decode tokens per
CPU-second of the process (robust to a shared machine's load). It also
checks the two paths' greedy tokens agree.

Run: ``OPENBLAS_NUM_THREADS=1 python bench/bench_attn_c.py`` (``--rounds``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)

    from czyx.inference.engine import Engine
    from czyx.testing.refmodels import StateDictConsumer, tiny_model

    model = tiny_model(
        "qwen3_moe", seed=1, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
    )  # fmt: skip
    consumer = StateDictConsumer(model)
    engines = {}
    for name, fast in (("C attention", True), ("numpy attention", False)):
        eng = Engine(consumer, threads=1)
        assert eng.model.decode_in_c()
        eng.model._fast_attn = fast
        engines[name] = eng
    load0 = os.getloadavg()
    rates: dict[str, list[float]] = {n: [] for n in engines}
    tokens: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for name, eng in engines.items():
            eng.reset()
            tok = int(np.argmax(eng.prefill(list(range(16)))))
            out = []
            c0 = time.process_time()
            for _ in range(128):
                out.append(tok)
                tok = int(np.argmax(eng.decode(tok)))
            rates[name].append(128 / (time.process_time() - c0))
            tokens[name] = out
    for eng in engines.values():
        eng.close()
    med = {n: statistics.median(v) for n, v in rates.items()}
    base = med["numpy attention"]
    print(f"load average before {load0[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    for name, v in med.items():
        print(f"{name}: {v:,.0f} decode tok per CPU-second ({v / base:.2f}x numpy attention)")
    print("same greedy tokens:", tokens["C attention"] == tokens["numpy attention"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
