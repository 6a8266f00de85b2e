"""Quantize at mount speed: a quantizing mount's source GB/s, the C quantizer vs numpy.

Three measurements, one run, load average printed:

1. The quantizing mount of a checkpoint (``--model``, e.g. the real-shape one
   from ``bench/realshape.py``) under ``--policy``, with the process pinned to
   ``--cores`` cores (the C quantizer runs that many threads): source bytes
   per wall second and per CPU second.
2. The quantizer alone on the same expert matrices, interleaved rounds: the C
   quantizer (``--cores`` threads) against the numpy reference
   (``quantize_reference``, the quantizer before this change) on ``--sample``
   experts; the ratio is of source weights per second, and both outputs are
   compared byte for byte.
3. Resident memory: a subprocess opens the quantized version with every expert
   prewarmed into the slot cache and runs a short prefill; its peak RSS
   (``VmHWM``) minus the RSS it had after imports, against the version's
   stored bytes (experts + trunk as stored).

Usage::

    python bench/bench_quant_mount.py --model /work/data/rs/hf --store /work/data/rs/store \\
        --tag rs@q8 --cores 2 --sample 2 --md bench/QUANT_MOUNT.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

POLICY_Q8 = (
    "q4-all,expert=q8,attention=q8,shared_expert=q8,dense_mlp=q8,embed=q8,lm_head=q8,router=f32"
)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def bench_mount(model: Path, store_dir: Path, tag: str, policy: str) -> dict:
    from czyx.store import Store
    from czyx.store.models.checkpoint import Checkpoint
    from czyx.store.models.mount import mount
    from czyx.store.quant.codec import QuantCodec
    from czyx.store.quant.policy import parse_policy

    with Checkpoint(model) as ck:
        source = sum(ck.info(n).nbytes for n in ck.names())
    with Store.open(store_dir) as store:
        c0, t0 = _cpu(), time.perf_counter()
        res = mount(store, model, tag, quant=QuantCodec(parse_policy(policy)))
        wall, cpu = time.perf_counter() - t0, _cpu() - c0
    return {
        "source_bytes": source,
        "stored_bytes": res.bytes_total,
        "created": res.created,
        "wall_s": wall,
        "cpu_s": cpu,
        "gb_s_wall": source / wall / 1e9,
        "gb_s_cpu": source / cpu / 1e9,
    }


def bench_quantizer(model: Path, policy: str, sample: int, rounds: int, cores: int) -> dict:
    from czyx.store.models.checkpoint import Checkpoint, to_float32
    from czyx.store.quant.formats import quantize, quantize_reference
    from czyx.store.quant.policy import parse_policy

    fmt = parse_policy(policy).format_for("expert")
    mats = []
    with Checkpoint(model) as ck:
        names = sorted(n for n in ck.names() if ".mlp.experts." in n)[: 3 * sample]
        for n in names:
            info = ck.info(n)
            mats.append((np.array(ck.array(n)), info.dtype))
    weights = sum(m.size for m, _ in mats)
    src_bytes = sum(m.nbytes for m, _ in mats)
    c_t, n_t, c_cpu, n_cpu = [], [], [], []
    same = True
    for _ in range(rounds):
        t0, p0 = time.perf_counter(), time.process_time()
        outs = [quantize(m, fmt, dtype=dt, threads=cores) for m, dt in mats]
        c_t.append(time.perf_counter() - t0)
        c_cpu.append(time.process_time() - p0)
        t0, p0 = time.perf_counter(), time.process_time()
        refs = [quantize_reference(to_float32(m, dt), fmt) for m, dt in mats]
        n_t.append(time.perf_counter() - t0)
        n_cpu.append(time.process_time() - p0)
        same &= all(np.array_equal(a, b) for a, b in zip(outs, refs))
    c, n = float(np.median(c_t)), float(np.median(n_t))
    cc, nc = float(np.median(c_cpu)), float(np.median(n_cpu))
    return {
        "format": str(fmt),
        "matrices": len(mats),
        "weights": weights,
        "c_s": c,
        "numpy_s": n,
        "c_gb_s": src_bytes / c / 1e9,
        "numpy_gb_s": src_bytes / n / 1e9,
        "ratio": n / c,
        "c_cpu_s": cc,
        "numpy_cpu_s": nc,
        "c_gb_cpu_s": src_bytes / cc / 1e9,
        "numpy_gb_cpu_s": src_bytes / nc / 1e9,
        "ratio_cpu": nc / cc,
        "identical": bool(same),
    }


_RESIDENT = r"""
import json, sys
from pathlib import Path
def rss():
    for line in Path('/proc/self/status').read_text().splitlines():
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) * 1024
from czyx.inference.engine import Engine
from czyx.inference.opened import OpenedModel
import numpy as np
base = rss()
with OpenedModel(sys.argv[1], sys.argv[2], None) as m:
    info = m.consumer.info
    hot = [(l, e) for l in range(info.n_layers) for e in range(info.n_experts)]
    eng = Engine(m.consumer, cache_fraction=1.0, stream=None, hot=hot)
    eng.prefill(list(range(3, 35)))
    eng.cache.close()
    hwm = [int(x.split()[1]) * 1024 for x in Path('/proc/self/status').read_text().splitlines()
           if x.startswith('VmHWM:')][0]
print(json.dumps({"base_rss": base, "hwm": hwm, "expert_bytes": eng.expert_bytes}))
"""


def bench_resident(store_dir: Path, tag: str) -> dict:
    from czyx.store import Store
    from czyx.store.models.mount import summarize

    with Store.open(store_dir, create=False) as store:
        s = summarize(store, tag)
    stored = s["experts"] * s["expert_bytes"] + s["trunk_bytes"]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _RESIDENT, str(store_dir), tag],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    held = r["hwm"] - r["base_rss"]
    return {
        **r,
        "stored_bytes": stored,
        "trunk_bytes": s["trunk_bytes"],
        "held": held,
        "ratio": held / stored,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="HF checkpoint directory")
    ap.add_argument("--store", required=True, help="store directory (created)")
    ap.add_argument("--tag", default="rs@q8")
    ap.add_argument("--policy", default=POLICY_Q8)
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--sample", type=int, default=2, help="experts for the numpy comparison")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--md", default=None, help="write the report here")
    a = ap.parse_args(argv)
    os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[: a.cores]))
    load0 = os.getloadavg()
    q = bench_quantizer(Path(a.model), a.policy, a.sample, a.rounds, a.cores)
    print(json.dumps(q), flush=True)
    m = bench_mount(Path(a.model), Path(a.store), a.tag, a.policy)
    print(json.dumps(m), flush=True)
    r = bench_resident(Path(a.store), a.tag)
    print(json.dumps(r), flush=True)
    load1 = os.getloadavg()
    cmd = "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    lines = [
        "# Quantizing mount (generated by bench/bench_quant_mount.py)",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} vCPUs "
        f"(shared with other jobs), pinned to {a.cores} cores; load average "
        f"{load0[0]:.1f} before, {load1[0]:.1f} after.",
        f"Command: `{cmd}`",
        "",
        f"Quantizer alone, {q['matrices']} expert matrices ({q['weights'] / 1e6:.1f} M weights, "
        f"format {q['format']}), median of {a.rounds} interleaved rounds (wall):",
        "",
        "| quantizer | wall s | source GB/s (wall) | vs numpy | CPU s | source GB/CPU-s "
        "| vs numpy |",
        "|---|---|---|---|---|---|---|",
        f"| C, {a.cores} threads | {q['c_s']:.2f} | {q['c_gb_s']:.3f} | {q['ratio']:.1f}x | "
        f"{q['c_cpu_s']:.2f} | {q['c_gb_cpu_s']:.3f} | {q['ratio_cpu']:.1f}x |",
        f"| numpy reference | {q['numpy_s']:.2f} | {q['numpy_gb_s']:.4f} | 1.0x | "
        f"{q['numpy_cpu_s']:.2f} | {q['numpy_gb_cpu_s']:.4f} | 1.0x |",
        "",
        f"Same bytes: {q['identical']}.",
        "",
        f"Quantizing mount of `{a.model}` ({m['source_bytes'] / 1e9:.2f} GB of source, "
        f"{m['stored_bytes'] / 1e9:.2f} GB stored): {m['wall_s']:.0f} s wall, {m['cpu_s']:.0f} "
        f"CPU-s: **{m['gb_s_wall']:.3f} GB/s** of source per wall second, "
        f"{m['gb_s_cpu']:.3f} GB/s per CPU second.",
        "",
        f"Resident quantized version ({a.tag}, every expert prewarmed): peak RSS "
        f"{r['hwm'] / 2**20:.0f} MiB, {r['base_rss'] / 2**20:.0f} MiB after imports; held "
        f"{r['held'] / 2**20:.0f} MiB for {r['stored_bytes'] / 2**20:.0f} MiB stored "
        f"(trunk {r['trunk_bytes'] / 2**20:.0f} MiB): **{r['ratio']:.2f}x** stored bytes.",
        "",
    ]
    if a.md:
        Path(a.md).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
