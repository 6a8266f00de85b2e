"""Benchmark of the numpy MoE engine: speed against transformers, the RAM dial, memory.

Run from the repository root: ``python bench/bench_engine.py`` (modest sizes,
well under 2 minutes) or ``python bench/bench_engine.py --full`` (the issue's
sizes: a 2.8 GB synthetic model for the memory figure).

Three sections, each printed as ratios against a baseline measured in the same run:

1. speed: prefill and decode tokens/s of our engine (every expert resident)
   against transformers on the same Mixtral-shaped checkpoint, CPU, batch 1,
   the same thread count for OpenBLAS and torch (recorded);
2. the dial: a cold start at expert budgets of 100, 50, 25 and 12.5 %:
   decode tokens/s (ratio to 100 %), hit rate, bytes read from disk per token,
   exposed I/O wait;
3. memory: a synthetic model whose experts are at least 4x the budget runs in
   a child process; its peak RSS above the interpreter's baseline is compared
   with trunk + budget (+15 % allowed).

Every model is mounted in a real store (``store.mount``) and opened as
``czyx run`` opens it: through the owner's portal, ``store.model.open_model``
with O_DIRECT expert reads (so every miss is a device read, never the page
cache).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--full", action="store_true", help="the issue's sizes (slower)")
    p.add_argument("--threads", type=int, default=1, help="BLAS and torch threads (default 1)")
    p.add_argument("--repeats", type=int, default=3, help="runs per figure (median)")
    p.add_argument("--tokens", type=int, default=32, help="tokens to generate per run")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--only", choices=["speed", "dial", "memory"], action="append")
    p.add_argument("--workdir", default=None, help="where to write expert files (not tmpfs)")
    p.add_argument("--memory-child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _sizes(full: bool) -> dict:
    if full:
        return dict(
            speed=dict(hidden=1024, inter=2048, layers=8, experts=8, vocab=8192),
            memory=dict(hidden=1024, inter=3584, layers=8, experts=8, fraction=0.125),
        )
    return dict(
        speed=dict(hidden=512, inter=1024, layers=4, experts=8, vocab=4096),
        memory=dict(hidden=512, inter=1536, layers=8, experts=8, fraction=0.25),
    )


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _row(name: str, ours: float, base: float, unit: str) -> None:
    ratio = ours / base if base else float("nan")
    print(f"  {name:<28} ours {ours:10.1f} {unit:<6} baseline {base:10.1f} {unit:<6} x{ratio:.2f}")


def speed_and_dial(args: argparse.Namespace, sizes: dict, workdir: str) -> None:
    import numpy as np
    import torch

    sys.path.insert(0, ROOT)
    from bench._engine_fixtures import mount_transformers
    from czyx.inference.engine import Engine
    from czyx.inference.generate import generate_ids
    from czyx.inference.opened import OpenedModel
    from czyx.inference.options import EngineOptions
    from czyx.testing.refmodels import tiny_model

    s = sizes["speed"]
    model = tiny_model(
        "mixtral",
        hidden_size=s["hidden"],
        intermediate_size=s["inter"],
        num_hidden_layers=s["layers"],
        num_local_experts=s["experts"],
        vocab_size=s["vocab"],
        num_attention_heads=s["hidden"] // 64,
        num_key_value_heads=max(s["hidden"] // 256, 1),
        initializer_range=0.02,
        sliding_window=None,
        max_position_embeddings=4096,
    )
    store_dir = mount_transformers(model, os.path.join(workdir, "speed"))
    opened = OpenedModel(store_dir, "bench@1", None)
    consumer = opened.consumer
    prompt = np.random.default_rng(0).integers(0, s["vocab"], args.prompt_len).tolist()
    n = args.tokens
    expert_mb = s["layers"] * s["experts"] * consumer.info.expert_slot_nbytes / 2**20
    print(
        f"model: mixtral-shaped, hidden {s['hidden']}, inter {s['inter']}, {s['layers']} layers"
        f" x {s['experts']} experts (top-2), vocab {s['vocab']}; experts {expert_mb:.0f} MiB;"
        " O_DIRECT expert reads"
    )
    if not args.only or "speed" in args.only:
        print(f"\n[speed] prompt {len(prompt)} tokens, {n} generated, median of {args.repeats}")
        print(
            f"  transformers: {type(model).__name__}, {model.dtype}, eval={not model.training},"
            f" no_grad, attention {model.config._attn_implementation!r},"
            f" experts {getattr(model.config, '_experts_implementation', None)!r}"
        )
        eng = Engine(consumer)
        eng.prefill(prompt)  # warm: every expert resident
        ids = torch.tensor(prompt)[None]

        def ours_prefill() -> None:
            eng.reset()
            eng.prefill(prompt)

        def hf_prefill() -> None:
            # As generate() prefills: the KV cache filled, logits of the last token only
            # (ours computes only those too); computing all 64 rows would cost it an
            # extra [64, vocab] product.
            with torch.no_grad():
                model(ids, use_cache=True, logits_to_keep=1)

        hf_prefill()  # warm: lazy initialisation of torch kernels
        # Interleaved (ours, theirs, ours, ...) so both see the same machine load.
        pf_ours, pf_hf, gen_hf, ours_dec = [], [], [], []
        ours_tokens = hf_tokens = None
        for _ in range(args.repeats):
            pf_ours.append(_median_time(ours_prefill, 1))
            pf_hf.append(_median_time(hf_prefill, 1))
            ours_tokens, st = generate_ids(eng, prompt, n)
            ours_dec.append(st.decode_tokens_per_s)
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(
                    ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
                )
            gen_hf.append(time.perf_counter() - t0)
            hf_tokens = out[0, len(prompt) :].tolist()
        t_ours_pf, t_hf_pf = statistics.median(pf_ours), statistics.median(pf_hf)
        t_hf_gen = statistics.median(gen_hf)
        hf_dec = (n - 1) / max(t_hf_gen - t_hf_pf, 1e-9)
        _row("prefill tokens/s", len(prompt) / t_ours_pf, len(prompt) / t_hf_pf, "tok/s")
        _row("decode tokens/s", statistics.median(ours_dec), hf_dec, "tok/s")
        print(f"  greedy tokens identical to transformers: {ours_tokens == hf_tokens}")

    if not args.only or "dial" in args.only:
        print(
            f"\n[dial] cold start (empty slots, O_DIRECT) per budget, {n} generated, "
            f"median of {args.repeats}"
        )
        base = None
        for frac, policy in [(f, p) for f in (1.0, 0.5, 0.25, 0.125) for p in ("lru", "lfu")]:
            if frac == 1.0 and policy == "lfu":
                continue  # nothing is ever evicted at 100 %: the policy cannot matter
            runs = []
            for _ in range(args.repeats):
                eng = Engine(
                    consumer,
                    cache_fraction=frac,
                    options=EngineOptions(policy=policy, prefetch=False),
                )
                _, st = generate_ids(eng, prompt, n)
                runs.append(st)
                eng.close()
            tps = statistics.median(r.decode_tokens_per_s for r in runs)
            st = runs[0]
            if base is None:
                base = tps
            print(
                f"  budget {frac * 100:5.1f}% ({eng.cache.n_slots:3d} slots, {policy}): decode "
                f"{tps:7.1f} tok/s (x{tps / base:.2f} of 100%), hit rate {st.hit_rate:.3f}, "
                f"{st.decode_bytes_per_token / 2**20:7.2f} MiB/token decode, "
                f"{st.bytes_per_token / 2**20:6.2f} MiB/token overall, "
                f"I/O wait {statistics.median(r.io_wait_seconds for r in runs) * 1e3:7.1f} ms"
            )
    opened.close()


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def memory_child(spec: str) -> None:
    """Run the mounted synthetic model under a budget; print a JSON line of RSS figures."""
    store_dir, frac, tokens = spec.split(",")
    import numpy as np

    sys.path.insert(0, ROOT)
    from czyx.inference.engine import Engine
    from czyx.inference.generate import generate_ids
    from czyx.inference.opened import OpenedModel
    from czyx.store.consumer import GLOBAL_ROLES, LAYER_ROLES

    try:  # reset the high-water mark so imports do not count
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    base_kb = _status_kb("VmRSS")
    opened = OpenedModel(store_dir, "synthetic@1", None)
    consumer = opened.consumer
    n_layers = consumer.info.n_layers
    trunk_bytes = sum(
        consumer.trunk(r, la).nbytes
        for r, la in [(g, None) for g in GLOBAL_ROLES]
        + [(r, la) for r in LAYER_ROLES for la in range(n_layers)]
        if consumer.has_trunk(r, la)
    )
    eng = Engine(consumer, cache_fraction=float(frac))
    vocab = int(consumer.info.config["vocab_size"])
    prompt = np.random.default_rng(1).integers(0, vocab, 16).tolist()
    _, st = generate_ids(eng, prompt, int(tokens))
    print(
        json.dumps(
            dict(
                base_kb=base_kb,
                hwm_kb=_status_kb("VmHWM"),
                hwm_reset=reset,
                trunk_bytes=trunk_bytes,
                budget_bytes=eng.cache.n_slots * eng.cache.slot_nbytes,
                expert_bytes=eng.expert_bytes,
                hit_rate=st.hit_rate,
                decode_tps=st.decode_tokens_per_s,
            )
        )
    )
    opened.close()


def memory(args: argparse.Namespace, sizes: dict, workdir: str) -> None:
    sys.path.insert(0, ROOT)
    from bench._engine_fixtures import (
        mount_checkpoint,
        synthetic_config,
        write_synthetic_checkpoint,
    )

    m = sizes["memory"]
    cfg = synthetic_config(m["hidden"], m["inter"], m["layers"], m["experts"])
    ckpt = os.path.join(workdir, "synthetic")
    store_dir = os.path.join(workdir, "synthetic-store")
    t0 = time.perf_counter()
    size = write_synthetic_checkpoint(ckpt, cfg)
    t1 = time.perf_counter()
    mount_checkpoint(ckpt, store_dir, "synthetic@1")
    t2 = time.perf_counter()
    shutil.rmtree(ckpt)  # the store holds its own copy
    print(
        f"\n[memory] synthetic model: {size / 2**30:.2f} GiB of experts written in "
        f"{t1 - t0:.1f} s, mounted in {t2 - t1:.1f} s; budget {m['fraction'] * 100:.1f}% of experts"
    )
    spec = ",".join(map(str, [store_dir, m["fraction"], args.tokens]))
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--memory-child", spec],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    shutil.rmtree(store_dir)
    if out.returncode:
        print(out.stderr[-2000:])
        raise SystemExit("memory child failed")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    mib = 2**20
    peak = r["hwm_kb"] * 1024 - (r["base_kb"] * 1024 if r["hwm_reset"] else 0)
    allowed = (r["trunk_bytes"] + r["budget_bytes"]) * 1.15
    print(
        f"  experts {r['expert_bytes'] / mib:.0f} MiB = "
        f"{r['expert_bytes'] / r['budget_bytes']:.1f}x the budget of "
        f"{r['budget_bytes'] / mib:.0f} MiB; trunk {r['trunk_bytes'] / mib:.0f} MiB"
    )
    print(
        f"  peak RSS above interpreter baseline: {peak / mib:.0f} MiB vs trunk+budget "
        f"{(r['trunk_bytes'] + r['budget_bytes']) / mib:.0f} MiB: "
        f"x{peak / (r['trunk_bytes'] + r['budget_bytes']):.2f} (limit x1.15: "
        f"{'within' if peak <= allowed else 'OVER'}); interpreter baseline "
        f"{r['base_kb'] / 1024:.0f} MiB, raw peak {r['hwm_kb'] / 1024:.0f} MiB"
    )
    print(f"  decode {r['decode_tps']:.1f} tok/s, hit rate {r['hit_rate']:.3f}")


def main() -> None:
    args = parse()
    if args.memory_child:
        memory_child(args.memory_child)
        return
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    sizes = _sizes(args.full)
    print(
        f"threads: OPENBLAS_NUM_THREADS={args.threads}, torch.get_num_threads()="
        f"{torch.get_num_threads()}; cpus: {os.cpu_count()}"
    )
    workdir = args.workdir or tempfile.mkdtemp(prefix="czyx-bench-", dir="/var/tmp")
    try:
        if not args.only or {"speed", "dial"} & set(args.only):
            speed_and_dial(args, sizes, workdir)
        if not args.only or "memory" in args.only:
            memory(args, sizes, workdir)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
