"""The quantized kernels alone: czk's matvec and matmul against a base revision's, interleaved.

Scope: how fast ``czk_matvec`` (``inference/kernels/czk.c``, a decode step's
product) reads a quantized matrix too big for the caches, and how fast
``czk_matmul`` runs ``--prompt`` tokens against it (a prompt's product, one thread),
per SIMD path, against the same kernels
built from another git revision (``--base``, default the tree this round of
kernel work started from) in the same process. The base's ``czk.c`` and headers are
taken with ``git show``, built with cffi into a temporary directory and loaded
under another module name; both then run the same calls, alternating, and the
thread CPU time of each call is recorded (the machine is shared: CPU time is less
disturbed by other jobs than wall time, and the product is single-threaded).

The matrix: ``--rows-base`` rows of random weights quantized by the store's
quantizer, tiled ``--tile`` times (codes, scales and mins; 113 MB in q8 and 63 MB
in q4 by default), so every call streams from memory. Reported per path and format:
GB/s of packed bytes (median over ``--reps``), the speedup, and the largest
difference between the two kernels' outputs relative to the output's magnitude
(the numerics changed: see czk.c's header). Then, for this tree alone, the
decode matvec's wall GB/s on a pool of 1 and of 2 threads (how far a decode
step's products can scale with threads on this machine's memory). Writes
``--md`` (``bench/KERNELS.md``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from _machine import machine  # noqa: E402

BASE = "472b784"


def build_base(rev: str, tmp: Path) -> object:
    """The base revision's ``_czk`` extension, built in ``tmp`` and imported as ``basek._czk``."""
    kdir = tmp / "kernels"
    kdir.mkdir()
    for name in ("czk.c", "czk_api.h", "half.h"):
        src = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{rev}:inference/kernels/{name}"],
            capture_output=True, check=True,
        ).stdout  # fmt: skip
        (kdir / name).write_bytes(src)
    from cffi import FFI

    ffi = FFI()
    ffi.cdef((kdir / "czk_api.h").read_text())
    ffi.set_source(
        "basek._czk",
        (kdir / "czk.c").read_text(),
        include_dirs=[str(kdir)],
        extra_compile_args=["-O3", "-std=gnu99", "-ffp-contract=off", "-fno-strict-aliasing"],
        libraries=["m", "pthread"],
    )
    so = ffi.compile(tmpdir=str(tmp / "build"))
    spec = importlib.util.spec_from_file_location("basek._czk", so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fused_with(ext: object) -> object:
    """A private copy of ``czyx.inference.kernels.fused`` bound to extension ``ext``."""
    from czyx.inference.kernels import fused

    spec = importlib.util.spec_from_file_location("basefused", fused.__file__)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod._lib, mod._ffi = ext.lib, ext.ffi
    return mod


def big_matrix(fmt_name: str, rows: int, cols: int, tile: int):
    """A packed matrix of ``rows * tile`` rows (one quantized block of rows, tiled)."""
    from czyx.inference.kernels.ops import prepare
    from czyx.store.quant.formats import get_format, quantize, views

    fmt = get_format(fmt_name)
    w = np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32) * 0.02
    c, s, m = views(quantize(w, fmt), fmt, (rows, cols))
    parts = [np.tile(np.asarray(a).reshape(rows, -1), (tile, 1)).reshape(-1) for a in (c, s, m)]
    buf = np.concatenate([p.view(np.uint8) for p in parts])
    return prepare(buf, fmt, (rows * tile, cols)), buf.nbytes


def thread_scaling(new, pm, nbytes: int, x: np.ndarray, reps: int) -> dict[str, float]:
    """Wall GB/s of the decode matvec on a pool of 1 and of 2 threads, and of a plain read
    of as many bytes on 1 and 2 threads (``bench/_membw.py``), interleaved, medians."""
    from _membw import Reader

    R, C = pm.shape
    ks = {t: new.DecodeKernels(C, R, 8, t) for t in (1, 2)}
    reader = Reader(nbytes)
    y = np.zeros(R, np.float32)
    ts: dict[str, list[float]] = {k: [] for k in ("mv1", "mv2", "rd1", "rd2", "fm1", "fm2")}
    for t in (1, 2):  # untimed: first touches, workers started
        ks[t].matvec(pm, x, y)
    try:
        for _ in range(reps):
            for t in (1, 2):
                t0 = time.perf_counter()
                ks[t].matvec(pm, x, y)
                ts[f"mv{t}"].append(nbytes / (time.perf_counter() - t0) / 1e9)
                ts[f"rd{t}"].append(reader.gbs(t))
                ts[f"fm{t}"].append(reader.fma_gflops(t))
    finally:
        reader.close()
        for k in ks.values():
            k.close()
    return {k: float(np.median(v)) for k, v in ts.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default=BASE, help="git revision of the baseline kernels")
    ap.add_argument("--formats", nargs="+", default=["q8", "q4"])
    ap.add_argument("--rows-base", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--tile", type=int, default=12)
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--prompt", type=int, default=4,
                    help="tokens of the prompt-kernel rows (quant_matmul); 0: none")  # fmt: skip
    ap.add_argument("--md", default=str(REPO / "bench" / "KERNELS.md"))
    a = ap.parse_args(argv)
    from czyx.inference.kernels import fused as new

    load0 = os.getloadavg()
    rows = []
    scaling = []
    with tempfile.TemporaryDirectory() as tmp:
        base = fused_with(build_base(a.base, Path(tmp)))
        levels = [lv for lv in new.LEVELS[1:] if new.LEVELS.index(lv) <= new._lib.czk_level()]
        for fmt_name in a.formats:
            pm, nbytes = big_matrix(fmt_name, a.rows_base, a.cols, a.tile)
            R, C = pm.shape
            x = np.random.default_rng(1).standard_normal(C, dtype=np.float32)
            xs = np.random.default_rng(2).standard_normal((max(a.prompt, 1), C), dtype=np.float32)
            for lv, nv in [(lv, nv) for nv in sorted({1, a.prompt} - {0}) for lv in levels]:
                runs = {}
                for name, mod in (("base", base), ("new", new)):
                    runs[name] = [mod, mod.DecodeKernels(C, R, 8, 1), np.zeros(R, np.float32), []]
                for _ in range(a.reps):
                    for r in runs.values():
                        mod, k, y, ts = r
                        mod._lib.czk_set_cap(mod.LEVELS.index(lv))
                        t = time.thread_time()
                        if nv == 1:  # decode: czk_matvec
                            k.matvec(pm, x, y)
                        else:  # a prompt's tokens: czk_matmul
                            r[2] = mod.quant_matmul(pm, xs)
                        ts.append(time.thread_time() - t)
                gbs = {n: nbytes / np.median(r[3]) / 1e9 for n, r in runs.items()}
                yb, yn = runs["base"][2], runs["new"][2]
                diff = float(np.abs(yn - yb).max() / np.abs(yb).max())
                rows.append((lv, fmt_name, nv, R, C, nbytes, gbs["base"], gbs["new"], diff))
                print(f"{lv} {fmt_name} x{nv}: base {gbs['base']:.2f} GB/s, new {gbs['new']:.2f} "
                      f"GB/s ({gbs['new'] / gbs['base']:.2f}x)", flush=True)  # fmt: skip
                for mod, k, _, _ in runs.values():
                    mod._lib.czk_set_cap(len(mod.LEVELS) - 1)
                    k.close()
            g = thread_scaling(new, pm, nbytes, x, a.reps)
            scaling.append((fmt_name, g))
            print(f"{fmt_name} threads: matvec {g['mv1']:.1f} -> {g['mv2']:.1f} GB/s, plain read "
                  f"{g['rd1']:.1f} -> {g['rd2']:.1f} GB/s", flush=True)  # fmt: skip
    load1 = os.getloadavg()
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    cmd = "python bench/bench_kernels.py " + " ".join(
        shlex.quote(v) for v in (argv if argv is not None else sys.argv[1:])
    )
    lines = [
        "# czk quantized matvec: this tree vs a base revision",
        "",
        f"Generated by `bench/bench_kernels.py` ({stamp}); its docstring states the method.",
        "",
        f"- machine: {machine()}",
        f"- base: `{a.base}`; one thread; median of {a.reps} interleaved calls each, thread CPU "
        "time; GB/s of packed bytes (codes, fp16 scales and mins)",
        f"- load average before: {' '.join(f'{v:.2f}' for v in load0)}; after: "
        f"{' '.join(f'{v:.2f}' for v in load1)}",
        "",
        "Inputs 1: the decode product (`czk_matvec`); more: a prompt's tokens against the "
        "matrix (`czk_matmul` via `quant_matmul`; compute-bound, so GB/s of the matrix per "
        "call fall with the token count).",
        "",
        "| SIMD path | format | inputs | matrix | MB | base GB/s | this tree GB/s | speedup "
        "| max abs diff / max abs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for lv, f, nv, R, C, nb, gb, gn, d in rows:
        lines.append(
            f"| {lv} | {f} | {nv} | {R} x {C} | {nb / 1e6:.0f} | {gb:.2f} | {gn:.2f} | "
            f"**{gn / gb:.2f}x** | {d:.1e} |"
        )
    lines += [
        "",
        "## One thread and two (wall time, this tree, the best SIMD path)",
        "",
        "The decode matvec of the same matrix (from memory) on an engine pool of 1 and of 2 "
        "threads, and beside it a plain read of as many bytes split over 1 and 2 threads "
        "(`bench/_membw.py`: 64-bit loads, prefetched as the row kernels are, no arithmetic), "
        "medians of interleaved calls: the ceiling a decode step's products give its thread "
        "scaling on this machine. Where one thread already reads near what two can, the "
        "second core has no memory bandwidth to add.",
        "",
        "| format | matvec 1 thread GB/s | 2 threads GB/s | 2 / 1 | plain read 1 thread GB/s "
        "| 2 threads GB/s | 2 / 1 |",
        "|---|---|---|---|---|---|---|",
    ]
    for f, g in scaling:
        lines.append(
            f"| {f} | {g['mv1']:.1f} | {g['mv2']:.1f} | **{g['mv2'] / g['mv1']:.2f}x** | "
            f"{g['rd1']:.1f} | {g['rd2']:.1f} | **{g['rd2'] / g['rd1']:.2f}x** |"
        )
    if scaling:
        fm1 = float(np.median([g["fm1"] for _, g in scaling]))
        fm2 = float(np.median([g["fm2"] for _, g in scaling]))
        lines += [
            "",
            "Arithmetic alone (register-only multiply-add chains, no memory traffic, the same "
            f"interleaved rounds): 1 thread {fm1:.1f} GFLOP/s, 2 threads {fm2:.1f} GFLOP/s, "
            f"**{fm2 / fm1:.2f}x** (near 2x: two separate cores; near 1x: the two vCPUs share "
            "one core's arithmetic on the host).",
        ]
    lines += ["", f"Command: `{cmd.strip()}`", ""]
    Path(a.md).write_text("\n".join(lines))
    print(f"wrote {a.md}")


if __name__ == "__main__":
    main()
