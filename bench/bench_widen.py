"""fp16/bf16 -> float32 widening: the C kernel against numpy's cast, in the same run.

Two figures, each a median over interleaved repeats with the baseline:

- the kernel alone: ``store.widen.widen_into`` vs numpy widening into the
  same preallocated array (``np.copyto`` for f16; zero-extend and shift for
  bf16: what the expert cache did before the kernel), 4M values each;
- its effect on decoding: the bundled model (fp16 experts, fully resident,
  widened per use by the expert cache) decoded with the kernel and with the
  kernel disabled (numpy's cast), same tokens, ms per token.

    OPENBLAS_NUM_THREADS=1 python bench/bench_widen.py [--reps 9] [--tokens 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from czyx.store.io import widen as widen_mod  # noqa: E402
from czyx.store.models.checkpoint import to_float32  # noqa: E402


def _numpy_into(out: np.ndarray, arr: np.ndarray, dtype: str) -> None:
    if dtype == "BF16":
        bits = out.view(np.uint32)
        np.copyto(bits, arr)
        bits <<= 16
    else:
        np.copyto(out, arr, casting="same_kind")


def kernel_rows(reps: int) -> None:
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 1 << 16, 1 << 22, dtype=np.uint32).astype(np.uint16)
    for dtype, arr in (("F16", bits.view(np.float16)), ("BF16", bits)):
        out = np.empty(arr.size, np.float32)
        c, npy = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            widen_mod.widen_into(out, arr, dtype)
            c.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            _numpy_into(out, arr, dtype)
            npy.append(time.perf_counter() - t0)
        want = to_float32(arr, dtype).view(np.uint32)
        widen_mod.widen_into(out, arr, dtype)
        assert np.array_equal(out.view(np.uint32), want)  # the kernel gives numpy's bits
        mc, mn = np.median(c) * 1e3, np.median(npy) * 1e3
        print(f"| {dtype} 4M values | {mc:.2f} ms | {mn:.2f} ms | {mn / mc:.2f}x |")


def decode_rows(reps: int, tokens: int) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import _evidence_moe as em

    from czyx.portals import open_consumer
    from czyx.store import Store
    from czyx.store.models.mount import mount

    text = list(Path(os.__file__).read_bytes()[: 32 + tokens])
    with tempfile.TemporaryDirectory() as d, Store.open(Path(d) / "store") as st:
        mount(st, em.ROOT_ASSET, "stdlib@widen")
        with open_consumer(st, None, "stdlib@widen") as consumer:
            times: dict[str, list[float]] = {"C kernel": [], "numpy cast": []}
            outs = {}
            kernel = widen_mod._c
            try:
                for _ in range(reps):
                    for name in times:
                        widen_mod._c = kernel if name == "C kernel" else None
                        widen_mod._warned = True  # the fallback is deliberate here
                        cache = em.resident_cache(consumer)
                        got, t = em.run_tokens(consumer, cache, text[32:], text[:32])
                        cache.close()
                        times[name] += t
                        outs[name] = got
            finally:
                widen_mod._c = kernel
    same = np.array_equal(outs["C kernel"], outs["numpy cast"])
    c, n = np.median(times["C kernel"]), np.median(times["numpy cast"])
    print(
        f"| bundled model decode, resident | {c:.3f} ms/token | {n:.3f} ms/token | {n / c:.2f}x |"
    )
    print(f"\nlogits identical with and without the kernel: {same}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    if not widen_mod.c_available():
        print("store._widen is not built (python setup.py build_ext --inplace)")
        return 1
    print("| what | C kernel | numpy | numpy / C |")
    print("|---|---|---|---|")
    kernel_rows(args.reps)
    decode_rows(max(args.reps // 3, 1), args.tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
