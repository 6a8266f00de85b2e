"""Measuring the I/O paths on this machine: the numbers ``czyx bench io`` and the evidence use.

Scope: a scratch file, timed reads of it through each
:class:`~store.iopaths.TransferSource` (block size, reader threads or
io_uring queue depth, cold or warm page cache), medians over repeats and
per-request latency percentiles, and a description of the machine the
numbers belong to (CPU, memory, filesystem, mount options, kernel, THP).
Nothing here is asserted by tests: it measures.
"""

from __future__ import annotations

import contextlib
import os
import platform
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from czyx.store.io.iopaths import drop_file_cache, open_source
from czyx.store.io.reader import aligned_empty


@dataclass(frozen=True)
class Measurement:
    """One configuration's result: medians over repeats."""

    path: str
    block: int
    threads: int
    queue_depth: int
    cold: bool
    nbytes: int
    bandwidth: float  # bytes/s, median over repeats
    samples: tuple[float, ...]  # bytes/s of each repeat
    p50_us: float  # per-request latency percentiles over all repeats
    p99_us: float


def make_file(path: str | os.PathLike, nbytes: int, seed: int = 0) -> Path:
    """Write ``nbytes`` of incompressible bytes (multiple of 4096) to ``path``, fsynced."""
    p = Path(path)
    nbytes = -(-nbytes // 4096) * 4096
    rng = np.random.default_rng(seed)
    chunk = rng.integers(0, 255, 4 << 20, dtype=np.uint8)
    with open(p, "wb") as f:
        done = 0
        while done < nbytes:
            n = min(len(chunk), nbytes - done)
            chunk[:8] = np.frombuffer(np.int64(done).tobytes(), np.uint8)  # no two chunks equal
            f.write(chunk[:n].tobytes())
            done += n
        f.flush()
        os.fsync(f.fileno())
    return p


class _Lat:
    __slots__ = ("ns",)

    def __init__(self) -> None:
        self.ns: list[int] = []


def _reader(src, offsets, i, step, block, qd, buf, lat: _Lat) -> None:
    """Read every ``step``-th request starting at ``i``; per-request latency into ``lat``."""
    mine = offsets[i::step].tolist()
    for j in range(0, len(mine), qd):
        group = mine[j : j + qd]
        t0 = time.monotonic_ns()
        if qd == 1:
            src.read_into(group[0], block, buf[:block])
        else:
            src.read_many(
                [(o, block, buf[k * block : (k + 1) * block]) for k, o in enumerate(group)]
            )
        lat.ns.append((time.monotonic_ns() - t0) // len(group))


def measure(
    kind: str,
    path: str | os.PathLike,
    *,
    block: int = 1 << 20,
    nbytes: int | None = None,
    threads: int = 1,
    queue_depth: int = 1,
    cold: bool = True,
    repeats: int = 3,
) -> Measurement:
    """Read ``nbytes`` of ``path`` sequentially in ``block``-sized requests through ``kind``.

    ``threads`` readers split the requests round-robin; for ``io_uring`` a
    ``queue_depth`` above one submits batches of that many requests instead.
    Every destination is a huge-page-backed aligned buffer (one per thread).
    """
    size = os.path.getsize(path)
    nbytes = min(nbytes or size, size) // block * block
    if nbytes == 0:
        raise ValueError(f"{path}: smaller than one {block}-byte block")
    offsets = np.arange(0, nbytes, block, dtype=np.int64)
    samples, lats = [], []
    qd = queue_depth if kind == "io_uring" else 1
    # At least one whole huge page per reader: a request inside a 2 MiB page is issued
    # whole; a smaller buffer cannot be huge-page backed and its direct reads are split.
    buf_bytes = max(block * qd, 2 << 20)
    bufs = [aligned_empty(buf_bytes, hugepage=True) for _ in range(threads)]
    for _ in range(repeats):
        if cold:
            drop_file_cache(path)
        # A fresh source per repeat: pages mapped by a live mmap source survive
        # POSIX_FADV_DONTNEED, which would make every later "cold" repeat warm.
        with open_source(kind, path, queue_depth=max(qd, 1)) as src:
            lat = [_Lat() for _ in range(threads)]
            t0 = time.perf_counter()
            if threads == 1:
                _reader(src, offsets, 0, 1, block, qd, bufs[0], lat[0])
            else:
                ths = [
                    threading.Thread(
                        target=_reader, args=(src, offsets, i, threads, block, qd, bufs[i], lat[i])
                    )
                    for i in range(threads)
                ]
                for th in ths:
                    th.start()
                for th in ths:
                    th.join()
            samples.append(nbytes / (time.perf_counter() - t0))
        lats.extend(x for part in lat for x in part.ns)
    la = np.array(lats, np.float64) / 1e3
    return Measurement(
        kind,
        block,
        threads,
        qd,
        cold,
        nbytes,
        float(np.median(samples)),
        tuple(samples),
        float(np.percentile(la, 50)),
        float(np.percentile(la, 99)),
    )


def _mount_of(path: str) -> tuple[str, str, str, str]:
    """``(device, mount point, fs type, options)`` of the mount holding ``path``."""
    real = os.path.realpath(path)
    best = ("?", "/", "?", "?")
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        dev, mnt, fs, opts = line.split()[:4]
        mnt = mnt.replace("\\040", " ")
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[1]):
            best = (dev, mnt, fs, opts)
    return best


def machine_description(path: str | os.PathLike = ".") -> dict[str, str]:
    """The facts a measurement must be recorded with (what cannot be read says so)."""
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = "?"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    dev, mnt, fs, opts = _mount_of(os.fspath(path))
    thp = "?"
    with contextlib.suppress(OSError):
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    base = os.path.basename(dev)
    model = "?"
    for cand in (f"/sys/class/block/{base}/device/model", f"/sys/block/{base}/device/model"):
        try:
            model = Path(cand).read_text().strip() or model
            break
        except OSError:
            continue
    fw = "not exposed"
    for cand in (
        f"/sys/class/block/{base}/device/firmware_rev",
        f"/sys/class/block/{base}/device/rev",
    ):
        try:
            fw = Path(cand).read_text().strip() or fw
            break
        except OSError:
            continue
    rot = "?"
    with contextlib.suppress(OSError):
        rot = Path(f"/sys/class/block/{base}/queue/rotational").read_text().strip()
    temps = []
    for z in sorted(Path("/sys/class/thermal").glob("thermal_zone*/temp")):
        try:
            temps.append(f"{int(z.read_text()) / 1000:.0f}C")
        except (OSError, ValueError):
            continue
    st = os.statvfs(path)
    return {
        "cpu": f"{cpu} ({os.cpu_count()} logical CPUs)",
        "memory": mem,
        "kernel": f"{platform.system()} {platform.release()}",
        "filesystem": f"{fs} on {dev} mounted at {mnt}",
        "mount_options": opts,
        "device": f"{base}: model {model}, firmware {fw}, rotational={rot}",
        "free_space": f"{st.f_bavail * st.f_frsize / 2**30:.1f} GiB free",
        "temperature": ", ".join(temps) if temps else "no thermal sensors exposed",
        "transparent_hugepages": thp,
        "python": platform.python_version(),
    }
