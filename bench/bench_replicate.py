"""Replication throughput against a plain HTTP download of the same bytes, same run.

Builds a synthetic bf16 Qwen3-MoE checkpoint (``bench_mount.build_checkpoint``,
random bytes, ~128 MB by default), mounts it as ``m@1`` into a source store,
and a second version ``m@2`` with 10 % of its experts changed (so it shares
90 % of its experts with ``m@1``). One uvicorn on 127.0.0.1 serves both the
replication routes (:mod:`czyx.server.replication`) and, for the baseline, the
version's block files as plain static files. Per repetition (order
alternating, a fresh destination each time, ``os.sync()`` before each):

* ``plain``: httpx streams every block file the version spans (trunk and
  experts) to local files, then ``fsync`` (the pull makes its bytes durable
  too), served as static files (Starlette ``FileResponse``): the bytes a
  ``curl`` of the store would move; ``whole``: the same, each file served as
  one in-memory body (fewer, larger writes on the server: a stronger baseline);
* ``pull``: ``czyx pull`` of ``m@1`` into an empty store (offer, plan, range
  reads with 4 workers, checksum per extent, staging + journal, fsync,
  publish, tag); ``pull-1w``: the same with one worker.

Then, into a store holding ``m@1``: ``pull`` of ``m@2``, reporting bytes
moved against the version's bytes (goal: about 10 %).

Prints medians in MB/s of payload bytes and the ratio pull / plain
(goal >= 0.8), with the load average. Writes ``bench/REPLICATE.json``.

Usage: ``python bench/bench_replicate.py [--size-mb 128] [--reps 3] [--dir DIR]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_mount import build_checkpoint

from czyx.cli.commands.pull import pull
from czyx.portals.model import grant_model
from czyx.store import Store
from czyx.store.models.mount import mount
from czyx.store.models.replicate import version_chain
from czyx.testing.loopback import serve_in_thread


def changed_copy(src: Path, dst: Path, fraction: float, seed: int = 1) -> int:
    """Copy checkpoint ``src`` to ``dst`` with ``fraction`` of its experts' bytes changed."""
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    experts = sorted({k.rsplit(".", 2)[0] for k in header if ".mlp.experts." in k})
    rng = np.random.default_rng(seed)
    pick = rng.choice(len(experts), size=max(1, round(fraction * len(experts))), replace=False)
    buf = bytearray(raw)
    for i in pick:
        for part in ("gate_proj", "up_proj", "down_proj"):
            a, _ = header[f"{experts[i]}.{part}.weight"]["data_offsets"]
            buf[8 + n + a] ^= 0x01
    f.write_bytes(bytes(buf))
    return len(pick)


def plain_download(url: str, names: list[str], out: Path, route: str = "plain") -> int:
    """Stream each named block file to ``out`` and fsync; returns bytes."""
    import httpx

    out.mkdir(parents=True)
    total = 0
    with httpx.Client(base_url=url, timeout=120) as http:
        for name in names:
            with http.stream("GET", f"/{route}/{name}") as r, open(out / name, "wb") as f:
                r.raise_for_status()
                for chunk in r.iter_bytes(1 << 20):
                    f.write(chunk)
                    total += len(chunk)
                f.flush()
                os.fsync(f.fileno())
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="czyx-repl-", dir=args.dir))
    try:
        run(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(work: Path, args: argparse.Namespace) -> None:
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import FileResponse, Response
    from starlette.routing import Route

    from czyx.server.replication import routes

    build_checkpoint(work / "v1", args.size_mb)
    changed = changed_copy(work / "v1", work / "v2", 0.10)
    src_dir = work / "src"
    with Store.open(src_dir) as s:
        mount(s, work / "v1", "m@1")
        mount(s, work / "v2", "m@2")
        token = grant_model(s, "m@2", tenant="bench", rights="read").token
        token1 = grant_model(s, "m@1", tenant="bench", rights="read").token
        sel1 = s.resolve_tag("m@1")
        blocks = [s.block_identity(x).name for x in version_chain(s, sel1)]
        n_experts = len(s.manifest(sel1)["experts"])
    blocks_dir = src_dir / "blocks"

    async def plain(request):  # the baseline: a static file, no portal, no checks
        return FileResponse(blocks_dir / request.path_params["name"])

    async def whole(request):  # a stronger baseline: the whole file in one body
        path = blocks_dir / request.path_params["name"]
        return Response(await run_in_threadpool(path.read_bytes))

    app = Starlette(
        routes=[*routes(src_dir), Route("/plain/{name}", plain), Route("/whole/{name}", whole)]
    )
    rows: dict[str, list[float]] = {"plain": [], "whole": [], "pull": [], "pull-1w": []}
    payload = 0
    with serve_in_thread(app) as url:
        for rep in range(args.reps):
            order = ["plain", "whole", "pull", "pull-1w"]
            if rep % 2:
                order.reverse()
            for kind in order:
                dest = work / f"dest-{kind}-{rep}"
                os.sync()
                t0 = time.perf_counter()
                if kind in ("plain", "whole"):
                    nbytes = plain_download(url, blocks, dest, kind)
                else:
                    res = pull(url, "m@1", token1, str(dest), workers=1 if kind == "pull-1w" else 4)
                    nbytes = res.bytes_fetched
                    payload = nbytes
                dt = time.perf_counter() - t0
                rows[kind].append(nbytes / dt / 1e6)
                print(
                    f"rep {rep} {kind:8s} {nbytes / 1e6:8.1f} MB {dt:6.2f} s "
                    f"{nbytes / dt / 1e6:7.1f} MB/s",
                    flush=True,
                )
                shutil.rmtree(dest, ignore_errors=True)
        # the shared-version figure
        dest = work / "dest-share"
        pull(url, "m@1", token1, str(dest))
        t0 = time.perf_counter()
        res2 = pull(url, "m@2", token, str(dest))
        dt2 = time.perf_counter() - t0
    med = {k: statistics.median(v) for k, v in rows.items()}
    load = os.getloadavg()
    out = {
        "size_mb": args.size_mb,
        "reps": args.reps,
        "payload_bytes": payload,
        "mb_per_s": med,
        "ratio_pull_vs_plain": med["pull"] / med["plain"],
        "ratio_pull_vs_whole": med["pull"] / med["whole"],
        "ratio_pull1w_vs_whole": med["pull-1w"] / med["whole"],
        "all_mb_per_s": rows,
        "ratio_pull1w_vs_plain": med["pull-1w"] / med["plain"],
        "shared_version": {
            "experts": n_experts,
            "experts_changed": changed,
            "bytes_in_version": res2.bytes_total,
            "bytes_moved": res2.bytes_fetched,
            "fraction_moved": res2.bytes_fetched / res2.bytes_total,
            "seconds": dt2,
        },
        "loadavg": load,
    }
    print(json.dumps(out, indent=2))
    Path(__file__).with_name("REPLICATE.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
