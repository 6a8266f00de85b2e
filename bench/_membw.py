"""The machine's memory read bandwidth at 1 and 2 threads: the ceiling of a decode step.

Scope: a plain read of a buffer too big for the caches (64-bit loads, XOR-folded
so the compiler keeps them, software prefetch 8 KiB ahead as czk's row kernels),
split into equal contiguous parts over ``threads`` pthreads, built with cffi into
a temporary directory (bench-only, never imported by czyx). A decode step on a
model too big for the caches is a sequence of such reads with arithmetic on top;
when one thread already reads near what two can, no kernel can make the step
scale further with threads on this machine.
"""

from __future__ import annotations

import importlib.util
import tempfile
import time
from pathlib import Path

import numpy as np

_SRC = r"""
#include <pthread.h>
#include <stdint.h>
typedef struct { const uint64_t *p; int64_t n; uint64_t out; } part;
static void *fold(void *a_) {
    part *a = (part *)a_;
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0;
    int64_t i = 0;
    for (; i + 8 <= a->n; i += 8) {
        /* 8 KiB ahead, as czk's row kernels: the hardware prefetchers stop at page edges. */
        __builtin_prefetch(a->p + i + 1024, 0, 2);
        s0 ^= a->p[i]; s1 ^= a->p[i + 1]; s2 ^= a->p[i + 2]; s3 ^= a->p[i + 3];
        s4 ^= a->p[i + 4]; s5 ^= a->p[i + 5]; s6 ^= a->p[i + 6]; s7 ^= a->p[i + 7];
    }
    for (; i < a->n; i++) s0 ^= a->p[i];
    a->out = s0 ^ s1 ^ s2 ^ s3 ^ s4 ^ s5 ^ s6 ^ s7;
    return 0;
}
typedef float v8 __attribute__((vector_size(32)));
typedef struct { int64_t n; float out; } spin;
static void *fmas(void *a_) {
    /* Eight independent multiply-add chains in registers: no memory traffic at all. */
    spin *a = (spin *)a_;
    const v8 m = {0.999999f, 0.999999f, 0.999999f, 0.999999f,
                  0.999999f, 0.999999f, 0.999999f, 0.999999f};
    const v8 c = {1e-7f, 1e-7f, 1e-7f, 1e-7f, 1e-7f, 1e-7f, 1e-7f, 1e-7f};
    v8 x0 = m, x1 = m, x2 = m, x3 = m, x4 = m, x5 = m, x6 = m, x7 = m;
    for (int64_t i = 0; i < a->n; i++) {
        x0 = x0 * m + c; x1 = x1 * m + c; x2 = x2 * m + c; x3 = x3 * m + c;
        x4 = x4 * m + c; x5 = x5 * m + c; x6 = x6 * m + c; x7 = x7 * m + c;
    }
    v8 s = x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7;
    a->out = s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7];
    return 0;
}
float membw_fma(int64_t n, int threads) {
    spin parts[64];
    pthread_t th[64];
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    for (int t = 0; t < threads; t++) { parts[t].n = n; parts[t].out = 0; }
    for (int t = 1; t < threads; t++) pthread_create(&th[t], 0, fmas, &parts[t]);
    fmas(&parts[0]);
    float s = parts[0].out;
    for (int t = 1; t < threads; t++) { pthread_join(th[t], 0); s += parts[t].out; }
    return s;
}
uint64_t membw_read(const uint64_t *p, int64_t n, int threads) {
    part parts[64];
    pthread_t th[64];
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    const int64_t step = n / threads;
    for (int t = 0; t < threads; t++) {
        parts[t].p = p + t * step;
        parts[t].n = t == threads - 1 ? n - t * step : step;
    }
    for (int t = 1; t < threads; t++) pthread_create(&th[t], 0, fold, &parts[t]);
    fold(&parts[0]);
    uint64_t s = parts[0].out;
    for (int t = 1; t < threads; t++) { pthread_join(th[t], 0); s ^= parts[t].out; }
    return s;
}
"""


def _build(tmp: Path):
    from cffi import FFI

    ffi = FFI()
    ffi.cdef(
        "uint64_t membw_read(const uint64_t *p, int64_t n, int threads);"
        "float membw_fma(int64_t n, int threads);"
    )
    ffi.set_source("_membw_ext", _SRC, extra_compile_args=["-O3", "-march=native"],
                   libraries=["pthread"])  # fmt: skip
    so = ffi.compile(tmpdir=str(tmp))
    spec = importlib.util.spec_from_file_location("_membw_ext", so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Reader:
    """A buffer of ``nbytes`` and the read kernel, built once; :meth:`gbs` times one read.

    Every read is checked against the buffer's XOR computed by numpy, so a call
    that skipped its loads cannot report a bandwidth.
    """

    def __init__(self, nbytes: int) -> None:
        self.buf = np.random.default_rng(0).integers(0, 2**63, nbytes // 8, dtype=np.uint64)
        self.want = int(np.bitwise_xor.reduce(self.buf))
        self._tmp = tempfile.TemporaryDirectory(prefix="membw-")
        self.ext = _build(Path(self._tmp.name))
        self.ptr = self.ext.ffi.cast("const uint64_t *", self.buf.ctypes.data)
        for t in (1, 2):  # untimed: first touches, thread start-up paths
            self.ext.lib.membw_read(self.ptr, self.buf.size, t)

    def gbs(self, threads: int) -> float:
        t0 = time.perf_counter()
        got = self.ext.lib.membw_read(self.ptr, self.buf.size, threads)
        dt = time.perf_counter() - t0
        if got != self.want:
            raise RuntimeError("the read kernel's fold does not match numpy's")
        return self.buf.nbytes / dt / 1e9

    def fma_gflops(self, threads: int, n: int = 20_000_000) -> float:
        """GFLOP/s of ``threads`` threads each running ``n`` rounds of register-only
        multiply-adds: where two threads give no more than one, the two CPUs share
        one core's arithmetic (SMT siblings on the host), whatever the guest reports."""
        t0 = time.perf_counter()
        got = self.ext.lib.membw_fma(n, threads)
        dt = time.perf_counter() - t0
        if not got > 0:
            raise RuntimeError("the multiply-add loop returned nothing")
        return n * 8 * 8 * 2 * threads / dt / 1e9

    def close(self) -> None:
        self._tmp.cleanup()


def read_scaling(nbytes: int, reps: int, threads: tuple[int, ...] = (1, 2)) -> dict[int, float]:
    """Median wall GB/s of reading ``nbytes`` at each thread count, interleaved rounds."""
    r = Reader(nbytes)
    try:
        gbs: dict[int, list[float]] = {t: [] for t in threads}
        for _ in range(reps):
            for t in threads:
                gbs[t].append(r.gbs(t))
    finally:
        r.close()
    return {t: float(np.median(v)) for t, v in gbs.items()}


if __name__ == "__main__":
    import os

    r = read_scaling(113 << 20, 21)
    print({t: round(v, 1) for t, v in r.items()}, f"2/1 {r[2] / r[1]:.2f}x", os.getloadavg())
    rd = Reader(1 << 20)
    f = {t: float(np.median([rd.fma_gflops(t) for _ in range(7)])) for t in (1, 2)}
    rd.close()
    print("fma GFLOP/s", {t: round(v, 1) for t, v in f.items()}, f"2/1 {f[2] / f[1]:.2f}x")
