"""Benchmark of the store: the raw reader against the device, LMDB against raw py-lmdb.

Every figure is printed next to a baseline measured in the same run, as a
ratio, and is the median of ``--repeats`` interleaved passes (``--lmdb-repeats``
for the LMDB figures).

Raw reader (a block file of ``--size`` bytes, read as 1, 4 and 16 MiB
extents, sequential and random order, 1 and 4 threads):

- cold (the file evicted with ``posix_fadvise(DONTNEED)`` before every pass):
  baseline = ``os.preadv`` on an ``O_DIRECT`` descriptor into a huge-page-backed
  buffer (the device limit, see DESIGN.md); ours = the C reader in direct
  mode, the Python fallback in direct mode, and the C reader buffered;
- warm (the file in the page cache): baseline = a memory copy of the same
  extents out of a resident, huge-page-backed array of the file's size
  (``np.copyto``, RAM to RAM as the page cache copy is); beside it the
  kernel's own copy bound, buffered ``os.preadv`` into the same warm,
  huge-page destination (what any buffered read can reach); ours = the C
  reader buffered and mapped (``memcpy`` out of a populated mapping), each
  also as ``read_many`` batches. Warm rows print the ratio to both
  ("ratio" to the memory copy, "vs kernel" to buffered preadv).
  Before the warm passes the file is evicted and re-read in file order, so
  every warm case measures the same page cache. This matters: the kernel
  caches a file read in random order (as the cold random passes do) in
  4 KiB folios and one read in order in up to 2 MiB folios, and warm copies
  out of 4 KiB folios measured 0.28-0.35 (buffered) and 0.64-0.76 (mapped)
  of the copy, against 0.74-0.79 and 0.89-0.99 out of 2 MiB folios. The
  "page-cache fill" section measures that effect on purpose: one random
  1 MiB case after three different fills, with the size of the file's
  large folios (the change in ``FileHugePages``, system-wide).

LMDB (``--keys`` random 24-byte keys, msgpack values like an extent record):
point reads per second and prefix-scan records per second through ``Store``
against the same environment driven by raw py-lmdb doing the same job
(composite ``selector || key``, ``txn.get`` / cursor, the same
``msgpack.unpackb``), one transaction per read and one per batch.

Usage::

    python bench/bench_store.py                      # 512 MiB file, 200k keys
    python bench/bench_store.py --size 2G --keys 1000000   # the issue's full size
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from czyx.space import Selector
from czyx.store import RawReader, Store, aligned_empty, c_available

MiB = 1 << 20


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": MiB, "G": 1 << 30}
    t = text.strip().upper().rstrip("B").rstrip("I")
    return int(float(t[:-1]) * units[t[-1]]) if t[-1] in units else int(t)


def make_file(path: Path, size: int) -> None:
    chunk = np.random.default_rng(0).integers(0, 256, 16 * MiB, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, len(chunk))
            f.write(chunk[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())


def evict(path: Path) -> None:
    """Drop ``path`` from the page cache (after fsync), so the next read goes to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm_up(path: Path) -> None:
    buf = bytearray(16 * MiB)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def run_threads(parts: list[list[int]], fn: Callable[[int, list[int]], None]) -> float:
    """Run ``fn(thread_index, offsets)`` in one thread per part; return seconds."""
    if len(parts) == 1:
        t0 = time.perf_counter()
        fn(0, parts[0])
        return time.perf_counter() - t0
    ts = [threading.Thread(target=fn, args=(i, p)) for i, p in enumerate(parts)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


class Case:
    """One (extent size, order, thread count) combination: its offsets and buffers."""

    def __init__(self, ext: int, parts: list[list[int]], src: np.ndarray) -> None:
        self.ext = ext
        self.parts = parts
        self.bufs = [aligned_empty(ext, hugepage=True) for _ in parts]
        self.src = src  # resident copy of the file's size: RAM-to-RAM, like the page cache

    def preadv(self, fd: int) -> Callable[[int, list[int]], None]:
        def f(i: int, part: list[int]) -> None:
            b, ext = self.bufs[i], self.ext
            for o in part:
                if os.preadv(fd, [b], o) != ext:
                    raise RuntimeError("short read in baseline")

        return f

    def reader(self, rd: RawReader) -> Callable[[int, list[int]], None]:
        def f(i: int, part: list[int]) -> None:
            b = self.bufs[i]
            for o in part:
                rd.read_into(o, b)

        return f

    def many(self, rd: RawReader) -> Callable[[int, list[int]], None]:
        def f(i: int, part: list[int]) -> None:
            b, ext = self.bufs[i], self.ext  # a batch into one slot: measures I/O only
            rd.read_many([(o, ext, b) for o in part])

        return f

    def memcpy(self, i: int, part: list[int]) -> None:
        b, src, ext = self.bufs[i], self.src, self.ext
        for o in part:
            np.copyto(b, src[o : o + ext])


def bench_reader(path: Path, size: int, repeats: int) -> list[tuple]:
    rows = []
    direct_fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buffered_fd = os.open(path, os.O_RDONLY)
    c_direct = RawReader(path, direct=True, backend="c")
    c_buf = RawReader(path, backend="c")
    py_direct = RawReader(path, direct=True, backend="python")
    src = aligned_empty(size, hugepage=True)
    src[:] = 1
    try:
        for ext in (1 * MiB, 4 * MiB, 16 * MiB):
            offsets = list(range(0, size - ext + 1, ext))
            for order in ("seq", "rand"):
                offs = list(offsets)
                if order == "rand":
                    random.Random(ext).shuffle(offs)
                for nthreads in (1, 4):
                    if order == "seq":  # each thread streams its own contiguous range
                        step = -(-len(offs) // nthreads)
                        parts = [offs[i * step : (i + 1) * step] for i in range(nthreads)]
                    else:
                        parts = [offs[i::nthreads] for i in range(nthreads)]
                    case = Case(ext, parts, src)
                    nbytes = ext * len(offs)
                    cold = {
                        "O_DIRECT preadv (baseline)": case.preadv(direct_fd),
                        "C direct": case.reader(c_direct),
                        "C direct read_many": case.many(c_direct),
                        "Python direct": case.reader(py_direct),
                        "C buffered": case.reader(c_buf),
                    }
                    warm = {
                        "memory copy (baseline)": case.memcpy,
                        "buffered preadv": case.preadv(buffered_fd),
                        "C buffered": case.reader(c_buf),
                        "C buffered read_many": case.many(c_buf),
                    }
                    for mode, fns in (("cold", cold), ("warm", warm)):
                        times: dict[str, list[float]] = {k: [] for k in fns}
                        c_map = None
                        if mode == "warm":
                            # Re-read in file order: the cold random passes left the
                            # cache in 4 KiB folios (see the module docstring).
                            evict(path)
                            warm_up(path)
                            # Mapped only while warm: a live mapping pins the page cache,
                            # which would turn the cold passes warm.
                            c_map = RawReader(path, mapped=True, backend="c")
                            fns["C mapped"] = case.reader(c_map)
                            fns["C mapped read_many"] = case.many(c_map)
                            times = {k: [] for k in fns}
                        for _ in range(repeats):  # interleaved, so drift hits all alike
                            for name, fn in fns.items():
                                if mode == "cold":
                                    evict(path)
                                times[name].append(run_threads(parts, fn))
                        if c_map is not None:
                            c_map.close()
                        base = statistics.median(next(iter(times.values())))
                        kbase = statistics.median(times.get("buffered preadv", [base]))
                        for name, ts in times.items():
                            med = statistics.median(ts)
                            gbs = nbytes / med / 1e9
                            rows.append((mode, ext // MiB, order, nthreads, name, gbs, base / med))
                            kernel = f"  vs kernel {kbase / med:5.2f}" if mode == "warm" else ""
                            print(
                                f"{mode:4} {ext // MiB:>2} MiB {order:4} {nthreads}T  "
                                f"{name:28} {gbs:7.2f} GB/s  ratio {base / med:5.2f}{kernel}",
                                flush=True,
                            )
        bench_fill(path, size, repeats, src, c_buf)
    finally:
        os.close(direct_fd)
        os.close(buffered_fd)
        for r in (c_direct, c_buf, py_direct):
            r.close()
    return rows


def file_huge_mib() -> int:
    """``FileHugePages`` from ``/proc/meminfo`` in MiB (page cache held in 2 MiB folios)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("FileHugePages:"):
                return int(line.split()[1]) // 1024
    return 0


def bench_fill(path: Path, size: int, repeats: int, src: np.ndarray, c_buf: RawReader) -> None:
    """Warm random 1 MiB reads (1 thread) after three ways of filling the page cache.

    Shows that the warm figures depend on how the file entered the cache (its
    folio size), not on the order of the warm reads themselves.
    """
    ext = MiB
    offs = list(range(0, size - ext + 1, ext))
    random.Random(2).shuffle(offs)
    buf = aligned_empty(ext, hugepage=True)

    def random_fill() -> None:
        for o in offs:
            c_buf.read_into(o, buf)

    def mapped_open() -> None:
        RawReader(path, mapped=True, backend="c").close()

    fills = {
        "random 1 MiB buffered reads": random_fill,
        "reads in file order": lambda: warm_up(path),
        "mapped reader open (cold)": mapped_open,
    }
    print("# page-cache fill: warm 1 MiB random 1T after each fill; ratio = ours / memory copy")
    for fill_name, fill in fills.items():
        evict(path)
        before = file_huge_mib()
        fill()
        huge = file_huge_mib() - before
        c_map = RawReader(path, mapped=True, backend="c")
        fns = {
            "memory copy": lambda: [np.copyto(buf, src[o : o + ext]) for o in offs],
            "C buffered": lambda: [c_buf.read_into(o, buf) for o in offs],
            "C mapped": lambda m=c_map: [m.read_into(o, buf) for o in offs],
        }
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(repeats):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        c_map.close()
        med = {k: statistics.median(v) for k, v in times.items()}
        base = med["memory copy"]
        figs = "  ".join(
            f"{k} {len(offs) * ext / t / 1e9:5.2f} GB/s ({base / t:4.2f})" for k, t in med.items()
        )
        print(f"fill: {fill_name:28} large folios {huge:+5d}/{size // MiB} MiB  {figs}", flush=True)


def bench_lmdb(root: Path, nkeys: int, repeats: int) -> list[tuple]:
    """Point reads and prefix scans: ``Store`` against raw py-lmdb on the same environment.

    The raw baseline does the same job a py-lmdb user would: build the
    ``selector || key`` composite key, ``get`` it (or walk a cursor to the end
    of the class range) and ``msgpack.unpackb`` the value. To cancel the load
    of a shared machine, the work is cut into slices that alternate raw/ours
    and each round's figure is a ratio of adjacent measurements; medians are
    reported.
    """
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, (nkeys, 24), dtype=np.uint8)
    keys = sorted({r.tobytes() for r in raw})
    sums = rng.integers(0, 2**63, len(keys))
    sp = Selector.from_name("bench")
    store = Store.open(root / "lmdb", map_size=64 * MiB)
    batch = 50_000
    for i in range(0, len(keys), batch):
        store.put_many(
            sp,
            [
                (k, {"off": (i + j) * 4096, "len": 4096, "sum": int(sums[i + j]), "fmt": "q2"})
                for j, k in enumerate(keys[i : i + batch])
            ],
        )
    env, db = store._env, store._records
    sel = sp.raw
    sample = random.Random(1).sample(keys, min(len(keys), 100_000))
    unpack = msgpack.unpackb
    # Store values are sealed (a 9-byte checksum prefix, store.core.records.seal): the
    # raw baseline skips it and verifies nothing, so the ratio includes verification.
    from czyx.store.core.records import SEAL_SIZE as _SEAL

    slice_n = 5000
    slices = [sample[i : i + slice_n] for i in range(0, len(sample), slice_n)]

    def raw_get(ks: list[bytes]) -> None:
        begin = env.begin
        for k in ks:
            txn = begin(db=db)
            v = txn.get(sel + k)
            txn.abort()
            unpack(v[_SEAL:], raw=False, strict_map_key=False)

    def ours_get(ks: list[bytes]) -> None:
        g = store.get
        for k in ks:
            g(sp, k)

    def raw_one_txn(ks: list[bytes]) -> None:
        with env.begin(db=db) as txn:
            g = txn.get
            for k in ks:
                unpack(g(sel + k)[_SEAL:], raw=False, strict_map_key=False)

    def ours_snapshot(ks: list[bytes]) -> None:
        with store.snapshot() as snap:
            g = snap.get
            for k in ks:
                g(sp, k)

    # Scans: one class range per slice (4 classes each, ~1.6% of the keys).
    ranges = [(c, c + 3) for c in range(0, 256, 4)]

    def raw_scan(rs: list[tuple[int, int]]) -> None:
        for lo, hi in rs:
            end = sel + bytes([hi]) + b"\xff" * 23
            with env.begin(db=db) as txn:
                cur = txn.cursor()
                cur.set_range(sel + bytes([lo]) + bytes(23))
                for k, v in cur.iternext():
                    if k > end:
                        break
                    unpack(v[_SEAL:], raw=False, strict_map_key=False)

    def ours_scan(rs: list[tuple[int, int]]) -> None:
        for lo, hi in rs:
            for _ in store.scan(sp, lo, hi):
                pass

    per_range = [sum(1 for k in keys if lo <= k[0] <= hi) for lo, hi in ranges]
    scan_slices = [ranges[i : i + 8] for i in range(0, len(ranges), 8)]
    scan_counts = [sum(per_range[i : i + 8]) for i in range(0, len(ranges), 8)]
    pairs = [
        ("point get, txn per read", slices, [len(x) for x in slices], raw_get, ours_get),
        ("point get, one txn/slice", slices, [len(x) for x in slices], raw_one_txn, ours_snapshot),
        ("prefix scan, 4-class ranges", scan_slices, scan_counts, raw_scan, ours_scan),
    ]
    rows = []
    for name, work, counts, raw_fn, ours_fn in pairs:
        raw_fn(work[0])
        ours_fn(work[0])  # warm both
        ratios, raw_rates, our_rates = [], [], []
        for _ in range(repeats):
            rt = ot = 0.0
            for w in work:  # alternate slice by slice
                t0 = time.perf_counter()
                raw_fn(w)
                t1 = time.perf_counter()
                ours_fn(w)
                t2 = time.perf_counter()
                rt += t1 - t0
                ot += t2 - t1
            n = sum(counts)
            ratios.append(ot / rt)
            raw_rates.append(n / rt)
            our_rates.append(n / ot)
        r, o, q = (statistics.median(x) for x in (raw_rates, our_rates, ratios))
        rows.append((name, r, o, q - 1))
        print(
            f"{name:30} raw py-lmdb {r / 1e6:6.3f} M/s   Store {o / 1e6:6.3f} M/s   "
            f"overhead {100 * (q - 1):+5.1f}%",
            flush=True,
        )
    store.close()
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="512M", help="block file size (default 512M; issue: 2G)")
    ap.add_argument("--keys", type=int, default=200_000, help="LMDB keys (issue: 1000000)")
    ap.add_argument("--repeats", type=int, default=3, help="passes per figure (median)")
    ap.add_argument(
        "--lmdb-repeats",
        type=int,
        default=7,
        help="passes per LMDB figure (median; cheap, and a 2-core shared machine is noisy)",
    )
    ap.add_argument("--dir", default=None, help="directory for the files (default: a tmp dir)")
    ap.add_argument("--skip-reader", action="store_true")
    ap.add_argument("--skip-lmdb", action="store_true")
    args = ap.parse_args(argv)
    if not c_available():
        sys.exit("bench_store: the C reader is not built (python setup.py build_ext --inplace)")
    size = parse_size(args.size)
    root = Path(tempfile.mkdtemp(prefix="czyx-bench-", dir=args.dir))
    print(
        f"# bench_store: file {size / MiB:.0f} MiB, {args.keys} keys, median of "
        f"{args.repeats} (LMDB: {args.lmdb_repeats}); cpus={os.cpu_count()} "
        f"python={sys.version.split()[0]} dir={root}"
    )
    try:
        if not args.skip_reader:
            path = root / "bench.blk"
            make_file(path, size)
            print("# raw reader: GB/s, ratio = ours / baseline (first row of each group)")
            bench_reader(path, size, args.repeats)
            path.unlink()
        if not args.skip_lmdb:
            print("# LMDB: records per second, overhead = Store time / raw py-lmdb time - 1")
            bench_lmdb(root, args.keys, args.lmdb_repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
