"""Throughput of the vectorised curves and key packing against the public libraries.

Run from the repository root: ``python bench/bench_curves.py`` (about 15-30 s).

Every figure is a median of CPU time (``time.process_time``: user + system,
so time spent descheduled on a shared machine is not counted) over repeats,
and every ratio is against a baseline
measured in the same run on the same random coordinates:

- Morton (3-D, 61 bits an axis, the key's curve): ``zCurve.interlace`` /
  ``deinterlace`` (exact at 61 bits) and ``pymorton.interleave3`` (exact only up
  to 10 bits, so it is compared with our Morton at 10 bits);
- Hilbert (3-D, 61 bits): ``hilbertcurve`` (pure Python, exact at any width);
  ``numpy-hilbert-curve`` (vectorised numpy, limited to ndim*bits <= 64, so it
  is compared at 3 x 21 bits);
- key pack/unpack: a per-key Python loop ``bytes([c]) + zCurve.interlace(...)
  .to_bytes(23, "big")`` and our own scalar ``Key.pack``.

The pure-Python libraries are far too slow for a million points, so they are
timed on the first ``--sample`` rows and scaled per item (the script says so on
each line). Our numpy fallback (used when the C kernel is not built) is shown
too, timed on ``--np-sample`` rows. No BLAS is involved; single thread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hilbert as np_hilbert
import pymorton
import zCurve
from hilbertcurve.hilbertcurve import HilbertCurve as RefHilbert

from czyx.curves import HilbertCurve, MortonCurve, _native
from czyx.curves.hilbert import hilbert_decode_np, hilbert_encode_np
from czyx.curves.morton import deinterleave_np, interleave_np
from czyx.curves.words import words_to_ints
from czyx.key import Key, pack_keys, unpack_keys


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """Median CPU time (user + system) of ``fn()`` over ``repeats`` runs, after a warm-up.

    CPU time, not wall time: this machine's 2 cores are shared, and a
    single-threaded CPU-bound loop's CPU time does not count the time it spent
    descheduled. Both sides of every ratio are measured the same way.
    """
    fn()
    times = []
    for _ in range(repeats):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return statistics.median(times)


class Table:
    """Collects rows and prints them as they are measured."""

    def __init__(self) -> None:
        self.rows: list[dict[str, object]] = []

    def add(
        self, op: str, n: int, ours_s: float, base: str, base_n: int, base_s: float, goal: float
    ) -> None:
        ours_item = ours_s / n
        base_item = base_s / base_n
        ratio = base_item / ours_item
        row = {
            "op": op,
            "n": n,
            "ours_ms": ours_s * 1e3,
            "ours_M_per_s": n / ours_s / 1e6,
            "baseline": base,
            "baseline_n": base_n,
            "baseline_us_per_item": base_item * 1e6,
            "ratio": ratio,
            "goal": goal,
        }
        self.rows.append(row)
        mark = "" if not goal else f"  (goal >= {goal:g}x: {'met' if ratio >= goal else 'NOT met'})"
        print(
            f"{op:<30} {n:>9,} {ours_s * 1e3:9.1f} ms {n / ours_s / 1e6:8.2f} M/s | "
            f"{base:<34} n={base_n:<7,} {base_item * 1e6:9.3f} us/item | {ratio:8.1f}x{mark}",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1_000_000, help="coordinates (default 1M)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs of our code")
    ap.add_argument("--sample", type=int, default=2000, help="rows for the pure-Python libs")
    ap.add_argument("--np-sample", type=int, default=50_000, help="rows for numpy-hilbert-curve")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)

    n, reps, s = args.n, args.repeats, min(args.sample, args.n)
    rng = np.random.default_rng(args.seed)
    c61 = rng.integers(0, 1 << 61, size=(n, 3), dtype=np.uint64)
    c21 = rng.integers(0, 1 << 21, size=(n, 3), dtype=np.uint64)
    c10 = rng.integers(0, 1 << 10, size=(n, 3), dtype=np.uint64)
    cls = rng.integers(0, 256, size=n, dtype=np.uint8)
    kernel = "C (cffi)" if _native.LIB is not None else "numpy fallback"
    print(
        f"czyx curve benchmark: N={n:,}, repeats={reps} (median CPU time), kernel={kernel}, "
        f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')} (no BLAS used), "
        f"single thread; pure-Python baselines timed on the first {s:,} rows and scaled per item"
    )
    print(
        f"{'operation':<30} {'N':>9} {'ours (median)':>12} {'rate':>12} | "
        f"{'baseline (same run)':<34} {'sample':<9} {'baseline':>17} | ratio"
    )
    t = Table()
    base_reps = 3

    # ---- Morton, 3 x 61 bits
    m61 = MortonCurve(3, 61)
    w61 = m61.encode_array(c61)
    sample = c61[:s].tolist()
    zref = [zCurve.interlace(*reversed(p), dims=3, bits_per_dim=61) for p in sample]
    assert words_to_ints(w61[:s]) == zref, "Morton disagrees with zCurve"
    ours = median_time(lambda: m61.encode_array(c61), reps)
    base = median_time(
        lambda: [zCurve.interlace(*reversed(p), dims=3, bits_per_dim=61) for p in sample],
        base_reps,
    )
    t.add("morton3d-61 encode", n, ours, "zCurve.interlace", s, base, 50)
    ours = median_time(lambda: m61.decode_array(w61), reps)
    base = median_time(lambda: [zCurve.deinterlace(v, 3) for v in zref], base_reps)
    t.add("morton3d-61 decode", n, ours, "zCurve.deinterlace", s, base, 50)

    # ---- Morton, 3 x 10 bits against pymorton (exact only there)
    m10 = MortonCurve(3, 10)
    w10 = m10.encode_array(c10)
    s10 = c10[:s].tolist()
    pref = [pymorton.interleave3(x, y, z) for z, y, x in s10]
    assert w10[:s, 0].tolist() == pref, "Morton disagrees with pymorton"
    ours = median_time(lambda: m10.encode_array(c10), reps)
    base = median_time(lambda: [pymorton.interleave3(x, y, z) for z, y, x in s10], base_reps)
    t.add("morton3d-10 encode", n, ours, "pymorton.interleave3", s, base, 50)
    ours = median_time(lambda: m10.decode_array(w10), reps)
    base = median_time(lambda: [pymorton.deinterleave3(v) for v in pref], base_reps)
    t.add("morton3d-10 decode", n, ours, "pymorton.deinterleave3", s, base, 50)

    # ---- Hilbert, 3 x 61 bits against hilbertcurve
    h61 = HilbertCurve(3, 61)
    hw61 = h61.encode_array(c61)
    ref = RefHilbert(61, 3)
    href = ref.distances_from_points(sample)
    assert words_to_ints(hw61[:s]) == href, "Hilbert disagrees with hilbertcurve"
    ours = median_time(lambda: h61.encode_array(c61), reps)
    base = median_time(lambda: ref.distances_from_points(sample), base_reps)
    t.add("hilbert3d-61 encode", n, ours, "hilbertcurve distances_from_points", s, base, 100)
    ours = median_time(lambda: h61.decode_array(hw61), reps)
    base = median_time(lambda: ref.points_from_distances(href), base_reps)
    t.add("hilbert3d-61 decode", n, ours, "hilbertcurve points_from_distances", s, base, 100)

    # ---- Hilbert, 3 x 21 bits against numpy-hilbert-curve (vectorised numpy)
    h21 = HilbertCurve(3, 21)
    hw21 = h21.encode_array(c21)
    ns = min(args.np_sample, n)
    c21i = c21[:ns].astype(np.int64)
    nref = np_hilbert.encode(c21i, 3, 21)
    assert np.array_equal(hw21[:ns, 0], nref.astype(np.uint64)), "disagrees with numpy-hilbert"
    ours = median_time(lambda: h21.encode_array(c21), reps)
    base = median_time(lambda: np_hilbert.encode(c21i, 3, 21), base_reps)
    t.add("hilbert3d-21 encode", n, ours, "numpy-hilbert-curve encode", ns, base, 0)
    ours = median_time(lambda: h21.decode_array(hw21), reps)
    base = median_time(lambda: np_hilbert.decode(nref, 3, 21), base_reps)
    t.add("hilbert3d-21 decode", n, ours, "numpy-hilbert-curve decode", ns, base, 0)

    # ---- keys: 1M (class, z, y, x) -> (N, 24) bytes and back
    packed = pack_keys(cls, c61)
    kcls = cls[:s].tolist()

    def py_pack() -> list[bytes]:
        return [
            bytes((c,))
            + zCurve.interlace(*reversed(p), dims=3, bits_per_dim=61).to_bytes(23, "big")
            for c, p in zip(kcls, sample)
        ]

    assert [bytes(r) for r in packed[:s]] == py_pack(), "key pack disagrees with Python loop"
    pk = py_pack()
    ours = median_time(lambda: pack_keys(cls, c61), reps)
    base = median_time(py_pack, base_reps)
    t.add("key pack (morton)", n, ours, "python loop + zCurve.interlace", s, base, 50)
    keys = [Key(c, *p) for c, p in zip(kcls, sample)]
    base = median_time(lambda: [k.pack() for k in keys], base_reps)
    t.add("key pack (morton)", n, ours, "czyx scalar Key.pack", s, base, 0)
    ours = median_time(lambda: unpack_keys(packed), reps)
    base = median_time(
        lambda: [(b[0], zCurve.deinterlace(int.from_bytes(b[1:], "big"), 3)) for b in pk],
        base_reps,
    )
    t.add("key unpack (morton)", n, ours, "python loop + zCurve.deinterlace", s, base, 50)
    hcurve = HilbertCurve(3, 61)
    ours = median_time(lambda: pack_keys(cls, c61, hcurve), reps)
    base = median_time(
        lambda: [
            bytes((c,)) + d.to_bytes(23, "big")
            for c, d in zip(kcls, ref.distances_from_points(sample))
        ],
        base_reps,
    )
    t.add("key pack (hilbert)", n, ours, "python loop + hilbertcurve", s, base, 100)

    # ---- our numpy fallback (no C kernel), for reference
    nn = min(args.np_sample * 4, n)
    sub = c61[:nn]
    ours_np = median_time(lambda: interleave_np(sub, 61), 3)
    t.add(
        "numpy-path morton3d-61 encode",
        nn,
        ours_np,
        "zCurve.interlace",
        s,
        t.rows[0]["baseline_us_per_item"] * s / 1e6,
        0,
    )
    wsub = w61[:nn]
    ours_np = median_time(lambda: deinterleave_np(wsub, 3, 61), 3)
    t.add(
        "numpy-path morton3d-61 decode",
        nn,
        ours_np,
        "zCurve.deinterlace",
        s,
        t.rows[1]["baseline_us_per_item"] * s / 1e6,
        0,
    )
    ours_np = median_time(lambda: hilbert_encode_np(sub, 61), 3)
    t.add(
        "numpy-path hilbert3d-61 encode",
        nn,
        ours_np,
        "hilbertcurve distances_from_points",
        s,
        t.rows[4]["baseline_us_per_item"] * s / 1e6,
        0,
    )
    hsub = hw61[:nn]
    ours_np = median_time(lambda: hilbert_decode_np(hsub, 3, 61), 3)
    t.add(
        "numpy-path hilbert3d-61 decode",
        nn,
        ours_np,
        "hilbertcurve points_from_distances",
        s,
        t.rows[5]["baseline_us_per_item"] * s / 1e6,
        0,
    )

    missed = [r["op"] for r in t.rows if r["goal"] and r["ratio"] < r["goal"]]
    slow = [
        r["op"]
        for r in t.rows
        if r["op"].startswith(("morton3d-61", "key pack (morton)")) and r["ours_M_per_s"] < 20
    ]
    print(
        "goals (>= 50x / >= 100x the pure-Python libraries, > 20 M keys/s for Morton and key "
        "pack): " + ("all met" if not missed and not slow else f"NOT met: {missed + slow}")
    )
    if args.json:
        args.json.write_text(json.dumps({"kernel": kernel, "rows": t.rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
