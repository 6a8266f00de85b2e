"""Bigger than memory: czyx and llama.cpp on the real-shape model under the same memory cap.

Runs on a directory written by ``bench/realshape.py gen`` (``gguf/model-q8_0.gguf`` and a
czyx store holding the q8 version, or with ``--format q4`` ``model-q4_0.gguf`` and ``rs@q4``:
the full Qwen3-30B-A3B shape is generated in q4 only).

1. Resident (no cap): each engine once, the reference speeds.
2. Capped: for each ``--ratios`` value r the cap is the GGUF file's size / r (the
   model's stored bytes are r times the cap). Each engine runs in its own cgroup
   v1 memory group (``/sys/fs/cgroup/memory/<group>``, ``memory.limit_in_bytes``,
   which counts page cache) with that cap, after the model's files are evicted
   from the page cache (``posix_fadvise(DONTNEED)``: pages already cached stay
   charged to whoever read them first, so the cap would not bite). llama.cpp as
   its users run it (mmap, its default); czyx with its slot cache sized to fit
   inside the cap (the cap minus what its resident run held besides the
   experts, minus a margin; or with ``--czyx-budget default`` as its users run
   it, no budget given: the engine sizes its slots to the group's room),
   O_DIRECT reads, the engine's prefetch. Reported: prefill and
   decode tokens/s, bytes read from storage per decoded token
   (``/proc/self/io``), czyx's hit rate, the group's peak memory
   (``memory.max_usage_in_bytes``) and whether the kernel killed anything.
   Where cgroups are not writable, this part is skipped with a message.
3. The dial: czyx (no cgroup) with slot budgets of 100/50/25/12.5 % of the
   expert bytes: decode tokens/s, hit rate, bytes read per token.
4. The overlap bound, for every capped and dial czyx run, from the same round:
   the read time of exactly the extents that run read (re-read afterwards in
   its process with the same O_DIRECT path and no compute, ``_rs_run.py
   --bound``), the compute time per token of the resident czyx run, their
   maximum (the time a token would take if reads and compute overlapped fully)
   and sum (if they ran one after the other), the run's own time per token as
   a fraction of the bound (1: at the bound), the exposed I/O wait per token,
   and how early before its first use each read was requested; and the bytes
   the engine read over the timed tokens against Belady's offline optimum on
   the same run's routing with the same slot count.

``--no-llama`` runs czyx alone (where llama-cpp-python is not built).

Decode is teacher-forced (see ``bench/_rs_run.py``). Writes ``--md``
(``bench/SCALE.md``) with the machine, load averages, every figure and the
command.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CG = Path("/sys/fs/cgroup/memory")
TEXT = HERE.parent / "store" / "models" / "mount.py"

sys.path.insert(0, str(HERE))
from _machine import machine  # noqa: E402
from realshape import GGUF_OF, stats_rows, stats_table  # noqa: E402


def evict(paths: list[Path]) -> None:
    """Drop the files' pages from the page cache (posix_fadvise DONTNEED)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cgroups_writable() -> str | None:
    """None when a memory group can be made and capped here, else why not."""
    if not (CG / "memory.limit_in_bytes").exists():
        return f"{CG} is not a cgroup v1 memory controller"
    probe = CG / f"czyx-probe-{os.getpid()}"
    try:
        probe.mkdir()
        (probe / "memory.limit_in_bytes").write_text(str(1 << 30))
    except OSError as exc:
        return f"cannot create a memory group: {exc}"
    finally:
        if probe.exists():
            probe.rmdir()
    return None


def open_group(name: str, cap: int) -> Path:
    """A fresh cgroup v1 memory group capped at ``cap`` bytes (page cache counted, no swap)."""
    group = CG / f"czyx-{name}-{os.getpid()}"
    group.mkdir()
    (group / "memory.limit_in_bytes").write_text(str(cap))
    (group / "memory.swappiness").write_text("0")
    return group


def in_group(group: Path, cmd: list[str]) -> list[str]:
    """``cmd`` run as a member of ``group`` (the shell joins it, then execs ``cmd``)."""
    return ["sh", "-c", f"echo $$ > {group}/cgroup.procs && exec {shlex.join(cmd)}"]


def close_group(group: Path) -> dict:
    """The group's peak memory, limit hits and OOM kills; the group removed once empty."""
    oom = (group / "memory.oom_control").read_text()
    res = {
        "group_peak": int((group / "memory.max_usage_in_bytes").read_text()),
        "failcnt": int((group / "memory.failcnt").read_text()),
        "oom_kills": int(
            next((ln.split()[1] for ln in oom.splitlines() if ln.startswith("oom_kill ")), 0)
        ),
    }
    for _ in range(100):  # the group empties once its process has exited
        try:
            group.rmdir()
            break
        except OSError:
            time.sleep(0.1)
    return res


def run(args: list[str], cap: int | None, name: str) -> dict:
    """Run ``_rs_run.py args`` (in a fresh memory group capped at ``cap`` bytes)."""
    out = Path(f"/tmp/czyx-scale-{os.getpid()}-{name}.json")
    cmd = [sys.executable, str(HERE / "_rs_run.py"), *args, "--json", str(out)]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    group = None
    if cap is not None:
        group = open_group(f"scale-{name}", cap)
        cmd = in_group(group, cmd)
    t0 = time.perf_counter()
    res: dict = {}
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        res = json.loads(out.read_text()) if proc.returncode == 0 else {}
        res["rc"] = proc.returncode
        if proc.returncode != 0:
            res["stderr"] = proc.stderr[-2000:]
    finally:
        if group is not None:
            res.update(cap=cap, **close_group(group))
        out.unlink(missing_ok=True)
    res["wall_s"] = time.perf_counter() - t0
    return res


def _skipped() -> dict:
    return {"rc": -2, "stderr": "llama.cpp not run (--no-llama)"}


def one_round(a, llama: list[str], czyx: list[str], files, stored: int, capped_ok: bool):
    """Resident, capped and dial runs once, each engine a fresh process, files evicted first."""
    res_l = run(llama, None, "llama-resident") if not a.no_llama else _skipped()
    res_c = run([*czyx, "--prewarm"], None, "czyx-resident")
    print(fmt_row("llama resident", res_l), flush=True)
    print(fmt_row("czyx resident", res_c), flush=True)
    # what czyx holds besides its expert slots, from its resident run
    other = res_c.get("vm_hwm", 0) - res_c.get("expert_bytes", 0)
    capped = []
    for r in a.ratios if capped_ok else []:
        cap = int(stored / r)
        budget_mb = int((cap * (1 - a.margin) - other) / 2**20)
        evict(files)
        rl = run(llama, cap, f"llama-{r}") if not a.no_llama else _skipped()
        print(fmt_row(f"llama cap {cap / 2**20:.0f} MiB", rl), flush=True)
        evict(files)
        if a.czyx_budget == "default":  # as a user runs it: the engine sizes its slots
            rc = run([*czyx, "--default-budget", "--bound"], cap, f"czyx-{r}")
            budget_mb = int(rc.get("budget_bytes", 0) / 2**20)
        elif budget_mb <= 0:
            rc = {"rc": -1, "stderr": f"no room for slots: {other / 2**20:.0f} MiB besides"}
        else:
            rc = run([*czyx, "--cache-mb", str(budget_mb), "--bound"], cap, f"czyx-{r}")
        print(fmt_row(f"czyx cap {cap / 2**20:.0f} MiB ({budget_mb} MiB slots)", rc), flush=True)
        capped.append((r, cap, rl, rc, budget_mb))
    dial = []
    exp_mb = res_c.get("expert_bytes", 0) / 2**20
    for f in a.dial:
        mb = max(1, int(exp_mb * f))
        evict(files)
        rd = run([*czyx, "--cache-mb", str(mb), "--bound"], None, f"dial-{f}")
        print(fmt_row(f"czyx dial {f:.3f} ({mb} MiB)", rd), flush=True)
        dial.append((f, mb, rd))
    return res_l, res_c, capped, dial


def _median_run(runs: list[dict]) -> dict:
    """The run with the median decode speed (a failed run counts as the slowest)."""
    order = sorted(runs, key=lambda r: r.get("decode_tok_s", -1.0) if r.get("rc") == 0 else -1.0)
    return order[(len(order) - 1) // 2]


def bound_of(run_: dict, resident: dict) -> dict | None:
    """The overlap-bound figures of one streamed run against the same round's resident run."""
    if run_.get("rc") != 0 or resident.get("rc") != 0 or "raw_read_s" not in run_:
        return None
    n = max(1, run_["n_decode"])
    read = run_["raw_read_s"] / n
    compute = resident["decode_s"] / max(1, resident["n_decode"])
    actual = run_["decode_s"] / n
    return {
        "read": read,
        "compute": compute,
        "bound": max(read, compute),
        "serial": read + compute,
        "actual": actual,
        "fraction": max(read, compute) / actual,
        "exposed": run_["exposed_wait_s"] / n,
        "busy": run_.get("device_busy_s", float("nan")) / n,
        "in_flight": run_.get("reads_in_flight", float("nan")),
        "lead_med": run_["lead_us_median"],
        "lead_p10": run_["lead_us_p10"],
        "mb": run_["raw_read_bytes"] / n / 1e6,
        "vs_belady": run_["bytes_read"] / max(1, run_["belady_read_bytes"]),
    }


def bound_rows(label: str, per_round: list[dict | None]) -> str:
    """A table row: the round with the median fraction, and every round's fraction."""
    got = sorted((b for b in per_round if b is not None), key=lambda b: b["fraction"])
    if not got:
        return f"| {label} | failed | | | | | | | | | | |"
    b = got[(len(got) - 1) // 2]
    each = ", ".join(f"{x['fraction']:.2f}" for x in got)
    return (
        f"| {label} | {b['mb']:.1f} | {b['read'] * 1e3:.1f} | {b['compute'] * 1e3:.1f} | "
        f"{b['bound'] * 1e3:.1f} | {b['serial'] * 1e3:.1f} | {b['actual'] * 1e3:.1f} | "
        f"{b['fraction']:.2f} ({each}) | {b['exposed'] * 1e3:.1f} | "
        f"{b['busy'] * 1e3:.1f} ({b['in_flight']:.2f}) | "
        f"{b['lead_med']:.0f} / {b['lead_p10']:.0f} | {b['vs_belady']:.2f} |"
    )


def fmt_row(label: str, r: dict) -> str:
    if r.get("rc", 0) == -2:
        return f"| {label} | not run | | | | | |"
    if r.get("rc", 0) != 0:
        return f"| {label} | failed (rc {r.get('rc')}) | | | | | |"
    bpt = r.get("decode_read_bytes", 0) / max(1, r["n_decode"])
    hit = f"{r['hit_rate']:.3f}" if "hit_rate" in r else "-"
    peak = f"{r['group_peak'] / 2**20:.0f} MiB" if "group_peak" in r else "-"
    kills = str(r.get("oom_kills", "-"))
    return (
        f"| {label} | {r['prefill_tok_s']:.2f} | {r['decode_tok_s']:.2f} | {bpt / 1e6:.1f} | "
        f"{hit} | {peak} | {kills} |"
    )


def add_model_args(ap: argparse.ArgumentParser, fmt: str) -> None:
    """The flags naming a ``realshape.py gen`` directory's model pair (default ``fmt``)."""
    ap.add_argument("--out", required=True, help="realshape directory")
    ap.add_argument("--store", default=None, help="czyx store (default OUT/store)")
    ap.add_argument("--format", choices=sorted(GGUF_OF), default=fmt, help="q8 or q4 pair")
    ap.add_argument("--tag", default=None, help="czyx version (default rs@FORMAT)")


def model_pair(a: argparse.Namespace) -> tuple[Path, Path, dict, Path]:
    """The directory, czyx store, shape and GGUF file the flags name; sets ``a.tag``."""
    out = Path(a.out)
    store = Path(a.store) if a.store else out / "store"
    shape = json.loads((out / "shape.json").read_text())
    a.tag = a.tag or f"rs@{a.format}"
    return out, store, shape, out / "gguf" / f"model-{GGUF_OF[a.format]}.gguf"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap, "q8")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=8, help="untimed decode tokens first")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ratios", type=float, nargs="*", default=[1.8, 3.6])
    ap.add_argument("--dial", type=float, nargs="*", default=[1.0, 0.5, 0.25, 0.125])
    ap.add_argument("--margin", type=float, default=0.1, help="czyx cap headroom fraction")
    ap.add_argument(
        "--czyx-budget",
        choices=["fit", "default"],
        default="fit",
        help="capped czyx slots: fit (the cap less its resident run's other memory, less the "
        "margin) or default (no budget given: the engine's own, from the group's room)",
    )
    ap.add_argument("--md", default=str(HERE / "SCALE.md"))
    ap.add_argument("--no-llama", action="store_true", help="czyx alone (llama.cpp not built)")
    ap.add_argument(
        "--prefetch-evicts", action="store_true", help="czyx: predictions may evict (the option)"
    )
    ap.add_argument("--policy", default=None, help="czyx: eviction policy (default: the engine's)")
    ap.add_argument("--stats-tokens", type=int, default=256)
    ap.add_argument(
        "--rounds", type=int, default=1, help="interleaved rounds; each row is its median round"
    )
    a = ap.parse_args(argv)
    out, store, shape, gguf = model_pair(a)
    # realshape --no-hf: czyx mounted the GGUF file itself (Q4_0 / Q8_0 repacked losslessly)
    same = " Both hold the same codes." if shape.get("source") == "gguf" else ""
    slots = (
        "the engine's default, no budget given"
        if a.czyx_budget == "default"
        else f"the cap less the resident run's other memory, less {a.margin:.0%}"
    )
    load0 = os.getloadavg()

    routing = stats_table(stats_rows(out, a.tag, TEXT, a.stats_tokens))
    print("\n".join(routing), flush=True)
    common = [
        "--vocab",
        str(shape["vocab"]),
        "--text",
        str(TEXT),
        "--prompt",
        str(a.prompt),
        "--tokens",
        str(a.tokens),
        "--warmup",
        str(a.warmup),
        "--threads",
        str(a.threads),
    ]
    llama = ["--engine", "llama", "--model", str(gguf), *common]
    czyx = ["--engine", "czyx", "--store", str(store), "--tag", a.tag, *common]
    if a.prefetch_evicts:
        czyx.append("--prefetch-evicts")
    if a.policy:
        czyx += ["--policy", a.policy]
    blocks = sorted(p for p in store.rglob("*") if p.is_file() and p.stat().st_size > 1 << 20)
    files = [gguf, *blocks]
    stored = gguf.stat().st_size
    rows: list[tuple[str, dict]] = []
    print(f"model: {shape['arch']} {shape['layers']} layers, {gguf.name} {stored / 1e9:.2f} GB")

    why = cgroups_writable()
    if why is not None:
        print(f"skipping the capped runs: {why}")
    rounds = []
    for k in range(a.rounds):
        print(f"round {k + 1} of {a.rounds} (load {os.getloadavg()[0]:.1f})", flush=True)
        rounds.append(one_round(a, llama, czyx, files, stored, why is None))
    res_l = _median_run([r[0] for r in rounds])
    res_c = _median_run([r[1] for r in rounds])
    rows += [
        (f"llama.cpp {GGUF_OF[a.format]}, resident", res_l),
        (f"czyx {a.format}, resident", res_c),
    ]
    capped = [
        (*rounds[0][2][j][:2], _median_run([r[2][j][2] for r in rounds]),
         _median_run([r[2][j][3] for r in rounds]), rounds[0][2][j][4])
        for j in range(len(rounds[0][2]))
    ]  # fmt: skip
    dial = [
        (*rounds[0][3][j][:2], _median_run([r[3][j][2] for r in rounds]))
        for j in range(len(rounds[0][3]))
    ]
    # Ratios per round (both engines of a round ran back to back), then their median.
    ratios = []
    for j, (r, *_rest) in enumerate(capped):
        vs_llama, vs_res = [], []
        for rl0, rc0, rr in ((x[2][j][2], x[2][j][3], x[1]) for x in rounds):
            if rc0.get("rc") == 0 and rr.get("rc") == 0:
                vs_res.append(rc0["decode_tok_s"] / rr["decode_tok_s"])
                if rl0.get("rc") == 0:
                    vs_llama.append(rc0["decode_tok_s"] / rl0["decode_tok_s"])
        ratios.append((r, vs_llama, vs_res))
    load1 = os.getloadavg()

    cmd = "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    head = (
        "| run | prefill tok/s | decode tok/s | MB read / decode token | hit rate | "
        "group peak | OOM kills |"
    )
    sep = "|---|---|---|---|---|---|---|"
    md = [
        "# Bigger than memory (generated by bench/bench_scale.py)",
        "",
        f"Machine: {machine()}. Load average {load0[0]:.1f} / {load0[1]:.1f} / {load0[2]:.1f} "
        f"before, {load1[0]:.1f} / {load1[1]:.1f} / {load1[2]:.1f} after.",
        "",
        f"Command: `{cmd}`",
        "",
        f"Model: `bench/realshape.py` {shape['arch']} shape, {shape['layers']} of its layers "
        f"(seed {shape['seed']}, mix {shape['mix']}), {shape['experts']} experts top-"
        f"{shape['top_k']}, hidden {shape['hidden']}, expert intermediate {shape['inter']}, "
        f"vocab {shape['vocab']}. llama.cpp: `{gguf.name}` ({stored / 2**20:.0f} MiB, mmap); "
        f"czyx: `{a.tag}` ({a.format} experts and matrices, routers float; O_DIRECT slot "
        f"cache, eviction policy {a.policy or 'the default'}, predictions "
        f"{'that may evict' if a.prefetch_evicts else 'into free slots'}, the per-expert "
        "pipeline; capped slots: "
        f"{slots}).{same} {a.prompt}-token prompt, "
        f"{a.warmup} untimed then "
        f"{a.tokens} timed teacher-forced decode tokens (the resident czyx run prewarms every "
        f"expert), {a.threads} threads each, wall clock; {a.rounds} interleaved round(s), each row "
        "the round with the median decode speed.",
        "",
        f"## Routing ({a.stats_tokens} tokens of `{TEXT.relative_to(HERE.parent)}`, "
        "czyx prefill, resident)",
        "",
        *routing,
        "",
        "## Resident and capped",
        "",
        head,
        sep,
    ]
    for label, r in rows:
        md.append(fmt_row(label, r))
    if why is not None:
        md += ["", f"Capped runs skipped: {why}."]
    for r, cap, rl, rc, budget_mb in capped:
        md.append(fmt_row(f"llama.cpp, cap {cap / 2**20:.0f} MiB (stored {r}x cap)", rl))
        md.append(
            fmt_row(f"czyx, cap {cap / 2**20:.0f} MiB (stored {r}x cap), {budget_mb} MiB slots", rc)
        )
    md += ["", f"Ratios (decode tok/s; median of the {a.rounds} rounds' own ratios):", ""]
    for r, vs_llama, vs_res in ratios:
        if vs_llama:
            each = ", ".join(f"{x:.2f}" for x in vs_llama)
            md.append(
                f"- stored {r}x cap: czyx / llama.cpp = {statistics.median(vs_llama):.2f}x "
                f"(rounds: {each}); czyx capped / czyx resident = "
                f"{statistics.median(vs_res):.2f}x"
            )
        elif vs_res:
            each = ", ".join(f"{x:.2f}" for x in vs_res)
            md.append(
                f"- stored {r}x cap: czyx capped / czyx resident = "
                f"{statistics.median(vs_res):.2f}x (rounds: {each}); llama.cpp not run"
            )
        else:
            md.append(f"- stored {r}x cap: a run failed (see the table)")
    if dial:  # (--dial with no fractions: no section)
        md += ["", "## The dial (czyx, no cgroup, files evicted first)", "", head, sep]
        for f, mb, rd in dial:
            md.append(fmt_row(f"{f * 100:g} % of expert bytes ({mb} MiB)", rd))
    md += [
        "",
        "## The overlap bound (czyx, same round)",
        "",
        "Per decode token: MB read; the raw O_DIRECT read time of exactly the extents the "
        "run read, re-read afterwards in its process with no compute; the resident run's "
        "compute time; the bound max(read, compute) and the serial sum; the run's own time; "
        "bound / own time (1: at the bound; the median round, then every round); the exposed "
        "I/O wait; the time the run's own reads kept the device busy (any in flight) and how "
        "many were in flight on average then (the bound's read is one thread reading in a row; "
        "a device that serves one stream faster than several shows it here); how early each "
        "read was requested before its first use (median / 10th "
        "percentile, microseconds); the expert bytes the engine read over the timed tokens "
        "(prefetches included) over Belady's offline optimum on the run's own routing with "
        "its slot count.",
        "",
        "| run | MB read | read ms | compute ms | bound ms | serial ms | own ms | "
        "bound / own | exposed wait ms | device busy ms (reads in flight) | "
        "lead us (median / p10) | bytes / Belady |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for j, (r, cap, _rl, _rc, _mb) in enumerate(capped):
        per = [bound_of(x[2][j][3], x[1]) for x in rounds]
        md.append(bound_rows(f"cap {cap / 2**20:.0f} MiB (stored {r}x cap)", per))
    for j, (f, _mb, _rd) in enumerate(dial):
        per = [bound_of(x[3][j][2], x[1]) for x in rounds]
        md.append(bound_rows(f"dial {f * 100:g} %", per))
    for label, r in [*rows, *[(f"cap {c[0]}", c[3]) for c in capped]]:
        if r.get("rc", 0) not in (0, -2):
            md += ["", f"{label} stderr tail: `{r.get('stderr', '')[-300:]}`"]
    md.append("")
    Path(a.md).write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
