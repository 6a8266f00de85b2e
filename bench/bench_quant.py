"""Quantized formats: bytes per format, and matvec / small-matmul throughput of the C kernels.

Every figure is a ratio against baselines measured in the same run, on the
same matrix: numpy's fp32 ``W @ x`` (OpenBLAS, thread count recorded and
defaulting to 1, the same as the single-threaded kernel) and a numpy copy of
the fp32 matrix (the machine's memory bandwidth). Times are medians.

Two sizes by default: one whose fp32 matrix stays in the last-level cache and
one that does not (the case of a model's weights). ``--full`` uses the larger
size the issue's goal is about (8192 x 8192). Codes come from min-max
quantization of Gaussian weights; the kernels' speed does not depend on the
code values.

Run: ``python bench/bench_quant.py`` (``--full`` for the large size).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads OpenBLAS

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from czyx.inference.kernels import prepare, simd_level
from czyx.inference.kernels.ops import SIMD_LEVELS, set_simd_cap
from czyx.store.quant.formats import FORMATS, quantize

FORMAT_ORDER = ("q2", "q3", "q4", "q8")


#: The clock of every figure: CPU time of this process by default (the kernels
#: and single-threaded BLAS run on this thread, so CPU time excludes the time
#: other processes on a shared machine take), wall time with ``--clock wall``
#: or when BLAS runs more than one thread (CPU time would sum its threads).
CLOCK = {"cpu": time.process_time, "wall": time.perf_counter}
_clock = time.process_time


def median_time(fn: Callable[[], object], reps: int) -> float:
    """Median time of ``fn`` over ``reps`` runs after one warm-up (see :data:`CLOCK`)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = _clock()
        fn()
        times.append(_clock() - t0)
    return float(np.median(times))


def bytes_table(rows: int, cols: int) -> None:
    n = rows * cols
    print(f"\n## Bytes of one [{rows} x {cols}] matrix")
    print(f"{'format':8} {'bytes':>12} {'bits/weight':>12} {'vs fp32':>8} {'vs fp16':>8}")
    print(f"{'fp32':8} {4 * n:12d} {32.0:12.2f} {1.0:8.3f} {2.0:8.3f}")
    print(f"{'fp16':8} {2 * n:12d} {16.0:12.2f} {0.5:8.3f} {1.0:8.3f}")
    for name in FORMAT_ORDER:
        b = FORMATS[name].nbytes(rows, cols)
        print(f"{name:8} {b:12d} {8 * b / n:12.2f} {b / (4 * n):8.3f} {b / (2 * n):8.3f}")


def bench_size(rows: int, cols: int, reps: int, batch: int, portable: bool) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    x = rng.standard_normal(cols).astype(np.float32)
    xb = rng.standard_normal((batch, cols)).astype(np.float32)
    y = np.empty(rows, np.float32)
    yb = np.empty((batch, rows), np.float32)
    dst = np.empty_like(w)

    t_copy = median_time(lambda: np.copyto(dst, w), reps)
    t_f32 = median_time(lambda: np.dot(w, x, out=y), reps)
    t_f32b = median_time(lambda: np.dot(xb, w.T, out=yb), reps)
    bw = w.nbytes / t_copy
    print(f"\n## [{rows} x {cols}], fp32 matrix {w.nbytes / 2**20:.0f} MiB")
    print(
        f"baseline copy    : {bw / 1e9:7.2f} GB/s "
        "(bytes copied / s; each byte read once, written once)"
    )
    print(
        f"baseline fp32 mv : {w.nbytes / t_f32 / 1e9:7.2f} GB/s of weights, "
        f"{rows / t_f32 / 1e6:7.3f} M rows/s ({w.nbytes / t_f32 / bw:.2f}x copy bandwidth)"
    )
    print(f"baseline fp32 mm : B={batch}, {rows * batch / t_f32b / 1e6:7.3f} M row-vectors/s")
    hdr = (
        f"{'format':7} {'path':10} {'GB/s wts':>9} {'M rows/s':>9} {'rows/s vs fp32':>15} "
        f"{'wts vs copy':>12} {'mm B=' + str(batch) + ' vs fp32 mm':>18} {'mm vs B matvecs':>16}"
    )
    print(hdr)
    best = simd_level()
    lower = [lv for lv in SIMD_LEVELS[: SIMD_LEVELS.index(best)]] if best in SIMD_LEVELS else []
    paths = [best] + (lower[::-1] if portable else [])
    for name in FORMAT_ORDER:
        fmt = FORMATS[name]
        pm = prepare(quantize(w, fmt, method="minmax"), fmt, (rows, cols))
        for level in paths:
            label = "c-" + level if level in SIMD_LEVELS else level
            if level in SIMD_LEVELS:
                set_simd_cap(level)
            try:
                t = median_time(lambda pm=pm: pm.matvec(x, out=y), reps)
                tb = median_time(lambda pm=pm: pm.matmul(xb, out=yb), max(3, reps // 2))
            finally:
                if level in SIMD_LEVELS:
                    set_simd_cap(SIMD_LEVELS[-1])
            print(
                f"{name:7} {label:10} {pm.nbytes / t / 1e9:9.2f} {rows / t / 1e6:9.3f} "
                f"{t_f32 / t:15.2f} {pm.nbytes / t / bw:12.2f} {t_f32b / tb:18.2f} "
                f"{batch * t / tb:16.2f}"
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="add the 8192 x 8192 size")
    ap.add_argument("--reps", type=int, default=11, help="timed runs per figure (median)")
    ap.add_argument("--batch", type=int, default=8, help="vectors in the small matmul")
    ap.add_argument(
        "--portable", action="store_true", help="also time the lower SIMD paths (avx2, portable)"
    )
    ap.add_argument("--clock", choices=sorted(CLOCK), default="cpu", help="cpu (default) or wall")
    args = ap.parse_args(argv)
    global _clock
    clock = args.clock if os.environ.get("OPENBLAS_NUM_THREADS") == "1" else "wall"
    _clock = CLOCK[clock]
    print("# bench_quant")
    print(
        f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')}, kernel threads=1, "
        f"kernel path={simd_level()}, numpy {np.__version__}, cpus={os.cpu_count()}"
    )
    print(f"clock={clock} time, medians of {args.reps}; load average {os.getloadavg()[0]:.1f}")
    sizes = [(1024, 2048), (4096, 4096)] + ([(8192, 8192)] if args.full else [])
    bytes_table(*sizes[-1])
    for rows, cols in sizes:
        bench_size(rows, cols, args.reps, args.batch, args.portable)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
