"""What the live expert view costs the requests that do not watch it, and the one that does.

The web playground's expert view asks the batched scheduler for each decode
token's routing (``Scheduler.submit(..., watch=True)``, :mod:`czyx.inference.routewatch`).
The claim: a request that does not watch pays nothing per token for it (a
step looks at one counter). Measured here on the bundled model, engine alone
(no HTTP: the scheduler driven on this thread as ``czyx serve`` drives it, so
nothing but the scheduler and the forward step is timed), in interleaved rounds
with the order rotating, three sides over the same engine and cache:

- **base**: the scheduler of the commit before the watch was added (its
  ``inference/batch.py``, loaded from git: ``--base-rev``, default the parent of
  the commit that added ``inference/routewatch.py``);
- **not watching**: this tree's scheduler, no request watching;
- **watching**: this tree's scheduler, every request watching (its frames built
  and delivered; the server's JSON of a frame is not included).

Per side, CPU time of this process per generated token (``time.process_time``)
and wall tok/s, at 1 client (one request of ``--tokens``) and at 8 clients
(``--tokens`` / 4 each); medians over ``--rounds`` rounds and, per round, the
ratio to the base run adjacent to it. Greedy tokens are checked equal across the
sides. The load average is recorded (the machine is shared). Writes ``bench/WATCH.md``.

Run: ``OPENBLAS_NUM_THREADS=1 python bench/bench_watch.py`` (about a minute on 2 vCPUs).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

from _machine import REPO, machine

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = [
    "def main(argv):\n    ",
    "import os\nimport sys\n",
    "class Parser:\n    def __init__(self",
    "    return ",
    "# Copyright (c) ",
    "for i in range(",
    "if __name__ == ",
    "raise ValueError(",
]
SIDES = ("base", "not watching", "watching")


def _git(*args: str) -> str:
    out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"git {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


def base_rev() -> str:
    """The parent of the commit that added inference/routewatch.py."""
    added = _git("log", "--diff-filter=A", "--format=%H", "--", "inference/routewatch.py").split()
    if not added:
        raise SystemExit("inference/routewatch.py has no adding commit here: pass --base-rev")
    return _git("rev-parse", "--short", added[-1] + "^").strip()


def load_base_batch(rev: str, tmp: str):
    """``inference/batch.py`` of ``rev`` as a module of its own (the rest is this tree's)."""
    path = os.path.join(tmp, "batch_base.py")
    with open(path, "w") as f:
        f.write(_git("show", f"{rev}:inference/batch.py"))
    spec = importlib.util.spec_from_file_location("czyx_bench_batch_base", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def run_side(sched_cls, model, clients: int, tokens: int, watch: bool):
    """One level: ``clients`` requests submitted, then stepped here until done.
    Returns (cpu seconds, wall seconds, generated tokens, tokens per request, frames)."""
    from czyx.inference.batch import BatchOptions, Done, Token

    opts = BatchOptions(max_batch=16, max_queue=64, prefill_chunk=32)
    sched = sched_cls(model, opts, driven=True)
    outs: list[list[int]] = []
    done = [False] * clients
    frames = [0]
    try:
        cpu0, t0 = time.process_time(), time.perf_counter()
        for i in range(clients):
            toks: list[int] = []
            outs.append(toks)

            def on_event(ev, toks=toks, i=i):
                if type(ev).__name__ == Token.__name__:
                    toks.append(ev.token)
                elif type(ev).__name__ == Done.__name__:
                    done[i] = True
                else:
                    frames[0] += 1

            kw = {"watch": True} if watch else {}
            sched.submit(list(PROMPTS[i].encode()), tokens, on_event=on_event, **kw)
        deadline = time.perf_counter() + 300
        while not all(done) and time.perf_counter() < deadline:
            sched.step_once()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    finally:
        sched.close()
    if not all(done):
        raise RuntimeError("a level did not finish in 300 s")
    return cpu, wall, sum(map(len, outs)), outs, frames[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=256, help="tokens of the one-client request")
    ap.add_argument("--base-rev", default=None)
    ap.add_argument("--out", default=os.path.join(HERE, "WATCH.md"))
    args = ap.parse_args()

    from czyx.inference import batch as tree
    from czyx.inference.assets import bundled_model_dir
    from czyx.inference.engine import Engine
    from czyx.inference.options import BATCHED_OPTIONS
    from czyx.portals import open_consumer
    from czyx.store import Store
    from czyx.store.models.mount import mount

    rev = args.base_rev or base_rev()
    levels = ((1, args.tokens), (8, max(args.tokens // 4, 1)))
    with tempfile.TemporaryDirectory() as tmp:
        base = load_base_batch(rev, tmp)
        store = Store.open(os.path.join(tmp, "store"))
        mount(store, bundled_model_dir(), "stdlib@1")
        consumer = open_consumer(store, None, "stdlib@1", direct=True)
        engine = Engine(consumer, options=BATCHED_OPTIONS)  # czyx serve's engine
        sides = {
            "base": (base.Scheduler, False),
            "not watching": (tree.Scheduler, False),
            "watching": (tree.Scheduler, True),
        }
        cpu: dict = {(c, s): [] for c, _ in levels for s in SIDES}
        tps: dict = {(c, s): [] for c, _ in levels for s in SIDES}
        ratio: dict = {(c, s): [] for c, _ in levels for s in SIDES[1:]}
        frames: dict = {}
        loads = [os.getloadavg()[0]]
        try:
            for c, n in levels:  # warm-up: every side once, unmeasured; tokens checked equal
                want = None
                for s in SIDES:
                    _, _, _, outs, _ = run_side(*sides[s][:1], engine.model, c, n, sides[s][1])
                    if want is None:
                        want = outs
                    elif outs != want:
                        raise SystemExit(f"{s} generated other tokens than base at {c} clients")
            for r in range(args.rounds):
                for c, n in levels:
                    order = SIDES[r % 3 :] + SIDES[: r % 3]
                    got = {}
                    for s in order:
                        cls, watch = sides[s]
                        t_cpu, t_wall, gen, _, nf = run_side(cls, engine.model, c, n, watch)
                        got[s] = t_cpu / gen
                        cpu[c, s].append(1e6 * t_cpu / gen)
                        tps[c, s].append(gen / t_wall)
                        frames[c, s] = nf
                    for s in SIDES[1:]:
                        ratio[c, s].append(got[s] / got["base"] - 1)
                loads.append(os.getloadavg()[0])
        finally:
            engine.close()
            consumer.close()
            store.close()

    med = statistics.median

    def pct(xs):
        return f"{100 * med(xs):+.1f}% (from {100 * min(xs):+.1f}% to {100 * max(xs):+.1f}%)"

    rows = []
    for c, n in levels:
        for s in SIDES:
            vs = "baseline" if s == "base" else pct(ratio[c, s])
            rows.append(
                f"| {c} x {n} | {s} | {med(cpu[c, s]):.0f} | {med(tps[c, s]):.0f} | {vs} "
                f"| {frames[c, s]} |"
            )
    lines = [
        "# The live expert view's cost (bench/bench_watch.py)",
        "",
        f"Machine: {machine()}.",
        "",
        f"Command: `OPENBLAS_NUM_THREADS=1 python bench/bench_watch.py --rounds {args.rounds} "
        f"--tokens {args.tokens}`; base = `inference/batch.py` of {rev} (before the watch). "
        f"Load average during the run: {min(loads):.2f} to {max(loads):.2f} "
        f"({os.cpu_count()} vCPUs).",
        "",
        "The bundled model, resident (czyx serve's engine options), engine alone driven on "
        "this thread (no HTTP). CPU of this process per generated token, medians over "
        f"{args.rounds} interleaved rounds (the order rotating); the ratio is per round "
        "against the adjacent base run. Frames: route frames delivered in the last round.",
        "",
        "| clients x tokens | side | CPU us / token | tok/s | CPU vs base | frames |",
        "| --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
        "Not watching is the claim: no per-token work for requests that do not watch (the "
        "step reads one counter). Watching shows what the view costs the request that asks "
        "for it (per layer a copy of its top-k, the cache's state of them and the held set; "
        "the server then encodes each frame as JSON, not included here).",
        "",
    ]
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
