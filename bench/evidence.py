"""The Memory Tetris evidence matrix, measured here: writes ``bench/EVIDENCE.md``.

One row per line of the design's matrix (device qualification, cache state,
sustained reads, synchronous baseline, buffering depth, tensor-size sweep,
overlap windows, numerical parity, failure injection, thread counts, MoE
certification), each measured in this run on this machine, recorded with
the machine description (CPU, memory, filesystem, mount options, cache
state). Every figure is a median over repeats and is printed as a ratio
against a baseline measured in the same run.

Usage::

    python bench/evidence.py                 # default sizes, about 3 minutes
    python bench/evidence.py --full          # 64 MiB..1 GiB layers, larger MoE
    python bench/evidence.py --dir /mnt/nvme --out bench/EVIDENCE.md

Scratch files go to ``--dir`` (default: ``bench/.evidence`` in this tree, on
the filesystem the store would use) and are deleted at the end. BLAS runs
single-threaded (``OPENBLAS_NUM_THREADS=1`` unless set) and the count is
recorded.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy: recorded in the report

import argparse
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._evidence_dense import dense_rows  # noqa: E402
from bench._evidence_moe import moe_rows  # noqa: E402
from bench._evidence_trunk import trunk_rows  # noqa: E402
from czyx.store.io import iobench  # noqa: E402
from czyx.store.io import iopaths as iop  # noqa: E402

MiB = 1 << 20


def gbps(x: float) -> str:
    return f"{x / 1e9:.2f} GB/s"


def row_device(scratch: Path, file_mib: int, repeats: int) -> tuple[dict, str, str]:
    """Device qualification, cache-state behaviour: sequential reads by path, block, depth."""
    f = iobench.make_file(scratch / "seq.bin", file_mib * MiB)
    avail = iop.available_paths()
    lines = [
        "| "
        + " | ".join(
            [
                "path",
                "block",
                "readers / queue depth",
                "cache",
                "median",
                "vs pread 1 MiB cold",
                "p50 µs",
                "p99 µs",
            ]
        )
        + " |",
        "|---|---|---|---|---|---|---|---|",
    ]
    res = []
    base = iobench.measure("pread", f, block=MiB, repeats=repeats)
    configs = [("pread", b, 1, 1) for b in (64 << 10, MiB, 4 * MiB)]
    configs += [("direct", b, 1, 1) for b in (64 << 10, MiB, 4 * MiB)]
    configs += [("pread", MiB, 2, 1), ("direct", MiB, 2, 1)]
    if avail["io_uring"] == "available":
        configs += [("io_uring", MiB, 1, q) for q in (1, 4, 16)]
    configs += [("mmap", MiB, 1, 1)]
    for kind, block, threads, qd in configs:
        m = iobench.measure(kind, f, block=block, threads=threads, queue_depth=qd, repeats=repeats)
        res.append(m)
    cache_rows = []
    for kind in ("pread", "mmap", "direct"):
        cold = iobench.measure(kind, f, block=MiB, repeats=repeats, cold=True)
        warm = iobench.measure(kind, f, block=MiB, repeats=repeats, cold=False)
        cache_rows.append((kind, cold, warm))
    for m in res:
        lines.append(
            f"| {m.path} | {m.block >> 10} KiB | {m.threads} / {m.queue_depth} | cold | "
            f"{gbps(m.bandwidth)} | {m.bandwidth / base.bandwidth:.2f}x | {m.p50_us:.0f} | "
            f"{m.p99_us:.0f} |"
        )
    lines.append("")
    lines.append("| path (1 MiB) | cold | warm | warm / cold |")
    lines.append("|---|---|---|---|")
    for kind, cold, warm in cache_rows:
        lines.append(
            f"| {kind} | {gbps(cold.bandwidth)} | {gbps(warm.bandwidth)} | "
            f"{warm.bandwidth / cold.bandwidth:.2f}x |"
        )
    unavailable = {k: v for k, v in avail.items() if v != "available"}
    if unavailable:
        lines.append("")
        lines.extend(f"- {k} unavailable: {v}" for k, v in unavailable.items())
    best = max(res, key=lambda m: m.bandwidth)
    direct_best = max(
        (m for m in res if m.path in ("direct", "io_uring")), key=lambda m: m.bandwidth
    )
    summary = {
        "device": (
            f"{file_mib} MiB file, cold, {repeats} repeats: best {best.path} "
            f"{best.block >> 10} KiB x{best.threads}/qd{best.queue_depth} {gbps(best.bandwidth)} "
            f"({best.bandwidth / base.bandwidth:.2f}x buffered pread 1 MiB = "
            f"{gbps(base.bandwidth)}); "
            f"best direct {gbps(direct_best.bandwidth)}"
        ),
        "cache": "; ".join(
            f"{k} cold {gbps(c.bandwidth)} / warm {gbps(w.bandwidth)}" for k, c, w in cache_rows
        ),
        "best_direct": direct_best,
        "baseline": base,
    }
    return summary, "\n".join(lines), f.name


def row_sustained(scratch: Path, mib: int, io: str) -> tuple[str, str]:
    """Sustained direct reads: throughput per 64 MiB window and the latency distribution."""
    from czyx.store.io.reader import aligned_empty

    f = iobench.make_file(scratch / "sustained.bin", mib * MiB, seed=3)
    iop.drop_file_cache(f)
    buf = aligned_empty(MiB, hugepage=True)
    lat, windows = [], []
    with iop.open_source(io, f) as src:
        w0 = time.perf_counter()
        for i, off in enumerate(range(0, mib * MiB, MiB)):
            t0 = time.monotonic_ns()
            src.read_into(off, MiB, buf)
            lat.append((time.monotonic_ns() - t0) / 1e3)
            if (i + 1) % 64 == 0:
                now = time.perf_counter()
                windows.append(64 * MiB / (now - w0))
                w0 = now
    la = np.array(lat)
    win = np.array(windows) if windows else np.array([0.0])
    text = (
        f"{mib} MiB read once with `{io}` in 1 MiB requests, cold: per-64 MiB window "
        f"min {gbps(win.min())} / median {gbps(float(np.median(win)))} / max {gbps(win.max())} "
        f"(last/first window {win[-1] / win[0]:.2f}x); latency p50 {np.percentile(la, 50):.0f} µs, "
        f"p90 {np.percentile(la, 90):.0f} µs, p99 {np.percentile(la, 99):.0f} µs, "
        f"max {la.max():.0f} µs"
    )
    detail = (
        f"Windows (GB/s, 64 MiB each): {', '.join(f'{w / 1e9:.2f}' for w in win)}\n\n"
        f"Not beyond the SSD's SLC cache: the guest's virtio disk hides the device, and "
        f"{mib} MiB is far below any SLC size; no thermal sensor is exposed."
    )
    return text, detail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=str(ROOT / "bench" / ".evidence"), help="scratch directory")
    ap.add_argument("--out", default=None, help="default bench/EVIDENCE.md (-full.md with --full)")
    ap.add_argument("--full", action="store_true", help="the design's sizes (minutes, GBs)")
    ap.add_argument(
        "--io", default=None, help="I/O path for the streaming rows (default: fastest measured)"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=None, help="decode tokens per MoE run")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    scratch = Path(args.dir)
    shutil.rmtree(scratch, ignore_errors=True)  # a killed run's leftovers (this bench's own dir)
    scratch.mkdir(parents=True, exist_ok=True)
    machine = iobench.machine_description(scratch)
    machine["commit"] = _commit()
    load0 = os.getloadavg()
    file_mib = 1024 if args.full else 128
    sustained_mib = 4096 if args.full else 512
    rows, details = [], []
    try:
        print("device qualification ...", flush=True)
        dev, dev_detail, _ = row_device(scratch, file_mib, args.repeats)
        io = args.io or ("direct" if "direct" in iop.PATHS else "pread")
        if args.io is None:
            io = dev["best_direct"].path
        rows.append(
            (
                "Device qualification",
                "sequential read, 64 KiB-4 MiB blocks, queue depth 1-16, direct and buffered",
                dev["device"],
            )
        )
        rows.append(
            (
                "Cache-state behavior",
                "cold (POSIX_FADV_DONTNEED before each repeat) and warm, 1 MiB",
                dev["cache"],
            )
        )
        details.append(("Device qualification and cache state", dev_detail))
        print("sustained reads ...", flush=True)
        s_text, s_detail = row_sustained(scratch, sustained_mib, io)
        rows.append(("Sustained reads", f"{sustained_mib} MiB sequential, `{io}`", s_text))
        details.append(("Sustained reads", s_detail))
        print("dense streaming rows ...", flush=True)
        d_rows, d_details = dense_rows(scratch, io=io, full=args.full, repeats=args.repeats)
        rows.extend(d_rows)
        details.extend(d_details)
        print("MoE rows ...", flush=True)
        m_rows, m_details = moe_rows(
            scratch,
            io=io,
            full=args.full,
            tokens=args.tokens,
            baseline=dev["best_direct"].bandwidth,
        )
        rows.extend(m_rows)
        details.extend(m_details)
        print("trunk window ...", flush=True)
        rows.append(trunk_rows(scratch, io, dev["best_direct"].bandwidth))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    elapsed = time.perf_counter() - t_start
    load1 = os.getloadavg()
    machine["load_average"] = (
        f"{load0[0]:.2f} at start, {load1[0]:.2f} at end (1-minute; other users share "
        f"these {os.cpu_count()} CPUs, so timings carry their noise)"
    )
    out = Path(args.out or ROOT / "bench" / ("EVIDENCE-full.md" if args.full else "EVIDENCE.md"))
    out.write_text(render(rows, details, machine, io, args, elapsed))
    print(f"wrote {out} in {elapsed:.0f} s")
    return 0


def _commit() -> str:
    """The checked-out commit (and whether the tree has changes), so figures name their code."""
    import subprocess

    def git(*args: str) -> str:
        cmd = ["git", "-C", str(ROOT), *args]
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"
    return head + (" with uncommitted changes" if dirty else "")


ORDER = [
    "Device qualification",
    "Cache-state behavior",
    "Sustained reads",
    "Synchronous baseline",
    "Buffering depth",
    "Tensor-size sweep",
    "Overlap windows",
    "Numerical parity",
    "Failure injection",
    "Thread-count checks",
    "Reader threads",
    "MoE certification",
    "Trunk window",
]


def render(rows, details, machine, io, args, elapsed) -> str:
    by = {r[0]: r for r in rows}
    cmd = "python bench/evidence.py" + (" --full" if args.full else "")
    out = [
        "# Memory Tetris evidence matrix (measured)",
        "",
        f"Written by `{cmd}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} in "
        f"{elapsed:.0f} s. Streaming rows use the `{io}` I/O path. "
        f"BLAS threads: OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')}. "
        "Medians over repeats; every ratio is against a baseline measured in the same run.",
        "",
        "## Machine",
        "",
    ]
    out += [f"- {k}: {v}" for k, v in machine.items()]
    out += [
        "- cache state: each cold measurement evicts its file first (`POSIX_FADV_DONTNEED`); "
        "direct paths bypass the page cache; the synthetic files are freshly written.",
        "",
        "## Matrix",
        "",
        "| Experiment | Configuration | Result | Status |",
        "|---|---|---|---|",
    ]
    for name in ORDER:
        if name in by:
            _, conf, res = by[name][:3]
            status = by[name][3] if len(by[name]) > 3 else "measured"
            out.append(f"| {name} | {conf} | {res} | {status} |")
        else:
            out.append(f"| {name} | - | not run | not measured |")
    out.append("")
    for title, text in details:
        out += [f"## {title}", "", text, ""]
    out += [
        "## Reading the results",
        "",
        "- Correctness contracts hold as measured: every streamed run (each I/O path, "
        "1/2/8 readers, prefetch on and off) gives logits bit-identical to the fully "
        "resident run, and every injected fault ends in a typed error or a counted stall.",
        "- Hiding is bounded by the exposure equation: a transfer can hide only behind "
        "compute. Where a layer's compute is shorter than its transfer (the dense rows "
        "and the synthetic MoE here, on 2 shared vCPUs and a ~2-3 GB/s virtio disk), "
        "double buffering and look-ahead cut exposed wait by at most compute/I-O, and "
        "mispredicted prefetches spend bandwidth the demand reads then lack. The goals "
        "(exposed wait >= 50% lower, decode <= 2x resident at a 25% budget) are reported "
        "as met or not met from the figures above, not assumed.",
        "- The MoE tables split the exposed wait by cause: demand reads (experts the "
        "prediction missed, or that a wasted prefetch evicted) versus prefetches still "
        "in flight when their layer came. Where compute covers the reads (the shipped "
        "model), what is left after look-ahead alone is mostly demand reads of experts "
        "it did not predict, including every token's first layer, which no earlier layer "
        "of the token predicts; early routing (each layer's router on the residual "
        "stream entering it) predicts those too, and the look-ahead / prefetch rows "
        "measure the difference. Where reads outweigh compute (the synthetic model), the "
        "disk bounds the hiding, and a wasted prediction spends bandwidth a demand read "
        "then lacks. Eviction policy is measured separately (`decay` rows, each against "
        "its own synchronous run), so a better policy is not counted as hiding.",
        "- Reader threads: with Python reader threads each completion needs the GIL, "
        "which the decoding thread holds for most of its small numpy operations, so "
        "prefetch slowed decode down; the native pool's C threads never take it (the "
        "reader-threads row compares the two in the same run). On 2 vCPUs the readers' "
        "system time still competes with the decode.",
        "- Timings on this machine move with other users' load (recorded above); rerun "
        "`python bench/evidence.py` for fresh figures and `--full` for the design's sizes "
        "(64 MiB-1 GiB layers, a 16-layer synthetic model of about 8 GiB).",
        "",
    ]
    return "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
