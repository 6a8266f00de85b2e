"""Loopback load test of ``czyx serve``: continuous batching, latency and the server's overhead.

For each model (the bundled ``czyx-moe-stdlib`` and, with ``--synthetic``, a
random Mixtral-shaped MoE whose experts exceed the cache), the expert cache is
held at ``--cache-fraction`` (default 0.25) of the expert bytes, and for each
concurrency level (1, 2, 4, 8, 16 clients; each client one streamed greedy
request of ``--tokens`` tokens) it measures, in interleaved rounds:

- **server**: ``czyx serve`` in a subprocess on 127.0.0.1, the clients as
  threads here speaking HTTP + SSE (httpx): aggregate decode tok/s (completion
  tokens / wall time of the level), expert bytes read per generated token
  (from ``/metrics``), p50/p99 time to first token and inter-token latency as
  the client sees them;
- **engine alone**: the same :class:`~czyx.inference.batch.Scheduler` and
  engine options in this process, no HTTP, the clients as threads reading
  the scheduler's events: the baseline the server's overhead is measured
  against (``server time per token / engine time per token - 1``).

Medians over the rounds; the load average is recorded around every level (the
machine is shared). Every request loop is bounded in count and time and
targets loopback only. Writes ``bench/SERVE.md`` (machine, commands, tables).

Run: ``OPENBLAS_NUM_THREADS=1 python bench/bench_serve.py [--synthetic] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PROMPTS = [
    "def main(argv):\n    ",
    "import os\nimport sys\n",
    "class Parser:\n    def __init__(self",
    "    return ",
    "# Copyright (c) ",
    "for i in range(",
    "if __name__ == ",
    "raise ValueError(",
    "with open(path) as f:\n",
    "try:\n    import ",
    "def __repr__(self):\n",
    "    @property\n    def ",
    "except KeyError:\n    ",
    "lines = [line.strip() for ",
    '"""Return the ',
    "while True:\n        ",
]


@dataclass
class LevelRun:
    """One measurement of one concurrency level."""

    clients: int
    tokens: int
    seconds: float
    bytes_read: float
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    load: tuple[float, float] = (0.0, 0.0)

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_read / self.tokens if self.tokens else 0.0


def _prompt(i: int) -> str:
    return PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else str(i))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- server side


def _metric(text: str, name: str) -> float:
    total = 0.0
    for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M):
        total += float(m.group(1))
    return total


def _server_client(h, url, token, model, prompt, max_tokens, out, deadline):
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    stamps, usage = [], None
    with h.stream(
        "POST", url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {token}"}
    ) as r:
        if r.status_code != 200:
            raise RuntimeError(f"server answered {r.status_code}: {r.read()[:200]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("usage"):
                usage = obj["usage"]
            for ch in obj.get("choices", []):
                if ch.get("text"):
                    stamps.append(time.perf_counter())
            if time.monotonic() > deadline:
                raise RuntimeError("client past its deadline")
    out.append((t0, stamps, usage["completion_tokens"] if usage else len(stamps)))


def run_server_level(pool, url, token, model, clients, max_tokens, budget_s) -> LevelRun:
    """One level; ``pool`` holds one persistent HTTP client per client (keep-alive, as a
    real client; building one costs an SSL context, which is no part of serving)."""
    import httpx

    before = httpx.get(url + "/metrics", timeout=30).text
    results: list = []
    deadline = time.monotonic() + budget_s
    load0 = os.getloadavg()[0]
    threads = [
        threading.Thread(
            target=_server_client,
            args=(pool[i], url, token, model, _prompt(i), max_tokens, results, deadline),
        )
        for i in range(clients)
    ]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0.1))
    wall = time.perf_counter() - t0
    if len(results) != clients:
        raise RuntimeError(f"{clients - len(results)} clients failed or ran out of time")
    after = httpx.get(url + "/metrics", timeout=30).text
    read = _metric(after, "czyx_expert_bytes_read_total") - _metric(
        before, "czyx_expert_bytes_read_total"
    )
    run = LevelRun(
        clients, sum(r[2] for r in results), wall, read, load=(load0, os.getloadavg()[0])
    )
    for start, stamps, _ in results:
        if stamps:
            run.ttft.append(stamps[0] - start)
            run.itl.extend(np.diff(stamps).tolist())
    return run


def start_server(store_dir, ref, port, args) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "czyx",
        "serve",
        ref,
        "--store",
        store_dir,
        "--port",
        str(port),
        "--cache-fraction",
        str(args.cache_fraction),
        "--max-batch",
        "16",
        "--max-queue",
        "64",
        "--prefill-chunk",
        "32",
        "--no-audit",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    import httpx

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"czyx serve exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("czyx serve did not start in 120 s")


# --------------------------------------------------------------------------- engine alone


class EngineAlone:
    """The scheduler and engine in this process, with the server's options."""

    def __init__(self, store_dir, ref, args) -> None:
        from czyx.inference.batch import BatchOptions, Scheduler
        from czyx.inference.engine import Engine
        from czyx.inference.streaming import StreamOptions
        from czyx.portals import open_consumer
        from czyx.store import Store
        from czyx.store.io.iopaths import default_io_path

        self.store = Store.open(store_dir, create=False)
        self.consumer = open_consumer(self.store, None, ref, direct=True)
        self.engine = Engine(
            self.consumer,
            cache_fraction=args.cache_fraction,
            policy="decay",
            stream=StreamOptions(io=default_io_path()),
        )
        self.sched = Scheduler(
            self.engine.model, BatchOptions(max_batch=16, max_queue=64, prefill_chunk=32)
        )

    def level(self, clients, max_tokens, budget_s) -> LevelRun:
        from czyx.inference.batch import Token

        b0 = self.engine.stats().bytes_read
        load0 = os.getloadavg()[0]
        results: list = []

        def client(i):
            t0 = time.perf_counter()
            h = self.sched.submit(list(_prompt(i).encode()), max_tokens)
            stamps = [time.perf_counter() for ev in h.events(budget_s) if isinstance(ev, Token)]
            results.append((t0, stamps, len(stamps)))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(budget_s)
        wall = time.perf_counter() - t0
        if len(results) != clients:
            raise RuntimeError("engine-alone clients ran out of time")
        read = self.engine.stats().bytes_read - b0
        run = LevelRun(
            clients, sum(r[2] for r in results), wall, read, load=(load0, os.getloadavg()[0])
        )
        for start, stamps, _ in results:
            run.ttft.append(stamps[0] - start)
            run.itl.extend(np.diff(stamps).tolist())
        return run

    def close(self) -> None:
        self.sched.close()
        self.engine.close()
        self.consumer.close()
        self.store.close()


# --------------------------------------------------------------------------- report


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) * 1e3 if xs else float("nan")


def summarize(runs: dict[str, dict[int, list[LevelRun]]], levels):
    rows = []
    for c in levels:
        srv, eng = runs["server"][c], runs["engine"][c]
        s_tps = statistics.median(r.tps for r in srv)
        e_tps = statistics.median(r.tps for r in eng)
        rows.append(
            {
                "clients": c,
                "server_tps": s_tps,
                "engine_tps": e_tps,
                "overhead": e_tps / s_tps - 1 if s_tps else float("nan"),
                "server_bpt": statistics.median(r.bytes_per_token for r in srv),
                "engine_bpt": statistics.median(r.bytes_per_token for r in eng),
                "ttft50": statistics.median(_pct(r.ttft, 50) for r in srv),
                "ttft99": statistics.median(_pct(r.ttft, 99) for r in srv),
                "itl50": statistics.median(_pct(r.itl, 50) for r in srv),
                "itl99": statistics.median(_pct(r.itl, 99) for r in srv),
                "eng_ttft50": statistics.median(_pct(r.ttft, 50) for r in eng),
                "eng_itl50": statistics.median(_pct(r.itl, 50) for r in eng),
                "load": statistics.median(r.load[1] for r in srv),
            }
        )
    base = rows[0]
    for r in rows:
        r["scale"] = r["server_tps"] / base["server_tps"]
        r["bpt_ratio"] = (
            r["server_bpt"] / base["server_bpt"] if base["server_bpt"] else float("nan")
        )
    return rows


def table(rows) -> str:
    head = (
        "| clients | server tok/s | x 1 client | engine alone tok/s | server overhead | "
        "bytes/token (server) | x 1 client | bytes/token (engine) | TTFT p50 / p99 ms | "
        "ITL p50 / p99 ms | engine TTFT / ITL p50 ms | load avg |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = [
        f"| {r['clients']} | {r['server_tps']:.1f} | {r['scale']:.2f} | {r['engine_tps']:.1f} | "
        f"{r['overhead'] * 100:+.1f}% | {r['server_bpt'] / 1e3:.1f} kB | {r['bpt_ratio']:.2f} | "
        f"{r['engine_bpt'] / 1e3:.1f} kB | {r['ttft50']:.1f} / {r['ttft99']:.1f} | "
        f"{r['itl50']:.1f} / {r['itl99']:.1f} | {r['eng_ttft50']:.1f} / {r['eng_itl50']:.1f} | "
        f"{r['load']:.1f} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"


def machine() -> str:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            mem = f"{int(f.readline().split()[1]) / 2**20:.1f} GiB RAM"
    except OSError:
        pass
    commit = subprocess.run(
        ["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return (
        f"{platform.node()}: {cpu}, {os.cpu_count()} vCPUs, {mem}; {platform.platform()}; "
        f"Python {platform.python_version()}, numpy {np.__version__}; "
        f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}; "
        f"commit {commit or 'unknown'}"
    )


# --------------------------------------------------------------------------- main


def bench_model(label, store_dir, ref, args, levels) -> list[dict]:
    from czyx import portals
    from czyx.store import Store

    with Store.open(store_dir) as st:
        token = portals.root_token(st)
    port = _free_port()
    proc = start_server(store_dir, ref, port, args)
    url = f"http://127.0.0.1:{port}"
    import httpx

    pool = [httpx.Client(timeout=args.level_budget) for _ in range(max(levels))]
    alone = EngineAlone(store_dir, ref, args)
    runs: dict[str, dict[int, list[LevelRun]]] = {"server": {}, "engine": {}}
    try:
        # Warm both (first requests pay imports and cold caches), then interleave.
        run_server_level(pool, url, token, ref, max(levels), 8, args.level_budget)
        alone.level(2, 8, args.level_budget)
        for rnd in range(args.rounds):
            for c in levels:
                order = ("server", "engine") if rnd % 2 == 0 else ("engine", "server")
                for kind in order:
                    if kind == "server":
                        r = run_server_level(
                            pool, url, token, ref, c, args.tokens, args.level_budget
                        )
                    else:
                        r = alone.level(c, args.tokens, args.level_budget)
                    runs[kind].setdefault(c, []).append(r)
                    print(
                        f"{label} round {rnd} {kind:6s} {c:2d} clients: {r.tps:7.1f} tok/s, "
                        f"{r.bytes_per_token / 1e3:8.1f} kB/token, load {r.load[1]:.1f}",
                        flush=True,
                    )
    finally:
        for h in pool:
            h.close()
        alone.close()
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return summarize(runs, levels)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=48, help="tokens per request")
    ap.add_argument("--levels", default="1,2,4,8,16")
    ap.add_argument("--cache-fraction", type=float, default=0.25)
    ap.add_argument("--synthetic", action="store_true", help="also a random MoE over the cache")
    ap.add_argument("--level-budget", type=float, default=120.0, help="seconds per level at most")
    ap.add_argument("--out", default=os.path.join(HERE, "SERVE.md"))
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    sys.path.insert(0, HERE)
    from _engine_fixtures import mount_checkpoint, synthetic_config, write_synthetic_checkpoint

    from czyx.inference.assets import bundled_model_dir

    started = time.time()
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as work:
        store_dir = os.path.join(work, "store")
        mount_checkpoint(str(bundled_model_dir()), store_dir, "stdlib@1")
        results["bundled czyx-moe-stdlib (4 layers x 16 experts, fp16)"] = bench_model(
            "bundled", store_dir, "stdlib@1", args, levels
        )
        if args.synthetic:
            cfg = synthetic_config(256, 512, 4, 32, vocab=512)
            ckpt = os.path.join(work, "synthetic")
            write_synthetic_checkpoint(ckpt, cfg)
            mount_checkpoint(ckpt, store_dir, "synthetic@1")
            results["synthetic MoE (4 layers x 32 experts, 256 x 512, fp32)"] = bench_model(
                "synthetic", store_dir, "synthetic@1", args, levels
            )
    cmd = "OPENBLAS_NUM_THREADS={} python bench/bench_serve.py {}".format(
        os.environ.get("OPENBLAS_NUM_THREADS", "unset"), " ".join(sys.argv[1:])
    ).strip()
    parts = [
        "# czyx serve: loopback load test\n",
        "Generated by `bench/bench_serve.py`; every figure below was measured in the run "
        "described here.\n",
        f"- Machine: {machine()}",
        f"- Command: `{cmd}`",
        f"- Run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, "
        f"{(time.time() - started) / 60:.1f} min; load average at the end "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}",
        f"- Each level: N clients, each one streamed greedy request of {args.tokens} tokens; "
        f"expert cache at {args.cache_fraction:.0%} of the expert bytes (policy decay, "
        "streaming reads with prefetch); medians over "
        f"{args.rounds} interleaved rounds. Server: `czyx serve` in a subprocess, clients are "
        "httpx threads in the bench process (they share the same CPUs). Engine alone: the "
        "same Scheduler and engine options in-process, no HTTP.",
        "- Server overhead = engine-alone tok/s / server tok/s - 1 (per-token time the "
        "HTTP, JSON and SSE path adds, client-side parsing included).\n",
    ]
    for label, rows in results.items():
        parts.append(f"## {label}\n")
        parts.append(table(rows))
        r1 = rows[0]
        r8 = next((r for r in rows if r["clients"] == 8), None)
        if r8 is not None:
            parts.append(
                f"Goals at 8 clients: aggregate {r8['scale']:.2f}x one client (goal >= 3x); "
                f"bytes read per generated token {r8['bpt_ratio']:.2f}x one client "
                f"(goal <= 0.5x); server overhead {r8['overhead'] * 100:+.1f}% "
                f"(goal <= 10%). One client: {r1['server_tps']:.1f} tok/s.\n"
            )
    parts.append(
        "llama.cpp's server side by side: not run (no GGUF writer for the bundled model in "
        "this tree, and `llama-cpp-python[server]`'s FastAPI stack is not installed here).\n"
    )
    with open(args.out, "w") as f:
        f.write("\n".join(parts))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
