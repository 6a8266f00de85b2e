"""What ``czyx serve --stream-interval-ms`` buys and costs at one client.

The server's CPU per streamed token above the engine's own is, past a few
microseconds of Python per token, the socket write each token makes: the kernel's
loopback send (which runs the receiving side's TCP path and wakes the client) and the
context switches that follow. ``--stream-interval-ms`` lets a token that comes sooner
than the interval after the last write wait for the next write, so one write carries
several tokens (each still its own SSE event).

For each interval (default 0, 1, 2, 5 ms) one ``czyx serve`` subprocess on the bundled
model (the options ``bench_serve.py`` starts it with, plus the interval), and the same
Scheduler and engine driven in this process as ``czyx serve`` drives it
(``bench_serve.EngineAlone``): in every round each side serves ``--requests`` streamed
greedy requests of ``--tokens`` tokens, one client, the order rotating. Reported per
interval: the serving process's CPU per token (every thread, the kernel's accounting)
and its ratio to the engine alone's CPU per token in the same round (median over the
rounds), the client's tokens per second, and the inter-token latency the client sees
(p50, p99: the interval's price). Medians; the load average is recorded (the machine
is shared). Writes ``bench/STREAM_INTERVAL.md``.

Run: ``OPENBLAS_NUM_THREADS=1 python bench/bench_stream_interval.py`` (about 3 minutes
on 2 vCPUs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _load import LoadGenerator  # noqa: E402
from _machine import machine  # noqa: E402
from bench_serve import (  # noqa: E402
    EngineAlone,
    _free_port,
    _stop,
    run_server_level,
    start_server,
)


def start(store_dir: str, ref: str, interval_ms: float, ns: argparse.Namespace):
    port = _free_port()
    proc = start_server(store_dir, ref, port, ns, ("--stream-interval-ms", str(interval_ms)))
    return proc, f"http://127.0.0.1:{port}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--intervals", default="0,1,2,5", help="stream intervals, ms")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=3, help="requests per side per round")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--budget", type=float, default=120.0, help="seconds per request, at most")
    ap.add_argument("--out", default=os.path.join(HERE, "STREAM_INTERVAL.md"))
    args = ap.parse_args()
    intervals = [float(x) for x in args.intervals.split(",")]

    from _engine_fixtures import mount_checkpoint

    from czyx import portals
    from czyx.inference.assets import bundled_model_dir
    from czyx.store import Store

    ref = "stdlib@1"
    load_before = os.getloadavg()
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-interval-") as work:
        store_dir = os.path.join(work, "store")
        mount_checkpoint(str(bundled_model_dir()), store_dir, ref)
        with Store.open(store_dir) as st:
            token = portals.root_token(st)
        servers = []
        engine = pool = None
        try:
            # The same options for the servers and the engine alone (resident: no reads).
            ns = argparse.Namespace(cache_fraction=1.0, prefetch="off", policy="lru")
            for ms in intervals:
                servers.append((ms, *start(store_dir, ref, ms, ns)))
            engine = EngineAlone(store_dir, ref, ns)
            engine.record(False)
            pool = LoadGenerator()
            # Every side serves the request once first (unmeasured).
            engine.level(1, args.tokens, args.budget)
            for _, proc, url in servers:
                run_server_level(pool, url, token, ref, 1, args.tokens, args.budget, proc.pid)
            cpu = {ms: [] for ms in intervals}
            ratio = {ms: [] for ms in intervals}
            tps = {ms: [] for ms in intervals}
            itl = {ms: [] for ms in intervals}
            eng_cpu: list[float] = []
            sides = [None, *intervals]  # None: the engine alone
            for rnd in range(args.rounds):
                order = sides[rnd % len(sides) :] + sides[: rnd % len(sides)]
                got: dict = {}
                for side in order:
                    runs = []
                    for _ in range(args.requests):
                        if side is None:
                            runs.append(engine.level(1, args.tokens, args.budget))
                        else:
                            _, proc, url = servers[intervals.index(side)]
                            runs.append(
                                run_server_level(
                                    pool, url, token, ref, 1, args.tokens, args.budget, proc.pid
                                )
                            )
                    n = sum(r.tokens for r in runs)
                    got[side] = (
                        sum(r.cpu for r in runs) / n,
                        n / sum(r.seconds for r in runs),
                        [g for r in runs for g in r.itl],
                    )
                e = got[None][0]
                eng_cpu.append(e)
                for ms in intervals:
                    c, t, gaps = got[ms]
                    cpu[ms].append(c)
                    ratio[ms].append(c / e - 1)
                    tps[ms].append(t)
                    itl[ms].extend(gaps)
                line = ", ".join(f"{ms:g} ms {got[ms][0] * 1e6:.0f} us" for ms in intervals)
                print(
                    f"round {rnd}: engine {e * 1e6:.0f} us CPU/token; server {line}; "
                    f"load {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
        finally:
            if pool is not None:
                pool.close()
            if engine is not None:
                engine.close()
            for _, proc, _ in servers:
                _stop(proc)
    load_after = os.getloadavg()

    rows = [
        "| stream interval | server CPU/token | engine alone CPU/token | server overhead (CPU) "
        "| client tok/s | client inter-token p50 / p99 |",
        "|---|---|---|---|---|---|",
    ]
    med_e = statistics.median(eng_cpu)
    for ms in intervals:
        gaps = np.array(itl[ms]) * 1e3
        rows.append(
            f"| {ms:g} ms | {statistics.median(cpu[ms]) * 1e6:.0f} us | {med_e * 1e6:.0f} us | "
            f"{statistics.median(ratio[ms]) * 100:+.1f}% (from {min(ratio[ms]) * 100:+.1f}% "
            f"to {max(ratio[ms]) * 100:+.1f}%) | {statistics.median(tps[ms]):.0f} | "
            f"{np.percentile(gaps, 50):.2f} / {np.percentile(gaps, 99):.2f} ms |"
        )
    cmd = "OPENBLAS_NUM_THREADS=1 python bench/bench_stream_interval.py " + " ".join(sys.argv[1:])
    text = "\n".join(
        [
            "# czyx serve --stream-interval-ms: CPU per streamed token against latency",
            "",
            f"Command: `{cmd.strip()}` ({time.time() - started:.0f} s).",
            "",
            f"Machine: {machine()}. Load average before {load_before[0]:.2f}, "
            f"after {load_after[0]:.2f} (shared machine: medians over interleaved rounds).",
            "",
            f"Bundled model, resident; one client, {args.rounds} rounds of {args.requests} "
            f"streamed greedy requests of {args.tokens} tokens per side, the order rotating. "
            "Server overhead (CPU) = the serving process's CPU per token / the engine alone's "
            "(the same Scheduler driven in the bench process as czyx serve drives it) in the "
            "same round - 1, median (range) over the rounds. The inter-token latency is the "
            "gap between the client's receipts of consecutive text events: tokens written "
            "together arrive together (p50 near 0), the interval bounds the wait.",
            "",
            *rows,
            "",
        ]
    )
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
