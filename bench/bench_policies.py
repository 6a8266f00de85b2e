"""Eviction policies in the real engine against LRU, and against their replay simulation.

Run from the repository root: ``python bench/bench_policies.py`` (under 2
minutes on 2 cores) or ``python bench/bench_policies.py --full`` (4 files x
2048 bytes, about 11 minutes). Figures and their reading: ``bench/POLICIES.md``.

The bundled trained model (``inference/assets/czyx-moe-stdlib``) is mounted
into a temporary store and opened as ``czyx run`` opens it: through the
owner's portal, O_DIRECT expert reads, the engine's default streaming cache
(demand reads only, so misses equal reads). The text is held-out standard
library source (the training script's validation files, never trained on):
the first ``--bytes`` bytes of each of the first ``--files`` validation
files, each file decoded token by token (teacher-forced) from an empty
context, the expert cache staying warm across files; every run starts cold.

For each budget (12.5, 25, 50 % of the expert bytes) and policy (LRU, the
baseline of the same run; LFU; decay; SLRU) it prints the engine's hit rate,
KiB read per token and decode tokens/s (median over ``--repeats`` interleaved
repeats), each as a ratio to LRU at that budget; and the replay simulation's
hit rate (:mod:`inference.locality.replay`) on the routing trace of the same
tokens (recorded by a fully resident run), with Belady's optimum as the bound.
The replay serves requests one at a time; the engine looks up all of a
layer's resident experts before filling its misses (a miss never evicts an
expert the same token needs there), so for LRU it is compared with the
replay of that order (:func:`lru_hits_first`), which it must equal exactly;
the sequential replay is shown beside it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
ASSET = ROOT / "inference/assets/czyx-moe-stdlib"
TAG = "czyx-moe-stdlib@policies"
POLICIES = ("lru", "lfu", "decay", "slru")
REPLAY_NAME = {"lru": "lru", "decay": "hotness", "slru": "slru"}
VAL_THRESHOLD = 13  # tools/train_moe.py: a file is validation when sha256(relpath)[0] < 13


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=4, help="held-out files decoded")
    ap.add_argument("--bytes", type=int, default=384, help="first bytes of each file")
    ap.add_argument("--repeats", type=int, default=3, help="repeats (median tokens/s)")
    ap.add_argument(
        "--budgets", default="0.125,0.25,0.5", help="expert budgets, fractions of expert bytes"
    )
    ap.add_argument("--threads", type=int, default=1, help="OPENBLAS_NUM_THREADS")
    ap.add_argument("--full", action="store_true", help="4 files x 2048 bytes, 3 repeats")
    ap.add_argument("--workdir", help="scratch directory (default: a new one in /var/tmp)")
    args = ap.parse_args(argv)
    if args.full:
        args.files, args.bytes, args.repeats = 4, 2048, 3
    return args


def held_out_texts(n_files: int, n_bytes: int) -> list[tuple[str, bytes]]:
    """The first ``n_bytes`` of the first ``n_files`` validation files (sorted by path)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rels = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "dist-packages" not in p.parts and p.is_file()
    )
    out = []
    for rel in rels:
        if hashlib.sha256(rel.encode()).digest()[0] < VAL_THRESHOLD:
            data = (root / rel).read_bytes()[:n_bytes]
            if len(data) == n_bytes:
                out.append((rel, data))
        if len(out) == n_files:
            break
    return out


def lru_hits_first(experts, n_experts: int, budget: int) -> float:
    """Hit rate of an LRU fed each layer group ``experts[t, l]`` resident experts first.

    The order of :meth:`czyx.inference.cache.ExpertCache.acquire`: a group's
    resident experts are all touched (held) before its misses pick victims
    among the others, least recent first.
    """
    from collections import OrderedDict

    cache: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    t_, l_, _ = experts.shape
    for t in range(t_):
        for layer in range(l_):
            group = [layer * n_experts + int(e) for e in experts[t, layer]]
            for x in group:
                if x in cache:
                    cache.move_to_end(x)
                    hits += 1
            for x in group:
                if x not in cache:
                    if len(cache) >= budget:
                        del cache[next(k for k in cache if k not in group)]
                    cache[x] = None
            total += len(group)
    return hits / total


def decode_texts(engine, texts: list[bytes], recorder=None) -> float:
    """Decode every text token by token from an empty context; returns decode seconds."""
    seconds = 0.0
    for text in texts:
        engine.reset()
        if recorder is not None:
            recorder.new_segment(len(text))
        t0 = time.perf_counter()
        for b in text:
            engine.decode(b)
        seconds += time.perf_counter() - t0
    return seconds


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    import numpy as np

    from czyx.inference.engine import Engine
    from czyx.inference.locality import replay
    from czyx.inference.opened import OpenedModel
    from czyx.inference.options import EngineOptions
    from czyx.inference.profile import RouteRecorder
    from czyx.inference.trace import text_sha256
    from czyx.store import Store
    from czyx.store.models.mount import mount

    budgets = [float(b) for b in args.budgets.split(",")]
    files = held_out_texts(args.files, args.bytes)
    texts = [d for _, d in files]
    n_tok = sum(len(t) for t in texts)
    print(f"threads: OPENBLAS_NUM_THREADS={args.threads}; cpus: {os.cpu_count()}")
    print(
        f"text: first {args.bytes} B of {len(files)} held-out stdlib files "
        f"({', '.join(r for r, _ in files)}): {n_tok} decode tokens per run"
    )
    workdir = args.workdir or tempfile.mkdtemp(prefix="czyx-policies-", dir="/var/tmp")
    t_start = time.perf_counter()
    try:
        store_dir = os.path.join(workdir, "store")
        with Store.open(store_dir) as st:
            mount(st, ASSET, TAG)
        opened = OpenedModel(store_dir, TAG, None)
        try:
            consumer = opened.consumer
            # The routing trace of these tokens, from a fully resident run (routing does
            # not depend on the budget: tiered runs are bit-identical).
            full = Engine(consumer, cache_fraction=1.0)
            cfg = full.cfg
            rec = RouteRecorder(cfg.sparse_layers, cfg.n_experts, cfg.top_k)
            full.model.recorder = rec
            resident_s = decode_texts(full, texts, rec)
            full.close()
            trace = rec.trace(
                TAG,
                text_sha256(b"".join(texts)),
                "topk_renormalized" if cfg.renormalize else "softmax",
            )
            slot = None
            rows: dict[tuple[float, str], dict] = {}
            for rep in range(args.repeats):
                for frac in budgets:
                    # Interleaved: each repeat runs every policy once, in a rotated order.
                    order = POLICIES[rep % len(POLICIES) :] + POLICIES[: rep % len(POLICIES)]
                    for pol in order:
                        eng = Engine(
                            consumer,
                            cache_fraction=frac,
                            options=EngineOptions(policy=pol, prefetch=False),
                        )
                        try:
                            secs = decode_texts(eng, texts)
                            s = eng.stats()
                        finally:
                            eng.close()
                        slot = s.slot_nbytes
                        r = rows.setdefault((frac, pol), dict(n_slots=s.n_slots, stats=s, tps=[]))
                        if (s.hits, s.misses) != (r["stats"].hits, r["stats"].misses):
                            raise RuntimeError(f"{pol} at {frac}: hits differ between repeats")
                        r["tps"].append(n_tok / secs)
            print(
                f"model: {cfg.n_layers} layers x {cfg.n_experts} experts, top-{cfg.top_k}, "
                f"slot {slot} B; resident decode {n_tok / resident_s:.0f} tok/s (one run); "
                f"medians of {args.repeats} repeats"
            )
            print()
            head = (
                "| budget | policy | slots | engine hits | vs LRU | replay hits "
                "| hits-first replay | engine - replay "
                "| KiB read/token | vs LRU | decode tok/s | vs LRU |"
            )
            print(head)
            print("|" + " --- |" * (head.count("|") - 1))
            for frac in budgets:
                base = rows[(frac, "lru")]
                base_tps = statistics.median(base["tps"])
                for pol in (*POLICIES, "belady"):
                    n_slots = base["n_slots"]
                    sim = None
                    seq = None
                    if pol in REPLAY_NAME or pol == "belady":
                        name = REPLAY_NAME.get(pol, pol)
                        seq = sim = float(np.mean(replay.replay(trace, name, n_slots)))
                    if pol == "lru":
                        sim = lru_hits_first(trace.experts, cfg.n_experts, n_slots)
                    if pol == "belady":
                        print(
                            f"| {frac:.1%} | belady (bound) | {n_slots} | - | - | {sim:.3f} "
                            "| - | - | - | - | - | - |"
                        )
                        continue
                    r = rows[(frac, pol)]
                    s = r["stats"]
                    tps = statistics.median(r["tps"])
                    kib = s.bytes_read / n_tok / 1024
                    base_kib = base["stats"].bytes_read / n_tok / 1024
                    seq_s = "-" if seq is None else f"{seq:.3f}"
                    sim_s = "-" if pol != "lru" else f"{sim:.3f}"
                    diff = "-" if sim is None else f"{s.hit_rate - sim:+.3f}"
                    b_hit = base["stats"].hit_rate
                    hit_ratio = s.hit_rate / b_hit if b_hit else float("inf")
                    print(
                        f"| {frac:.1%} | {pol} | {s.n_slots} | {s.hit_rate:.3f} "
                        f"| {hit_ratio:.2f}x "
                        f"| {seq_s} | {sim_s} | {diff} | {kib:.0f} | {kib / base_kib:.2f}x "
                        f"| {tps:.0f} | {tps / base_tps:.2f}x |"
                    )
        finally:
            opened.close()
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"\nwall time {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
