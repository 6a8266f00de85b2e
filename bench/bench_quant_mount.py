"""Quantize at mount speed: a quantizing mount's source GB/s, the C quantizer vs numpy.

Three measurements, one run, load average printed:

1. The quantizing mount of a checkpoint (``--model``, e.g. the real-shape one
   from ``bench/realshape.py``) under ``--policy``, with the process pinned to
   ``--cores`` cores (the C quantizer runs that many threads): source bytes
   per wall second and per CPU second (user and system). ``--mount-rounds``
   interleaved rounds of three variants in one run: the mount as it is
   ("one-pass": each tensor read, quantized, hashed and written into a pending
   block file in one pipelined pass), "two-pass" (the pipelined hash pass into
   an ``O_DIRECT`` spool, then a write pass reading it back) and the baseline
   "serial" (two-pass, the hash pass expert by expert, a buffered spool: the
   mount before the pipeline), all with the same quantizer; every round must
   publish the same selector. The source files are read once
   before every round so that each starts with the checkpoint in the page
   cache (the disk's own speed is not what is measured).
2. The quantizer alone on the same expert matrices, interleaved rounds: the C
   quantizer (``--cores`` threads) against the numpy reference
   (``quantize_reference``, the quantizer before this change) on ``--sample``
   experts; the ratio is of source weights per second, and both outputs are
   compared byte for byte. Beside it the quality of the search grid: the
   weighted squared error of the 5-point grid and of the previous 21-point
   grid (numpy reference, same groups), each relative to min-max.
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


def _warm(model: Path) -> None:
    """Read every file of the checkpoint once (into the page cache)."""
    for f in sorted(model.iterdir()):
        if f.is_file():
            with open(f, "rb", buffering=0) as fh:
                while fh.read(64 << 20):
                    pass


VARIANTS = ("serial", "two-pass", "one-pass")


def _variant(variant: str):
    """Context: the mount as ``variant`` ("one-pass": as it is; "two-pass": the pipelined
    hash pass, an ``O_DIRECT`` spool, then a write pass; "serial": the two-pass mount with
    its hash pass expert by expert and a buffered spool, the mount before the pipeline)."""
    import contextlib

    from czyx.store.models import mount as mm
    from czyx.store.models import mount_source as ms

    @contextlib.contextmanager
    def ctx():
        if variant == "one-pass":
            yield
            return
        real_pending = mm._can_write_pending
        real_hashes, real_init = ms.MountSource.expert_hashes, ms.Spool.__init__

        def hashes(self, keys):
            for k in keys:
                yield k, self.expert_hash(k)

        def init(self, *a, **k):
            real_init(self, *a, **k)
            if self._direct is not None:
                os.close(self._direct)
                self._direct = None

        mm._can_write_pending = lambda store: False
        if variant == "serial":
            ms.MountSource.expert_hashes, ms.Spool.__init__ = hashes, init
        try:
            yield
        finally:
            mm._can_write_pending = real_pending
            ms.MountSource.expert_hashes, ms.Spool.__init__ = real_hashes, real_init

    return ctx()


def bench_mount(model: Path, store_dir: Path, tag: str, policy: str, variant: str) -> dict:
    import shutil

    from czyx.store import Store
    from czyx.store.models.checkpoint import Checkpoint
    from czyx.store.models.mount import mount
    from czyx.store.quant.codec import QuantCodec
    from czyx.store.quant.policy import parse_policy

    with Checkpoint(model) as ck:
        source = sum(ck.info(n).nbytes for n in ck.names())
    shutil.rmtree(store_dir, ignore_errors=True)  # every round mounts from scratch
    _warm(model)
    with Store.open(store_dir) as store, _variant(variant):
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        res = mount(store, model, tag, quant=QuantCodec(parse_policy(policy)))
        wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    user, sys_ = r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime
    return {
        "variant": variant,
        "selector": res.selector.hex(),
        "source_bytes": source,
        "stored_bytes": res.bytes_total,
        "created": res.created,
        "wall_s": wall,
        "cpu_s": user + sys_,
        "user_s": user,
        "sys_s": sys_,
        "gb_s_wall": source / wall / 1e9,
        "gb_s_cpu": source / (user + sys_) / 1e9,
    }


def bench_grid(model: Path, groups: int = 32768) -> dict:
    """Weighted squared error / min-max's, 5-point grid vs the previous 21-point grid."""
    from czyx.store.models.checkpoint import Checkpoint, to_float32
    from czyx.store.quant import quantizer as Q

    with Checkpoint(model) as ck:
        name = sorted(n for n in ck.names() if ".mlp.experts." in n)[0]
        w = to_float32(np.array(ck.array(name)), ck.info(name).dtype)
    x = np.ascontiguousarray(w.reshape(-1, 32)[:groups])
    out = {}
    for bits in (8, 4):
        e_mm = Q.weighted_error(x, None, *Q.fit_groups(x, bits, method="minmax")).sum()
        e_new = Q.weighted_error(x, None, *Q.fit_groups(x, bits)).sum()
        saved = Q._RDELTA, Q._NSTEP
        Q._RDELTA, Q._NSTEP = 0.1, 20  # the previous grid, for this comparison only
        try:
            e_old = Q.weighted_error(x, None, *Q.fit_groups(x, bits)).sum()
        finally:
            Q._RDELTA, Q._NSTEP = saved
        out[f"q{bits}"] = {"new": float(e_new / e_mm), "old": float(e_old / e_mm)}
    return {"groups": int(x.shape[0]), "tensor": name, **out}


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
    ap.add_argument("--mount-rounds", type=int, default=1, help="interleaved rounds per variant")
    ap.add_argument("--md", default=None, help="write the report here")
    a = ap.parse_args(argv)
    os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[: a.cores]))
    load0 = os.getloadavg()
    q = bench_quantizer(Path(a.model), a.policy, a.sample, a.rounds, a.cores)
    print(json.dumps(q), flush=True)
    grid = bench_grid(Path(a.model))
    print(json.dumps(grid), flush=True)
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    sels = set()
    for _ in range(a.mount_rounds):
        for variant in VARIANTS:  # the one measured last is the one kept
            m = bench_mount(Path(a.model), Path(a.store), a.tag, a.policy, variant)
            print(json.dumps(m), flush=True)
            runs[variant].append(m)
            sels.add(m.pop("selector"))

    def med(variant: str, field: str) -> float:
        return float(np.median([r[field] for r in runs[variant]]))

    m = runs["one-pass"][0]
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
        f"Search grid quality on {grid['groups']} groups of `{grid['tensor']}` (numpy "
        "reference, no importance): weighted squared error relative to min-max, "
        f"q8 {grid['q8']['new']:.3f} with the 5-point grid vs {grid['q8']['old']:.3f} with the "
        f"previous 21-point grid; q4 {grid['q4']['new']:.3f} vs {grid['q4']['old']:.3f}.",
        "",
        f"Quantizing mount of `{a.model}` ({m['source_bytes'] / 1e9:.2f} GB of source, "
        f"{m['stored_bytes'] / 1e9:.2f} GB stored), median of {a.mount_rounds} interleaved "
        "rounds per variant, the source read into the page cache before each:",
        "",
        "| mount | wall s | source GB/s (wall) | CPU s (user + sys) | source GB/CPU-s "
        "| CPU-s per source GB |",
        "|---|---|---|---|---|---|",
        *(
            f"| {v} | {med(v, 'wall_s'):.1f} | {med(v, 'gb_s_wall'):.3f} | "
            f"{med(v, 'cpu_s'):.1f} ({med(v, 'user_s'):.1f} + {med(v, 'sys_s'):.1f}) | "
            f"{med(v, 'gb_s_cpu'):.3f} | {med(v, 'cpu_s') / m['source_bytes'] * 1e9:.2f} |"
            for v in reversed(VARIANTS)
        ),
        "",
        f"One-pass: **{med('one-pass', 'gb_s_wall'):.3f} GB/s** of source per wall second "
        f"({med('two-pass', 'wall_s') / med('one-pass', 'wall_s'):.2f}x the two-pass mount's, "
        f"{med('serial', 'wall_s') / med('one-pass', 'wall_s'):.2f}x the serial one's), "
        f"{med('one-pass', 'gb_s_cpu'):.3f} GB per CPU second "
        f"({med('two-pass', 'cpu_s') / med('one-pass', 'cpu_s'):.2f}x and "
        f"{med('serial', 'cpu_s') / med('one-pass', 'cpu_s'):.2f}x). Every round of every "
        f"variant published the same selector: {len(sels) == 1}.",
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
