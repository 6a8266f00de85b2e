"""Loopback load test of ``czyx serve``: continuous batching, latency and the server's overhead.

For each model (the bundled ``czyx-moe-stdlib``, resident as ``czyx serve`` runs
it by default and again with its cache at 25 % of its expert bytes
(``--bundled-fractions``), and, with ``--synthetic``, a random Mixtral-shaped MoE
whose experts exceed its cache, held at ``--cache-fraction``, default 0.25), and for each
concurrency level (1, 2, 4, 8, 16 clients; each client one streamed greedy
request of ``--tokens`` tokens) it measures, in interleaved rounds:

- **server**: ``czyx serve`` in a subprocess on 127.0.0.1, the clients in one
  load-generator process (``bench/_load.py``: asyncio, raw HTTP/1.1 keep-alive
  connections, each stream parsed once it ended): aggregate decode tok/s (completion
  tokens / wall time of the level), expert bytes read per generated token
  (from ``/metrics``), p50/p99 time to first token and inter-token latency as
  the client sees them;
- **engine alone**: the same :class:`~czyx.inference.batch.Scheduler` and
  engine options in this process, no HTTP, driven as ``czyx serve`` drives it
  (this thread steps the scheduler and takes each token as it is emitted): the
  baseline the server's overhead is measured against (``server time per token
  / engine time per token - 1``), in wall time and in CPU time of the serving
  process per token (every thread of the server process, from the kernel's
  per-thread accounting; this process's CPU time for the engine alone). The
  one-client overhead is also measured on adjacent runs of longer requests
  after every side served the same request once, beside a second baseline: the
  engine alone threaded (the scheduler's own thread, the client a thread
  reading its handle's events, as a script uses the API); a pair whose sides
  read different bytes per token (different cache states) is reported, not
  averaged in silently.

- **llama.cpp's server** (bundled model only, where ``llama-cpp-python[server]``
  is installed): its own FastAPI server (``bench/_llama_server.py``) on the
  same model written as an F32 GGUF whose byte vocabulary tokenizes text to
  the same ids as czyx, the same prompts, clients and token counts; all its
  weights are resident (it has no expert cache), it serves one request at a
  time (llama-cpp-python's server holds one lock around the model);
- **bytes per token with an optimal policy**: every expert acquire of the
  engine-alone run is recorded and replayed through Belady's offline optimum
  (evict the expert whose next use is farthest; the experts a layer holds
  together are never evicted by each other), over the whole run in order from
  the same cold start: no eviction policy can read less on that trace.

Medians over the rounds; the load average is recorded around every level (the
machine is shared). Every request loop is bounded in count and time and
targets loopback only. Writes ``bench/SERVE.md`` (machine, commands, tables).

Run: ``OPENBLAS_NUM_THREADS=1 python bench/bench_serve.py --synthetic`` (both models, llama.cpp
where installed; about 5-8 minutes on 2 vCPUs).
"""

from __future__ import annotations

import argparse
import itertools
import os
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
from _load import LoadGenerator
from _machine import machine

HERE = os.path.dirname(os.path.abspath(__file__))
#: Policies replayed on the engine-alone run's acquires (besides the offline optimum).
REPLAYED = ("lru", "decay", "cyclic")
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
    cpu: float = float("nan")  # CPU seconds of the serving process (every thread) in the level
    client_cpu: float = float("nan")  # CPU seconds of the load generator in the level
    level_id: int = -1  # engine alone: its acquires in EngineAlone.trace
    step_experts: float = float("nan")  # engine alone: median distinct experts per step
    replayed: dict = field(default_factory=dict)  # policy -> bytes it reads on the acquires
    optimal_bytes: float = float("nan")  # what Belady's optimum reads on its acquires

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_per_token(self) -> float:
        """CPU seconds of the serving process per generated token."""
        return self.cpu / self.tokens if self.tokens else float("nan")

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_read / self.tokens if self.tokens else 0.0

    @property
    def optimal_bytes_per_token(self) -> float:
        return self.optimal_bytes / self.tokens if self.tokens else float("nan")


def belady_misses(trace: list[tuple[int, int, list[int]]], slots: int) -> dict[int, int]:
    """Misses per level id of Belady's offline optimum on ``trace`` with ``slots`` slots.

    Each entry is one acquire: its experts are held together (none evicts
    another), as in the engine; on a miss the resident expert whose next use
    lies farthest ahead (never: infinitely far) is evicted. Starts cold.
    """
    flat = [(lid, k) for lid, _, keys in trace for k in dict.fromkeys(keys)]
    nxt: dict[int, int] = {}
    next_use = [0] * len(flat)
    for i in range(len(flat) - 1, -1, -1):
        k = flat[i][1]
        next_use[i] = nxt.get(k, 1 << 60)
        nxt[k] = i
    resident: dict[int, int] = {}  # expert -> index of its next use
    misses: dict[int, int] = {}
    i = 0
    for lid, _, keys in trace:
        group = list(dict.fromkeys(keys))
        held = set(group)
        for k in group:
            if k not in resident:
                misses[lid] = misses.get(lid, 0) + 1
                if len(resident) >= slots:
                    victim = max((v, kk) for kk, v in resident.items() if kk not in held)[1]
                    del resident[victim]
            resident[k] = next_use[i]
            i += 1
    return misses


def replay_misses(trace, step_tokens, slots: int, n_layers: int, n_experts: int, policy: str):
    """Misses per level id of the engine's own cache with ``policy`` replayed on ``trace``.

    The real :class:`~czyx.inference.cache.ExpertCache` (its acquire rule and the
    policy class) over a fake consumer: routing does not depend on the cache, so
    the same acquires show what another policy would have read. Each step
    advances the cache's token clock by the tokens it carried, as the engine
    does. Starts cold.
    """
    from czyx.inference.cache import ExpertCache
    from czyx.testing.fakes import FakeConsumer

    cache = ExpertCache(FakeConsumer(n_layers, n_experts), 4096 * slots, 1, policy=policy)
    misses: dict[int, int] = {}
    last_step = None
    for lid, step, keys in trace:
        if step != last_step:
            cache.advance(step_tokens.get(step, 1))
            last_step = step
        before = cache.misses
        layer = keys[0] // n_experts
        cache.acquire(layer, np.array([k % n_experts for k in keys]))
        cache.release()
        misses[lid] = misses.get(lid, 0) + cache.misses - before
    return misses


def cpu_seconds(pid: int) -> float:
    """CPU time of every live thread of process ``pid`` (``/proc/PID/task/*/schedstat``,
    nanoseconds: the kernel's own accounting, not 10 ms ticks)."""
    total = 0
    base = f"/proc/{pid}/task"
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended between the listing and the read
    return total / 1e9


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


def _completion(prompt: str, max_tokens: int, usage: bool) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if usage:
        body["stream_options"] = {"include_usage": True}
    return body


def _level_run(load, port, requests, clients, budget_s, count, who, pid=None) -> LevelRun:
    """One level through the load generator: ``count(result)`` gives a request's
    generated tokens; ``pid``: the serving process, whose CPU time is recorded."""
    cpu0 = cpu_seconds(pid) if pid else float("nan")
    lcpu0 = cpu_seconds(load.pid)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    results = load.level(port, requests, budget_s)
    wall = time.perf_counter() - t0
    cpu = cpu_seconds(pid) - cpu0 if pid else float("nan")
    bad = [r for r in results if r["status"] != 200 or "error" in r]
    if bad:
        raise RuntimeError(f"{who}: {len(bad)} of {clients} clients failed: {bad[0]}")
    run = LevelRun(
        clients,
        sum(count(r) for r in results),
        wall,
        0.0,
        load=(load0, os.getloadavg()[0]),
        cpu=cpu,
        client_cpu=cpu_seconds(load.pid) - lcpu0,
    )
    for r in results:
        if r["stamps"]:
            run.ttft.append(r["stamps"][0] - r["t0"])
            run.itl.extend(np.diff(r["stamps"]).tolist())
    return run


def run_server_level(
    load, url, token, model, clients, max_tokens, budget_s, pid: int | None = None
) -> LevelRun:
    """One level: ``clients`` streamed requests at once from the load generator
    (keep-alive connections, as a real client); ``pid``: the server process, whose
    CPU time over the level is recorded."""
    import httpx

    before = httpx.get(url + "/metrics", timeout=30).text
    headers = {"Authorization": f"Bearer {token}"}
    requests = [
        {
            "path": "/v1/completions",
            "headers": headers,
            "body": {"model": model, **_completion(_prompt(i), max_tokens, usage=True)},
        }
        for i in range(clients)
    ]
    port = int(url.rsplit(":", 1)[1])
    run = _level_run(load, port, requests, clients, budget_s, _usage_tokens, "czyx", pid)
    after = httpx.get(url + "/metrics", timeout=30).text
    run.bytes_read = _metric(after, "czyx_expert_bytes_read_total") - _metric(
        before, "czyx_expert_bytes_read_total"
    )
    return run


def _usage_tokens(r: dict) -> int:
    if r["usage"] is None:
        raise RuntimeError("czyx's stream ended without its usage chunk")
    return r["usage"]


def start_server(store_dir, ref, port, args, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    """``czyx serve`` with the bench's options (``args``: cache fraction, prefetch,
    policy) and ``extra`` flags, once it answers /health."""
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
        "--prefix-cache-mb",
        "0",  # the engine-alone baseline reuses no prefix either
        "--no-audit",
    ]
    cmd.append("--no-prefetch" if args.prefetch == "off" else "--prefetch")
    cmd += ["--policy", args.policy, *extra]
    return _started(cmd, f"http://127.0.0.1:{port}/health", "czyx serve")


def _started(cmd: list[str], ready_url: str, name: str) -> subprocess.Popen:
    """Start a server subprocess and wait (at most 120 s) until ``ready_url`` answers 200."""
    import httpx

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(ready_url, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{name} did not start in 120 s")


def _stop(p: subprocess.Popen) -> None:
    """Terminate a server subprocess (killed after 30 s)."""
    p.terminate()
    try:
        p.wait(30)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(30)


# --------------------------------------------------------------------------- llama.cpp


def llama_available() -> str | None:
    """None when llama.cpp's server can run here, else why not."""
    try:
        import llama_cpp
        import llama_cpp.server.app  # noqa: F401
    except ImportError as exc:
        return f"llama-cpp-python[server] is not importable ({exc})"
    return None


def write_bundled_gguf(path: str) -> None:
    """The bundled model as an F32 GGUF whose byte vocabulary gives czyx's token ids."""
    import bench_speed

    tm, cfg = bench_speed.load_model()
    bench_speed.write_gguf(tm, cfg, path, "F32", byte_bpe=True)


def start_llama(gguf: str, port: int, threads: int) -> subprocess.Popen:
    cmd = [sys.executable, os.path.join(HERE, "_llama_server.py"), gguf, str(port), str(threads)]
    return _started(cmd, f"http://127.0.0.1:{port}/v1/models", "llama.cpp server")


def run_llama_level(load, url, clients, max_tokens, budget_s) -> LevelRun:
    requests = [
        {"path": "/v1/completions", "body": _completion(_prompt(i), max_tokens, usage=False)}
        for i in range(clients)
    ]
    port = int(url.rsplit(":", 1)[1])
    # A byte vocabulary: one generated token per byte of text (its stream has no usage).
    return _level_run(
        load, port, requests, clients, budget_s, lambda r: len(r["text"].encode()), "llama.cpp"
    )


# --------------------------------------------------------------------------- engine alone


class EngineAlone:
    """The scheduler and engine in this process, with the server's options."""

    def __init__(
        self, store_dir, ref, args, c_decode: bool = True, store=None, driven: bool = True
    ) -> None:
        from czyx.inference.batch import BatchOptions, Scheduler
        from czyx.inference.engine import Engine
        from czyx.inference.options import BATCHED_OPTIONS
        from czyx.portals import open_consumer
        from czyx.store import Store

        # One LMDB environment per process: a second engine alone shares the first's store.
        self._owns_store = store is None
        self.store = Store.open(store_dir, create=False) if store is None else store
        self.consumer = open_consumer(self.store, None, ref, direct=True)
        # The options czyx serve derives from its flags (BATCHED_OPTIONS, then the flags).
        self.engine = Engine(
            self.consumer,
            cache_fraction=args.cache_fraction,
            options=BATCHED_OPTIONS.with_(prefetch=args.prefetch == "on", policy=args.policy),
        )
        # driven (czyx serve's mode): this thread steps the scheduler and takes each
        # event as it is emitted, no thread hop; threaded: the scheduler's own thread,
        # each client a thread reading its events (a script's use of the API).
        self.driven = driven
        self.sched = Scheduler(
            self.engine.model,
            BatchOptions(max_batch=16, max_queue=64, prefill_chunk=32, c_decode=c_decode),
            driven=driven,
        )
        # Every acquire, in order (for the offline optimum); the level that made it.
        cache = self.engine.model.experts
        self.trace: list[tuple[int, int, list[int]]] = []  # (level id, step, keys)
        self.step_experts: dict[int, list[int]] = {}  # level id -> distinct experts per step
        self.level_id = -1
        self.steps = 0
        self.step_tokens: dict[int, int] = {}  # step -> tokens it carried (policy clocks)
        acquire, advance, n_exp = cache.acquire, cache.advance, cache.n_experts
        self.n_layers, self.n_experts = cache.n_layers, n_exp

        def recorded(layer, experts):
            keys = [layer * n_exp + int(e) for e in experts]
            self.trace.append((self.level_id, self.steps, keys))
            self.step_experts.setdefault(self.level_id, [0])[-1] += len(experts)
            return acquire(layer, experts)

        def stepped(n_tokens):
            self.steps += 1
            self.step_tokens[self.steps] = int(n_tokens)
            self.step_experts.setdefault(self.level_id, []).append(0)
            return advance(n_tokens)

        self._plain = (acquire, advance)
        self._recording = (recorded, stepped)
        self.record(True)

    def record(self, on: bool) -> None:
        """Record acquires (for the policy replays) or run the cache's own methods."""
        cache = self.engine.model.experts
        cache.acquire, cache.advance = self._recording if on else self._plain

    def level(self, clients, max_tokens, budget_s, level_id: int = -1) -> LevelRun:
        from czyx.inference.batch import Token

        self.level_id = level_id
        b0 = self.engine.stats().bytes_read
        load0 = os.getloadavg()[0]
        results: list = []
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        if self.driven:
            results = self._driven_level(clients, max_tokens, budget_s)
        else:

            def client(i):
                t0 = time.perf_counter()
                h = self.sched.submit(list(_prompt(i).encode()), max_tokens)
                stamps = [time.perf_counter() for ev in h.events(budget_s) if isinstance(ev, Token)]
                results.append((t0, stamps, len(stamps)))

            threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(budget_s)
        wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        if len(results) != clients:
            raise RuntimeError("engine-alone clients ran out of time")
        read = self.engine.stats().bytes_read - b0
        run = LevelRun(
            clients,
            sum(r[2] for r in results),
            wall,
            read,
            load=(load0, os.getloadavg()[0]),
            cpu=cpu,
        )
        run.level_id = level_id
        for start, stamps, _ in results:
            run.ttft.append(stamps[0] - start)
            run.itl.extend(np.diff(stamps).tolist())
        return run

    def _driven_level(self, clients, max_tokens, budget_s) -> list:
        """Every client's request submitted here, then this thread steps the scheduler
        until all are done (bounded by ``budget_s``), stamping each token as emitted."""
        from czyx.inference.batch import Done, Token

        deadline = time.perf_counter() + budget_s
        runs = []
        for i in range(clients):
            rec: dict = {"t0": time.perf_counter(), "stamps": [], "done": False}

            def on_event(ev, rec=rec):
                if isinstance(ev, Token):
                    rec["stamps"].append(time.perf_counter())
                elif isinstance(ev, Done):
                    rec["done"] = True

            self.sched.submit(list(_prompt(i).encode()), max_tokens, on_event=on_event)
            runs.append(rec)
        while not all(r["done"] for r in runs) and time.perf_counter() < deadline:
            if not self.sched.step_once():
                time.sleep(0.0005)  # a request is queued behind the KV budget: never here
        return [(r["t0"], r["stamps"], len(r["stamps"])) for r in runs if r["done"]]

    def close(self) -> None:
        self.sched.close()
        self.engine.close()
        self.consumer.close()
        if self._owns_store:
            self.store.close()


# --------------------------------------------------------------------------- report


def _budget(fraction: float) -> str:
    return "resident" if fraction >= 1.0 else f"cache at {fraction:.0%} of the expert bytes"


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
                "server_cpu": statistics.median(r.cpu_per_token for r in srv),
                "engine_cpu": statistics.median(r.cpu_per_token for r in eng),
                "client_cpu": statistics.median(r.client_cpu / r.tokens for r in srv),
                "server_bpt": statistics.median(r.bytes_per_token for r in srv),
                "engine_bpt": statistics.median(r.bytes_per_token for r in eng),
                "optimal_bpt": statistics.median(r.optimal_bytes_per_token for r in eng),
                "step_experts": statistics.median(r.step_experts for r in eng),
                "replayed": {
                    p: statistics.median(x.replayed[p] / x.tokens for x in eng) for p in REPLAYED
                },
                "ttft50": statistics.median(_pct(r.ttft, 50) for r in srv),
                "ttft99": statistics.median(_pct(r.ttft, 99) for r in srv),
                "itl50": statistics.median(_pct(r.itl, 50) for r in srv),
                "itl99": statistics.median(_pct(r.itl, 99) for r in srv),
                "eng_ttft50": statistics.median(_pct(r.ttft, 50) for r in eng),
                "eng_itl50": statistics.median(_pct(r.itl, 50) for r in eng),
                "load": statistics.median(r.load[1] for r in srv),
            }
        )
    if "llama" in runs:
        for r in rows:
            ll = runs["llama"][r["clients"]]
            r["llama_tps"] = statistics.median(x.tps for x in ll)
            for key, q, attr in (
                ("llama_ttft50", 50, "ttft"),
                ("llama_ttft99", 99, "ttft"),
                ("llama_itl50", 50, "itl"),
                ("llama_itl99", 99, "itl"),
            ):
                r[key] = statistics.median(_pct(getattr(x, attr), q) for x in ll)
            r["llama_load"] = statistics.median(x.load[1] for x in ll)
    base = rows[0]
    for r in rows:
        r["scale"] = r["server_tps"] / base["server_tps"]
        r["opt_ratio"] = r["optimal_bpt"] / base["optimal_bpt"] if base["optimal_bpt"] else 0.0
        r["bpt_ratio"] = (
            r["server_bpt"] / base["server_bpt"] if base["server_bpt"] else float("nan")
        )
    return rows


def table(rows) -> str:
    head = (
        "| clients | server tok/s | x 1 client | engine alone tok/s | server overhead | "
        "CPU us/token server / engine / client | "
        "bytes/token (server) | x 1 client | bytes/token (engine) | optimal policy "
        "(engine trace) | x 1 client | experts / step | TTFT p50 / p99 ms | "
        "ITL p50 / p99 ms | engine TTFT / ITL p50 ms | load avg |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = [
        f"| {r['clients']} | {r['server_tps']:.1f} | {r['scale']:.2f} | {r['engine_tps']:.1f} | "
        f"{r['overhead'] * 100:+.1f}% | "
        f"{r['server_cpu'] * 1e6:.0f} / {r['engine_cpu'] * 1e6:.0f} / "
        f"{r['client_cpu'] * 1e6:.0f} | "
        f"{r['server_bpt'] / 1e3:.1f} kB | {r['bpt_ratio']:.2f} | "
        f"{r['engine_bpt'] / 1e3:.1f} kB | {r['optimal_bpt'] / 1e3:.1f} kB | "
        f"{r['opt_ratio']:.2f} | {r['step_experts']:.0f} | "
        f"{r['ttft50']:.1f} / {r['ttft99']:.1f} | "
        f"{r['itl50']:.1f} / {r['itl99']:.1f} | {r['eng_ttft50']:.1f} / {r['eng_itl50']:.1f} | "
        f"{r['load']:.1f} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"


def policy_table(rows) -> str:
    """Bytes per token each policy reads on the engine-alone run's acquires (replayed)."""
    head = (
        "| clients | experts / step | "
        + " | ".join(f"{p} kB/token (x 1 client)" for p in REPLAYED)
        + " | optimal kB/token (x 1 client) |\n|"
        + "---:|" * (len(REPLAYED) + 3)
        + "\n"
    )
    base = rows[0]
    lines = []
    for r in rows:
        cells = [
            f"{r['replayed'][p] / 1e3:.1f} ({r['replayed'][p] / base['replayed'][p]:.2f})"
            if base["replayed"][p]
            else f"{r['replayed'][p] / 1e3:.1f}"
            for p in REPLAYED
        ]
        cells.append(f"{r['optimal_bpt'] / 1e3:.1f} ({r['opt_ratio']:.2f})")
        lines.append(f"| {r['clients']} | {r['step_experts']:.0f} | " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


def llama_table(rows) -> str:
    head = (
        "| clients | llama.cpp server tok/s | x 1 client | czyx server / llama.cpp | "
        "TTFT p50 / p99 ms | ITL p50 / p99 ms | load avg |\n"
        "|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    base = rows[0]["llama_tps"]
    lines = [
        f"| {r['clients']} | {r['llama_tps']:.1f} | {r['llama_tps'] / base:.2f} | "
        f"{r['server_tps'] / r['llama_tps']:.2f} | "
        f"{r['llama_ttft50']:.1f} / {r['llama_ttft99']:.1f} | "
        f"{r['llama_itl50']:.1f} / {r['llama_itl99']:.1f} | {r['llama_load']:.1f} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main


def bench_model(label, store_dir, ref, args, levels, llama_gguf: str | None = None, fraction=None):
    """Interleaved rounds of the server, the engine alone (and llama.cpp's server), with
    the expert cache at ``fraction`` of the expert bytes (default ``args.cache_fraction``)."""
    if fraction is not None:
        args = argparse.Namespace(**{**vars(args), "cache_fraction": fraction})
    from czyx import portals
    from czyx.inference.kernels.fused import default_threads
    from czyx.store import Store

    with Store.open(store_dir) as st:
        token = portals.root_token(st)
    port = _free_port()
    proc = start_server(store_dir, ref, port, args)
    url = f"http://127.0.0.1:{port}"

    alone = numpy_alone = threaded = llama = pool = None
    try:
        pool = LoadGenerator()
        alone = EngineAlone(store_dir, ref, args)
        # The engine alone as a script uses the API (scheduler thread, a thread per client
        # reading its events): a second baseline for the one-client overhead.
        threaded = EngineAlone(store_dir, ref, args, store=alone.store, driven=False)
        threaded.record(False)
        # The batched path before decode tokens took the engine's C decode (numpy for every
        # chunk), engine alone at 1 and 8 clients: what the scaling ratio was measured against.
        if args.numpy_baseline:
            numpy_alone = EngineAlone(store_dir, ref, args, c_decode=False, store=alone.store)
            numpy_alone.record(False)
            kinds_np = [c for c in (1, 8) if c in levels]
        kinds = ["server", "engine"]
        if llama_gguf is not None:
            llama_port = _free_port()
            # As many threads as czyx's kernels may use (the cores this process may run on).
            llama = start_llama(llama_gguf, llama_port, default_threads())
            llama_url = f"http://127.0.0.1:{llama_port}"
            kinds.append("llama")
    except BaseException:  # no server outlives a failed setup
        for e in (numpy_alone, threaded, alone):
            if e is not None:
                e.close()
        for p in (proc, llama):
            if p is not None:
                _stop(p)
        if pool is not None:
            pool.close()
        raise
    runs: dict[str, dict[int, list[LevelRun]]] = {k: {} for k in kinds}
    floor: dict = {}  # CPU per token of the bare stack (http_floor), pacing either way
    # (server, engine alone driven, engine alone threaded), one client
    overhead_pairs: list[tuple[LevelRun, LevelRun, LevelRun]] = []
    level_ids = itertools.count()
    try:
        # Warm each (first requests pay imports and cold caches), then interleave.
        run_server_level(pool, url, token, ref, max(levels), 8, args.level_budget)
        alone.level(2, 8, args.level_budget, next(level_ids))
        if numpy_alone is not None:
            numpy_alone.level(2, 8, args.level_budget)
        if llama is not None:
            run_llama_level(pool, llama_url, 2, 8, args.level_budget)
        for rnd in range(args.rounds):
            for c in levels:
                order = kinds[rnd % len(kinds) :] + kinds[: rnd % len(kinds)]
                for kind in order:
                    if kind == "server":
                        r = run_server_level(
                            pool, url, token, ref, c, args.tokens, args.level_budget, proc.pid
                        )
                    elif kind == "engine":
                        r = alone.level(c, args.tokens, args.level_budget, next(level_ids))
                    else:
                        r = run_llama_level(pool, llama_url, c, args.tokens, args.level_budget)
                    runs[kind].setdefault(c, []).append(r)
                    if kind == "engine" and numpy_alone is not None and c in kinds_np:
                        rn = numpy_alone.level(c, args.tokens, args.level_budget)
                        runs.setdefault("numpy", {}).setdefault(c, []).append(rn)
                        print(
                            f"{label} round {rnd} numpy  {c:2d} clients: {rn.tps:7.1f} tok/s, "
                            f"{rn.cpu_per_token * 1e6:6.0f} us CPU/token",
                            flush=True,
                        )
                    print(
                        f"{label} round {rnd} {kind:6s} {c:2d} clients: {r.tps:7.1f} tok/s, "
                        f"{r.bytes_per_token / 1e3:8.1f} kB/token, "
                        f"{r.cpu_per_token * 1e6:6.0f} us CPU/token, load {r.load[1]:.1f}",
                        flush=True,
                    )
        # The server's own overhead at one client: longer requests, adjacent pairs (the
        # order alternating), so a pair shares the machine's load of the moment. Both sides
        # first serve the same request once (unmeasured): the levels before left their
        # caches in different states, and a pair must compare the same acquires (each
        # pair's bytes per token are checked below). The engine-alone side runs without
        # the acquire recorder (it would add Python per layer to the baseline only).
        alone.record(False)
        run_server_level(pool, url, token, ref, 1, args.overhead_tokens, args.level_budget)
        alone.level(1, args.overhead_tokens, args.level_budget)
        threaded.level(1, args.overhead_tokens, args.level_budget)
        sides = ["server", "engine", "threaded"]
        for rnd in range(args.overhead_rounds):
            pair = {}
            for kind in sides[rnd % 3 :] + sides[: rnd % 3]:
                if kind == "server":
                    pair[kind] = run_server_level(
                        pool, url, token, ref, 1, args.overhead_tokens, args.level_budget, proc.pid
                    )
                else:
                    e = alone if kind == "engine" else threaded
                    pair[kind] = e.level(1, args.overhead_tokens, args.level_budget)
            overhead_pairs.append((pair["server"], pair["engine"], pair["threaded"]))
            print(
                f"{label} overhead pair {rnd}: server {pair['server'].tps:.1f} tok/s "
                f"{pair['server'].cpu_per_token * 1e6:.0f} us CPU/token "
                f"{pair['server'].bytes_per_token / 1e3:.1f} kB/token, engine "
                f"{pair['engine'].tps:.1f} tok/s {pair['engine'].cpu_per_token * 1e6:.0f} us "
                f"CPU/token {pair['engine'].bytes_per_token / 1e3:.1f} kB/token, load "
                f"{pair['engine'].load[1]:.1f}",
                flush=True,
            )
        alone.record(True)
        # The same stack with nothing of czyx: its CPU per streamed token at the engine's pace.
        if overhead_pairs:
            pace = statistics.median(e.cpu_per_token for _, e, _ in overhead_pairs) * 1e6
            cfg, cache = alone.engine.model.cfg, alone.engine.cache
            # The expert bytes one decode token reads: its top-k in every sparse layer.
            work = cfg.top_k * sum(cfg.sparse_layers) * cache.slot_nbytes
            floor = {
                "spin": http_floor(pool, args.overhead_tokens, pace),
                "read": http_floor(pool, args.overhead_tokens, pace, work),
                "work_bytes": work,
            }
    finally:
        if pool is not None:
            pool.close()
        cache = alone.engine.cache
        slots, slot_bytes, capacity = cache.n_slots, cache.slot_nbytes, cache.max_acquire
        if numpy_alone is not None:
            numpy_alone.close()
        if threaded is not None:
            threaded.close()
        alone.close()
        for p in (proc, llama):
            if p is not None:
                _stop(p)
    misses = belady_misses(alone.trace, capacity)
    replays = {
        p: replay_misses(
            alone.trace, alone.step_tokens, capacity, alone.n_layers, alone.n_experts, p
        )
        for p in REPLAYED
    }
    for rs in runs["engine"].values():
        for r in rs:
            r.optimal_bytes = misses.get(r.level_id, 0) * slot_bytes
            r.step_experts = float(np.median(alone.step_experts.get(r.level_id, [0])))
            r.replayed = {p: m.get(r.level_id, 0) * slot_bytes for p, m in replays.items()}
    return summarize(runs, levels), slots, (overhead_pairs, floor), runs.get("numpy", {})


def http_floor(
    load, tokens: int, pace_us: float, work_bytes: int = 0, requests: int = 5
) -> list[float]:
    """CPU per streamed token of a bare Starlette route on uvicorn (``_sse_floor.py``)
    writing one czyx-sized event per token, ``pace_us`` of compute between two (spinning,
    or with ``work_bytes`` reading through that many bytes), beyond the CPU time the
    paces took: one figure per request (the first, unmeasured, warms it)."""
    port = _free_port()
    cmd = [sys.executable, os.path.join(HERE, "_sse_floor.py"), str(port)]
    proc = _started(cmd, f"http://127.0.0.1:{port}/health", "SSE floor server")
    out = []
    try:
        body = {"tokens": tokens, "pace_us": pace_us, "work_bytes": int(work_bytes)}
        req = {"path": "/", "body": body}
        for i in range(requests + 1):
            cpu0 = cpu_seconds(proc.pid)
            (res,) = load.level(port, [req], 120.0)
            cpu = cpu_seconds(proc.pid) - cpu0
            if res["status"] != 200 or len(res.get("stamps", [])) != tokens:
                raise RuntimeError(f"SSE floor server: {res}")
            if i:
                out.append((cpu - res["usage_detail"]["paced_us"] / 1e6) / tokens)
    finally:
        load.close_connections()
        _stop(proc)
    return out


def overhead_line(measured, tokens: int) -> str:
    """The one-client overhead from adjacent (server, engine alone driven, engine alone
    threaded) runs: wall and CPU against the driven engine (the goal's baseline), the
    CPU against the threaded one beside it, and the bare stack's floor (``http_floor``)."""
    pairs, floor = measured
    if not pairs:
        return ""
    threaded_cpu = sorted(s_.cpu_per_token / t.cpu_per_token - 1 for s_, _, t in pairs)
    t_cpu = statistics.median(t.cpu_per_token for _, _, t in pairs)
    pairs = [(s_, e) for s_, e, _ in pairs]
    wall = sorted(e.tps / s_.tps - 1 for s_, e in pairs)
    cpu = sorted(s_.cpu_per_token / e.cpu_per_token - 1 for s_, e in pairs)
    extra = sorted((s_.cpu_per_token - e.cpu_per_token) * 1e6 for s_, e in pairs)
    # A pair whose two sides read different bytes per token compared different cache
    # states (not the server's overhead): counted and shown, never silently averaged in.
    differ = [
        i
        for i, (s_, e) in enumerate(pairs)
        if abs(s_.bytes_read - e.bytes_read) > 0.05 * max(s_.bytes_read, e.bytes_read, 1.0)
    ]
    med = statistics.median
    s_tps, e_tps = med(p[0].tps for p in pairs), med(p[1].tps for p in pairs)
    s_cpu, e_cpu = med(p[0].cpu_per_token for p in pairs), med(p[1].cpu_per_token for p in pairs)
    line = (
        f"Server overhead at one client, {len(pairs)} adjacent pairs of one streamed request "
        f"of {tokens} tokens (server, engine alone driven and engine alone threaded, the "
        "order rotating; every side first served the same request once, unmeasured): "
        f"median server {s_tps:.1f} tok/s, engine alone {e_tps:.1f} tok/s; per pair, wall "
        f"(engine tok/s / server tok/s - 1): median {med(wall) * 100:+.1f}% (from "
        f"{wall[0] * 100:+.1f}% to {wall[-1] * 100:+.1f}%); CPU of the serving process per "
        f"token (server process / engine-alone process - 1): median {med(cpu) * 100:+.1f}% "
        f"(from {cpu[0] * 100:+.1f}% to {cpu[-1] * 100:+.1f}%), i.e. "
        f"{med(extra):+.0f} us per token (server {s_cpu * 1e6:.0f}, "
        f"engine alone {e_cpu * 1e6:.0f} us); bytes read per "
        f"token server {med(p[0].bytes_per_token for p in pairs) / 1e3:.1f} kB, engine alone "
        f"{med(p[1].bytes_per_token for p in pairs) / 1e3:.1f} kB; goal <= 10%. The engine "
        "alone here is driven as czyx serve drives it (this thread steps the scheduler and "
        "takes each event as emitted: no consumer thread to wake). Against the engine alone "
        "threaded (its own scheduler thread, the client a thread reading the handle's events, "
        f"as a script uses the API; {t_cpu * 1e6:.0f} us CPU per token) the server costs "
        f"{med(threaded_cpu) * 100:+.1f}% (from {threaded_cpu[0] * 100:+.1f}% to "
        f"{threaded_cpu[-1] * 100:+.1f}%).\n"
    )
    if floor:
        f_us, spin = med(floor["read"]) * 1e6, floor["spin"]
        line += (
            f"\nThe floor of that overhead on this machine: a bare Starlette route on the same "
            "uvicorn (uvloop, httptools; `bench/_sse_floor.py`, nothing of czyx) streaming "
            f"{tokens} events of czyx's chunk size, one write each, with {e_cpu * 1e6:.0f} us of "
            "compute between two (the engine alone's CPU per token above) that reads through "
            f"{floor['work_bytes'] / 1e3:.0f} kB (the expert bytes a decode token reads: its "
            "top-k of every layer, so the write after it finds the caches a decode step "
            f"leaves), costs **{f_us:+.0f} us of CPU per token** beyond that compute (median "
            f"of {len(floor['read'])} requests, {min(floor['read']) * 1e6:+.0f} to "
            f"{max(floor['read']) * 1e6:+.0f}), i.e. {f_us / (e_cpu * 1e6) * 100:+.1f}% of the "
            "engine's per-token CPU: the cost of one streamed event through this stack and the "
            "loopback socket after a decode step, whatever the server does. With compute that "
            "only spins on the clock (the write path's code and data stay cached) it costs "
            f"{med(spin) * 1e6:+.0f} us ({min(spin) * 1e6:+.0f} to {max(spin) * 1e6:+.0f}). "
            f"czyx serve's own share is the rest ({med(extra) - f_us:+.0f} us).\n"
        )
    load = med(p[1].load[1] for p in pairs)
    cpus = os.cpu_count() or 1
    if load > cpus:
        line += (
            f"\nThe load average during the pairs ({load:.1f}) exceeded the {cpus} CPUs: the wall "
            "figures are contended (see above); the CPU figure is the one to read.\n"
        )
    if differ:
        line += (
            f"\n**Warning**: {len(differ)} of {len(pairs)} pairs read bytes per token that "
            f"differ by more than 5% between the two sides (pairs {differ}): their caches were "
            "not in the same state, so those pairs measure I/O, not the server.\n"
        )
    return line


def numpy_line(rows, np_runs: dict[int, list[LevelRun]]) -> str:
    """The engine alone with the numpy decode (the previous batched path) beside the C one."""
    med = statistics.median
    by = {r["clients"]: r for r in rows}
    cells = []
    for c in sorted(np_runs):
        tps = med(x.tps for x in np_runs[c])
        cpu = med(x.cpu_per_token for x in np_runs[c])
        cells.append(
            f"{c} client{'s' if c > 1 else ''}: {tps:.1f} tok/s, {cpu * 1e6:.0f} us CPU/token "
            f"(C path: {by[c]['engine_tps']:.1f} tok/s, {by[c]['engine_cpu'] * 1e6:.0f} us)"
        )
    line = (
        "Engine alone with every chunk through the numpy step (`BatchOptions(c_decode=False)`, "
        "the batched path before decode tokens and prompt chunks took the engine's C "
        "kernels), same rounds: " + "; ".join(cells)
    )
    if 1 in np_runs and 8 in np_runs:
        line += (
            f"; 8 clients / 1 client with it: "
            f"{med(x.tps for x in np_runs[8]) / med(x.tps for x in np_runs[1]):.2f}x"
        )
    return line + ".\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per request")
    ap.add_argument("--levels", default="1,2,4,8,16")
    ap.add_argument(
        "--cache-fraction", type=float, default=0.25, help="the synthetic model's cache budget"
    )
    ap.add_argument(
        "--bundled-fractions",
        default="1.0,0.25",
        help="the bundled model's cache budgets, one run each (1.0: resident, serve's default)",
    )
    ap.add_argument("--synthetic", action="store_true", help="also a random MoE over the cache")
    ap.add_argument(
        "--no-bundled", action="store_true", help="skip the bundled model (with --synthetic)"
    )
    ap.add_argument(
        "--prefetch",
        choices=["on", "off"],
        default="off",
        help="look-ahead expert prefetch in both the server and the engine alone",
    )
    ap.add_argument(
        "--policy",
        default=None,
        help="eviction policy of both (default: czyx serve's, BATCHED_OPTIONS.policy)",
    )
    ap.add_argument(
        "--llama",
        choices=["auto", "on", "off"],
        default="auto",
        help="llama.cpp's server on the bundled model (auto: where llama-cpp-python[server] is)",
    )
    ap.add_argument(
        "--overhead-rounds", type=int, default=10, help="one-client server/engine pairs"
    )
    ap.add_argument("--overhead-tokens", type=int, default=512, help="tokens per overhead pair")
    ap.add_argument("--level-budget", type=float, default=120.0, help="seconds per level at most")
    ap.add_argument("--out", default=os.path.join(HERE, "SERVE.md"))
    ap.add_argument(
        "--no-numpy-baseline",
        dest="numpy_baseline",
        action="store_false",
        help="skip the engine alone with the numpy decode at 1 and 8 clients",
    )
    args = ap.parse_args()
    if args.policy is None:
        from czyx.inference.options import BATCHED_OPTIONS

        args.policy = BATCHED_OPTIONS.policy
    levels = [int(x) for x in args.levels.split(",")]
    sys.path.insert(0, HERE)
    from _engine_fixtures import mount_checkpoint, synthetic_config, write_synthetic_checkpoint

    from czyx.inference.assets import bundled_model_dir

    started = time.time()
    results = {}
    llama_why = None if args.llama != "off" else "not requested (--llama off)"
    if llama_why is None:
        llama_why = llama_available()
        if llama_why is not None and args.llama == "on":
            raise SystemExit(f"--llama on: {llama_why}")
    llama_rows = None
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as work:
        store_dir = os.path.join(work, "store")
        if not args.no_bundled:
            mount_checkpoint(str(bundled_model_dir()), store_dir, "stdlib@1")
            gguf = None
            if llama_why is None:
                gguf = os.path.join(work, "stdlib-f32.gguf")
                write_bundled_gguf(gguf)
            for k, frac in enumerate(float(f) for f in args.bundled_fractions.split(",")):
                # llama.cpp beside the first budget only (it has no expert cache).
                rows, slots, pairs, np_runs = bench_model(
                    "bundled", store_dir, "stdlib@1", args, levels, gguf if k == 0 else None, frac
                )
                if gguf is not None and k == 0:
                    llama_rows = rows
                label = (
                    f"bundled czyx-moe-stdlib (4 layers x 16 experts, fp16; {slots} expert "
                    f"slots: {_budget(frac)})"
                )
                results[label] = (rows, pairs, np_runs, frac)
        elif not args.synthetic:
            raise SystemExit("--no-bundled needs --synthetic")
        else:
            llama_why = "not run (--no-bundled)"
        if args.synthetic:
            cfg = synthetic_config(256, 512, 4, 32, vocab=512)
            ckpt = os.path.join(work, "synthetic")
            write_synthetic_checkpoint(ckpt, cfg)
            mount_checkpoint(ckpt, store_dir, "synthetic@1")
            rows, slots, pairs, np_runs = bench_model(
                "synthetic", store_dir, "synthetic@1", args, levels
            )
            label = (
                "synthetic MoE (4 layers x 32 experts, 256 x 512, fp32; "
                f"{slots} expert slots: {_budget(args.cache_fraction)})"
            )
            results[label] = (rows, pairs, np_runs, args.cache_fraction)
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
        "expert cache as each model's heading says (resident: every expert held, as `czyx "
        f"serve` runs by default; a fraction: policy {args.policy}, "
        f"streaming reads, look-ahead prefetch {args.prefetch}, the same in both); medians over "
        f"{args.rounds} interleaved rounds. Server: `czyx serve` in a subprocess; the clients: "
        "one load-generator process (`bench/_load.py`: one asyncio loop, a keep-alive "
        "HTTP/1.1 connection per client, a stream's bytes only received and time-stamped "
        "while it runs, its events parsed after it ends), on the same CPUs; its CPU time per "
        "generated token is the 'client' column. Engine alone: the same Scheduler and "
        "engine options in-process, no HTTP.",
        "- Server overhead = engine-alone tok/s / server tok/s - 1 (per-token time the HTTP, "
        "JSON and SSE path adds, the load generator's share of the CPUs included). Beside it,"
        " the CPU time of the serving process per generated token (every thread: the kernel's"
        " per-thread accounting, /proc/PID/task/*/schedstat for the server, process time for "
        "the engine alone), which the machine's other load does not inflate the way it "
        "inflates wall time: where the load average exceeds the CPUs, the server's extra "
        "runnable threads (event loop, and the load generator reading the streams) take CPU "
        "share from its batch thread, so wall overhead there overstates the work the server "
        "adds. A level at one client lasts well under a second on the bundled model, so its "
        "medians are noisy; the overhead is also measured on "
        f"{args.overhead_rounds} "
        f"adjacent pairs of {args.overhead_tokens}-token requests per model.\n",
    ]
    for label, (rows, pairs, np_runs, frac) in results.items():
        parts.append(f"## {label}\n")
        parts.append(table(rows))
        if frac < 1.0:
            parts.append(
                "Every policy on the same acquires (the engine-alone run's, replayed from a "
                "cold cache through the real ExpertCache; medians over the rounds):\n"
            )
            parts.append(policy_table(rows))
        if pairs:
            parts.append(overhead_line(pairs, args.overhead_tokens))
        if np_runs:
            parts.append(numpy_line(rows, np_runs))
        r1 = rows[0]
        r8 = next((r for r in rows if r["clients"] == 8), None)
        if r8 is not None:
            bytes_goal = (
                f"bytes read per generated token at 8 clients {r8['bpt_ratio']:.2f}x one client "
                f"(goal <= 0.5x; with the optimal policy on the same acquires "
                f"{r8['opt_ratio']:.2f}x the optimum at one client, and the optimum at 8 "
                f"clients is {r8['optimal_bpt'] / r1['server_bpt']:.2f}x what one client "
                "measured); "
                if frac < 1.0
                else "no expert reads (resident); "
            )
            parts.append(
                f"Goals: aggregate at 8 clients {r8['scale']:.2f}x one client (goal >= 3x; "
                f"the engine alone {r8['engine_tps'] / r1['engine_tps']:.2f}x); "
                f"{bytes_goal}server overhead in the level runs at one client "
                f"{r1['overhead'] * 100:+.1f}%, at 8 clients {r8['overhead'] * 100:+.1f}% "
                f"(goal <= 10%; short levels: see the paired figure above). One client: "
                f"{r1['server_tps']:.1f} tok/s. CPU of the engine alone per generated token "
                f"at 1 client {r1['engine_cpu'] * 1e6:.0f} us, at 8 clients "
                f"{r8['engine_cpu'] * 1e6:.0f} us. A step of several tokens shares the "
                "step's fixed work, each layer's C calls and each chosen expert's rows (read "
                "once for every token that chose it); each token's attention, its own "
                "products with the attention weights and its expert arithmetic are its "
                "own"
                + (
                    ", and at this cache budget the union's misses add reads per token "
                    "(bytes columns).\n"
                    if frac < 1.0
                    else ".\n"
                )
            )
    parts.append(
        "Reading the bytes columns: a step acquires, layer by layer, the union of the experts "
        "its sequences chose, each distinct expert once for the whole batch ('experts / step' "
        "is that union summed over the layers, median over the steps). One sequence needs "
        "top-k experts per sparse layer per step, and on these models consecutive tokens of "
        "one sequence keep choosing from a small set, so at one client most acquires hit a "
        "25% cache. A batch's union per step is the sum of several such sets: once it "
        "exceeds the slots, every step must read at least the part that does not fit, "
        "whatever the policy. The 'optimal policy' column is that floor (Belady's offline "
        "optimum replayed on the engine-alone run's own acquires): where its ratio to one "
        "client stays above 0.5, the bytes goal cannot be met on that model at that budget "
        "by any eviction policy; it needs routing that overlaps across sequences more than "
        "each sequence overlaps with itself over time.\n"
    )
    if llama_rows is not None:
        parts.append(
            "## llama.cpp's server, same model and load\n\n"
            "llama-cpp-python's own server (`bench/_llama_server.py`: its FastAPI app under "
            "uvicorn, loaded with `use_extra_bufts=False`) on the bundled model written as an "
            "F32 GGUF (`bench_speed.write_gguf(..., byte_bpe=True)`: its tokenizer gives "
            "czyx's byte ids, so the prompts are the same tokens), with as many threads as "
            "czyx's kernels, in the same interleaved rounds as the tables above (same prompts, "
            "clients and max tokens, greedy). It keeps every weight resident (no expert cache) "
            "and serves one request at a time. Tokens counted as the bytes of its streamed "
            "text (a byte vocabulary; its stream reports no usage).\n"
        )
        parts.append(llama_table(llama_rows))
    else:
        parts.append(f"llama.cpp's server side by side: not run ({llama_why}).\n")
    with open(args.out, "w") as f:
        f.write("\n".join(parts))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
