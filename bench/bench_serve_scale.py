"""Several tenants on a model bigger than memory: ``czyx serve`` and llama.cpp's server
under the same memory cap.

Runs on a directory written by ``bench/realshape.py gen`` (``gguf/model-q4_0.gguf`` or
``model-q8_0.gguf`` and a czyx store holding ``rs@q4`` / ``rs@q8``). For each cap (the
GGUF file's size / ``--ratios`` value: the model's stored bytes are that many times the
cap), in each round:

1. ``czyx serve`` as its users run it (no budget flag: the engine sizes its expert
   slots to the memory its group leaves it; its other defaults), in its own cgroup v1
   memory group with the cap (``memory.limit_in_bytes`` counts page cache), the model's
   files evicted from the page cache first. One untimed warm-up request, then the
   levels: N clients at once, each one non-streamed completion of ``--tokens`` tokens,
   sampled (temperature 1, its own seed), from its own prompt (``--prompt`` bytes of
   ``store/models/mount.py`` from its own offset; llama.cpp's server takes the text,
   czyx the ids llama.cpp's tokenizer gives it: the same prompt tokens for both).
2. llama.cpp's server (``bench/_llama_server.py``: llama-cpp-python's own app, mmap, its
   default, the model not locked in memory, as many threads as czyx's kernels) in a fresh
   group with the same cap, the
   files evicted again, the same warm-up and the same requests (``--llama-levels``: it
   serves one request at a time, so its aggregate does not grow with the clients, and
   a level of many clients under a cap takes it minutes).

Reported per level: aggregate generated tokens per second (usage counts / wall time of
the level), x one client, the median and slowest request's latency, bytes read from
storage per generated token (the server process's ``/proc/PID/io`` ``read_bytes``:
O_DIRECT reads and mmap faults alike), for czyx the generated tokens per batched step
(its ``/metrics``), and each server's group peak memory and OOM kills over its whole
run. ``--resident`` adds czyx serve with no cap (every expert fits its default budget;
slots fill as experts are first used) as the reference its capped run is compared with;
``--compare-args`` a second czyx serve with other flags in the same rounds and caps.

The prompts are made by llama.cpp's tokenizer, so the bench needs llama-cpp-python even
with ``--llama-levels ''``. Every request targets 127.0.0.1, every level is bounded by
``--level-budget`` seconds, every server start by ``--start-budget``. Writes ``--md``
(``bench/SERVE-SCALE.md``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _machine import machine  # noqa: E402
from _rs_run import read_bytes  # noqa: E402
from bench_scale import (  # noqa: E402
    TEXT,
    add_model_args,
    cgroups_writable,
    close_group,
    evict,
    in_group,
    model_pair,
    open_group,
)
from bench_serve import _free_port, _metric  # noqa: E402
from realshape import GGUF_OF  # noqa: E402

LOOPBACK = "127.0.0.1"


class Server:
    """A server subprocess on 127.0.0.1, in its own memory group capped at ``cap`` bytes
    (None: no group), started once ``ready`` answers 200."""

    def __init__(
        self, name: str, cmd: list[str], port: int, ready: str, cap: int | None, start_budget: float
    ) -> None:
        import httpx

        self.name, self.cap, self.port = name, cap, port
        self.url = f"http://{LOOPBACK}:{port}"
        self.group = None
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (open while the server runs)
        if cap is not None:
            self.group = open_group(f"serve-scale-{name}", cap)
            cmd = in_group(self.group, cmd)
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=self.log, env=env, text=True
        )
        deadline = time.monotonic() + start_budget
        while True:
            if self.proc.poll() is not None:  # (its group removed; OOM kills named)
                why = f"{name} exited (rc {self.proc.returncode}): {self.tail()}"
                raise RuntimeError(f"{why} (OOM kills: {self.stop()['oom_kills']})")
            try:
                if httpx.get(self.url + ready, timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                why = self.tail()
                self.stop()
                raise RuntimeError(f"{name} did not answer {ready} in {start_budget:.0f} s: {why}")
            time.sleep(0.25)
        self.start_s = time.perf_counter() - t0

    def tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-2000:]

    def read_bytes(self) -> int:
        return read_bytes(self.proc.pid)

    def metrics(self) -> str:
        import httpx

        return httpx.get(self.url + "/metrics", timeout=30).text

    def stop(self) -> dict:
        """End the server; the group's peak memory and OOM kills over the whole run."""
        out: dict = {"rc": None, "group_peak": None, "oom_kills": None}
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        out["rc"] = self.proc.returncode
        if self.group is not None:
            out.update(close_group(self.group))
            self.group = None
        self.log.close()
        return out


class Prompts:
    """Each client's prompt: ``n`` bytes of the text from its own offset, as text for
    llama.cpp's server (its completions take no token ids) and as the ids llama.cpp's
    tokenizer gives that text for czyx (``/v1/completions`` takes ids): the same tokens
    for both engines."""

    def __init__(self, gguf: Path, text: bytes, n: int) -> None:
        import llama_cpp
        from _llama import without_extra_bufts

        self.text, self.n = text, n
        with without_extra_bufts():
            self._vocab = llama_cpp.Llama(str(gguf), vocab_only=True, verbose=False)

    def get(self, key: int) -> tuple[str, list[int]]:
        off = (key * 7919) % (len(self.text) - self.n)
        s = self.text[off : off + self.n].decode("ascii", errors="replace")
        # As llama-cpp-python's server tokenizes a completion's prompt.
        return s, self._vocab.tokenize(s.encode("utf-8"), add_bos=True, special=True)


def request_bodies(
    prompts: Prompts, who: str, model: str, n: int, level_key: int, tokens: int
) -> list[dict]:
    """``n`` clients' completion requests: each its own prompt and seed; ``level_key``
    keeps levels and rounds apart (no prompt shared across them)."""
    bodies = []
    for i in range(n):
        key = level_key * 64 + i
        text, ids = prompts.get(key)
        bodies.append(
            {
                "model": model,
                "prompt": ids if who == "czyx" else text,
                "max_tokens": tokens,
                "temperature": 1.0,
                "top_p": 1.0,
                "seed": key,
                "stream": False,
            }
        )
    return bodies


async def _post_all(url: str, headers: dict, bodies: list[dict], budget: float) -> list[dict]:
    import httpx

    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(timeout=budget, limits=limits) as client:

        async def one(body):
            t0 = time.perf_counter()
            r = await client.post(url + "/v1/completions", json=body, headers=headers)
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
            usage = r.json()["usage"]
            return {
                "tokens": int(usage["completion_tokens"]),
                "prompt": int(usage["prompt_tokens"]),
                "s": time.perf_counter() - t0,
            }

        return await asyncio.wait_for(asyncio.gather(*(one(b) for b in bodies)), budget)


@dataclass
class Level:
    clients: int
    tokens: int
    wall: float
    latencies: list[float]
    read_bytes: int
    load: float
    prompt_tokens: float  # per request, as the server counted them
    per_step: float = float("nan")  # czyx: generated tokens per batched step

    @property
    def tps(self) -> float:
        return self.tokens / self.wall

    @property
    def bytes_per_token(self) -> float:
        return self.read_bytes / max(self.tokens, 1)


def run_level(srv: Server, headers: dict, bodies: list[dict], budget: float, czyx: bool) -> Level:
    m0 = srv.metrics() if czyx else ""
    r0 = srv.read_bytes()
    t0 = time.perf_counter()
    res = asyncio.run(_post_all(srv.url, headers, bodies, budget))
    wall = time.perf_counter() - t0
    lv = Level(
        len(bodies),
        sum(r["tokens"] for r in res),
        wall,
        sorted(r["s"] for r in res),
        srv.read_bytes() - r0,
        os.getloadavg()[0],
        statistics.mean(r["prompt"] for r in res),
    )
    if czyx:
        m1 = srv.metrics()

        def d(name):
            return _metric(m1, name) - _metric(m0, name)

        steps = d("czyx_steps_total")
        lv.per_step = lv.tokens / steps if steps else float("nan")
    return lv


def start_czyx(a, store: Path, tag: str, cap: int | None, extra: str) -> Server:
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "czyx",
        "serve",
        tag,
        "--store",
        str(store),
        "--port",
        str(port),
        "--no-audit",
        *shlex.split(extra),
    ]
    return Server("czyx", cmd, port, "/health", cap, a.start_budget)


def start_llama(a, gguf: Path, cap: int | None) -> Server:
    from czyx.inference.kernels.fused import default_threads

    port = _free_port()
    cmd = [
        sys.executable,
        str(HERE / "_llama_server.py"),
        str(gguf),
        str(port),
        str(default_threads()),
        "--no-mlock",
    ]
    return Server("llama", cmd, port, "/v1/models", cap, a.start_budget)


def serve_levels(
    a,
    srv: Server,
    who: str,
    name: str,
    model: str,
    headers: dict,
    levels: list[int],
    prompts: Prompts,
    rnd: int,
) -> dict[int, Level]:
    czyx = who == "czyx"
    warm = request_bodies(prompts, who, model, 1, 10_000 + rnd, a.warmup)
    t0 = time.perf_counter()
    asyncio.run(_post_all(srv.url, headers, warm, a.level_budget))
    print(
        f"  {name}: started in {srv.start_s:.1f} s, warm-up {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    out = {}
    for n in levels:
        bodies = request_bodies(prompts, who, model, n, rnd * 100 + n, a.tokens)
        lv = run_level(srv, headers, bodies, a.level_budget, czyx)
        out[n] = lv
        print(
            f"  {name} {n} clients: {lv.tps:.2f} tok/s, {lv.bytes_per_token / 1e6:.1f} MB/token"
            f" (load {lv.load:.1f})",
            flush=True,
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap, "q4")
    ap.add_argument("--ratios", type=float, nargs="*", default=[1.8])
    ap.add_argument("--levels", default="1,2,4,8")
    ap.add_argument("--llama-levels", default="1,2", help="'' for none")
    ap.add_argument("--resident", action="store_true", help="also czyx serve with no cap")
    ap.add_argument("--prompt", type=int, default=16, help="bytes of text per prompt")
    ap.add_argument("--tokens", type=int, default=24, help="generated tokens per request")
    ap.add_argument("--warmup", type=int, default=24, help="tokens of the warm-up request")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--level-budget", type=float, default=600.0, help="seconds per level")
    ap.add_argument("--start-budget", type=float, default=600.0, help="seconds per start")
    ap.add_argument(
        "--czyx-args", default="", help="more czyx serve flags (default none: as users run it)"
    )
    ap.add_argument(
        "--compare-args",
        default=None,
        help="also czyx serve with these flags instead, in the same rounds and caps "
        "(e.g. '--io pread')",
    )
    ap.add_argument("--md", default=str(HERE / "SERVE-SCALE.md"))
    a = ap.parse_args(argv)
    _, store, shape, gguf = model_pair(a)
    tag = a.tag
    levels = [int(x) for x in a.levels.split(",")]
    llama_levels = [int(x) for x in a.llama_levels.split(",") if x]
    prompts = Prompts(gguf, TEXT.read_bytes(), a.prompt)
    why = cgroups_writable()
    if why is not None:
        raise SystemExit(f"the capped runs need a writable memory cgroup: {why}")
    stored = gguf.stat().st_size
    blocks = sorted(p for p in store.rglob("*") if p.is_file() and p.stat().st_size > 1 << 20)
    files = [gguf, *blocks]
    from czyx import portals
    from czyx.store import Store

    with Store.open(str(store), create=False) as st:
        token = portals.root_token(st)
    auth = {"Authorization": f"Bearer {token}"}
    load0, started = os.getloadavg(), time.time()

    # (name, engine, stored / cap or None for no cap, czyx serve flags)
    specs = [(_czyx_name(a.czyx_args), "czyx", r, a.czyx_args) for r in a.ratios]
    if a.compare_args is not None:
        specs += [(_czyx_name(a.compare_args), "czyx", r, a.compare_args) for r in a.ratios]
    if llama_levels:
        specs += [("llama.cpp server", "llama", r, "") for r in a.ratios]
    if a.resident:
        specs.append((_czyx_name(a.czyx_args), "czyx", None, a.czyx_args))
    runs: dict[tuple, list[tuple[dict[int, Level], dict]]] = {}
    for rnd in range(a.rounds):
        print(f"round {rnd + 1} of {a.rounds} (load {os.getloadavg()[0]:.1f})", flush=True)
        for spec in specs if rnd % 2 == 0 else specs[::-1]:
            name, who, ratio, extra = spec
            cap = int(stored / ratio) if ratio else None
            evict(files)
            if who == "czyx":
                srv = start_czyx(a, store, tag, cap, extra)
            else:
                srv = start_llama(a, gguf, cap)
            try:
                lv = serve_levels(
                    a,
                    srv,
                    who,
                    name,
                    tag if who == "czyx" else "llama",
                    auth,
                    levels if who == "czyx" else llama_levels,
                    prompts,
                    rnd,
                )
            finally:
                end = srv.stop()
            end["start_s"] = srv.start_s
            runs.setdefault(spec, []).append((lv, end))

    write_report(a, runs, shape, gguf, stored, tag, levels, load0, started)
    return 0


def _fmt(x: float, spec: str) -> str:
    return "-" if x != x else format(x, spec)


def _czyx_name(args: str) -> str:
    return f"czyx serve {args}".strip() if args else "czyx serve"


def _med(xs) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def write_report(a, runs, shape, gguf, stored, tag, levels, load0, started) -> None:
    cmd = "OPENBLAS_NUM_THREADS={} python bench/bench_serve_scale.py {}".format(
        os.environ.get("OPENBLAS_NUM_THREADS", "unset"), shlex.join(sys.argv[1:])
    )
    lines = [
        "# Several tenants on a model bigger than memory (generated by bench/bench_serve_scale.py)",
        "",
        f"Machine: {machine()}. Load average {' / '.join(f'{x:.1f}' for x in load0)} before, "
        f"{' / '.join(f'{x:.1f}' for x in os.getloadavg())} after; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, "
        f"{(time.time() - started) / 60:.1f} min.",
        "",
        f"Command: `{cmd}` (the model: `python bench/realshape.py gen --out {a.out}"
        f"{' --full' if shape['arch'] != 'olmoe' else ''}"
        f"{' --no-hf' if shape.get('source') == 'gguf' else ''} --gguf {GGUF_OF[a.format]} "
        f"--czyx {a.format}`)",
        "",
        f"Model: `bench/realshape.py` {shape['arch']} shape, {shape['layers']} layers, "
        f"{shape.get('experts', '?')} experts top-{shape.get('top_k', '?')}, vocab "
        f"{shape['vocab']}. llama.cpp: `{gguf.name}` ({stored / 2**20:.0f} MiB, mmap, its default; "
        "not locked in memory: llama-cpp-python's server locks the model by default, and "
        "locked it was killed as it loaded under the cap; llama.cpp's own llama-server does "
        "not lock); czyx: "
        f"`{tag}` (`czyx serve` with no budget flag: its default expert budget, sized to the "
        f"memory its group leaves it{f'; `{a.czyx_args}`' if a.czyx_args else ''}). "
        "Each level: N clients at once on their own "
        f"connections, each one non-streamed completion of {a.tokens} tokens (temperature 1, "
        f"its own seed) from its own prompt ({a.prompt} bytes of text; czyx given the ids "
        "llama.cpp's tokenizer makes of it: the prompt tokens column); one untimed "
        f"{a.warmup}-token "
        "request after each server start. Each server in a fresh cgroup v1 memory group, the "
        f"model's files evicted first; {a.rounds} round(s), the order of the servers "
        "alternating; medians over the rounds.",
        "",
        "| server | cap | clients | tok/s | x 1 client | request latency p50 / max s "
        "| prompt tokens | MB read / token | czyx tokens / step | group peak | OOM kills | load |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (name, _engine, ratio, _args), rs in runs.items():
        cap = "none" if ratio is None else f"{stored / ratio / 2**20:.0f} MiB (stored {ratio:g}x)"
        one = _med(r[0][min(r[0])].tps for r in rs)
        for n in sorted(rs[0][0]):
            lv = [r[0][n] for r in rs]
            tps = _med(x.tps for x in lv)
            peak = _med(r[1]["group_peak"] or float("nan") for r in rs)
            ooms = sum(r[1]["oom_kills"] or 0 for r in rs)
            lines.append(
                f"| {name} | {cap} | {n} | {tps:.2f} | {tps / one:.2f} | "
                f"{_med(x.latencies[len(x.latencies) // 2] for x in lv):.1f} / "
                f"{_med(x.latencies[-1] for x in lv):.1f} | "
                f"{_med(x.prompt_tokens for x in lv):.1f} | "
                f"{_med(x.bytes_per_token for x in lv) / 1e6:.1f} | "
                f"{_fmt(_med(x.per_step for x in lv), '.2f')} | "
                f"{'-' if peak != peak else f'{peak / 2**20:.0f} MiB'} | "
                f"{'-' if ratio is None else ooms} | {_med(x.load for x in lv):.1f} |"
            )
    lines.append("")
    top, first = max(levels), levels[0]

    def tps(spec, n):
        return _med(r[0][n].tps for r in runs[spec])

    main_name = _czyx_name(a.czyx_args)
    for ratio in a.ratios:
        spec = (main_name, "czyx", ratio, a.czyx_args)
        agg = tps(spec, top)
        parts = [
            f"Stored {ratio:g}x the cap: {main_name} {agg:.2f} tok/s at {top} clients, "
            f"{agg / tps(spec, first):.2f}x its {first} client(s)"
        ]
        if a.compare_args is not None:
            other = (_czyx_name(a.compare_args), "czyx", ratio, a.compare_args)
            parts.append(
                f"{tps(spec, first) / tps(other, first):.2f}x / {agg / tps(other, top):.2f}x "
                f"{other[0]} at {first} / {top} clients"
            )
        ll = ("llama.cpp server", "llama", ratio, "")
        if ll in runs:
            best = max(tps(ll, n) for n in runs[ll][0][0])
            parts.append(
                f"{agg / best:.1f}x llama.cpp's server at its best level ({best:.2f} tok/s)"
            )
        res = (main_name, "czyx", None, a.czyx_args)
        if res in runs:
            parts.append(
                f"{agg / tps(res, top):.2f}x {main_name} with no cap at {top} clients "
                f"({tps(res, top):.2f} tok/s)"
            )
        lines.append("; ".join(parts) + ".")
        lines.append("")
    Path(a.md).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
