"""Prefetch under a slot budget: demand reads against predictions that fill free slots or evict.

Runs ``bench/_rs_run.py`` on a ``bench/realshape.py gen`` directory (no memory cap: the
slot budget is the constraint), each run a fresh process with the model's files evicted
first, for each ``--budgets`` value (MiB of expert slots) and the prefetch modes:

- ``demand``: no prediction (``--no-prefetch``), every read on demand;
- ``fill``: the engine's default, predictions read into free slots only (they warm the
  cache up and stop once it is full);
- ``evict``: ``--prefetch-evicts``, a prediction may evict a resident expert (the
  default before this bench);
- ``early-evict``: evicting predictions from early routing alone (each layer's router
  on the residual stream entering it, read while its attention runs; no look-ahead);
- ``nextuse``: ``fill`` with the ``nextuse`` eviction policy;
- ``one-reader``: ``fill`` with one expert reader thread instead of two;
- ``stage-8``, ``stage-16``: predictions (look-ahead and early routing) read into 8 or
  16 slots set aside for them once the cache is full (``--prefetch-slots``), so a wrong
  guess evicts nothing; a used one joins the cache in place of the policy's victim;
  ``stage-N-wW``: N such slots, W predicted experts a token (``--width``);
  ``-early``: early routing alone (``--lookahead 0``);
- ``consumer-hash``: ``fill`` with each extent's checksum taken on the decoding thread
  at first use, as before the native readers hashed what they read.

Every decode is the per-expert pipeline (a layer's resident experts are computed while
its reads land). Per run: decode tokens/s, expert bytes read per token, and the overlap
bound of ``bench/bench_scale.py`` (raw O_DIRECT read time of exactly the run's extents,
the same round's resident compute per token, the run's time as a fraction of their
maximum), the exposed I/O wait and the bytes against Belady's optimum on the run's own
routing. Rounds are interleaved; each row is the round with the median decode speed, and
the ratio to ``demand`` is the median of the rounds' own ratios. The modes' order turns
each round. Once a cache is full, ``fill`` and ``demand`` run the same code: they differ
only while it fills. Writes ``--md``
(``bench/PREFETCH.md``) with the machine, load averages and the command.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_scale as bs  # noqa: E402
from _machine import machine  # noqa: E402

MODES = {
    "demand": ["--no-prefetch"],
    "fill": [],
    "evict": ["--prefetch-evicts"],
    "fill-uring": ["--io", "io_uring"],  # fill, the reads through io_uring, not preadv
    "early-evict": ["--prefetch-evicts", "--lookahead", "0"],
    "nextuse": ["--policy", "nextuse"],
    "one-reader": ["--readers", "1"],
    "consumer-hash": ["--consumer-hash"],
    "stage-8": ["--prefetch-slots", "8"],
    "stage-16": ["--prefetch-slots", "16"],
    "stage-16-w4": ["--prefetch-slots", "16", "--width", "4"],
    "stage-16-w2": ["--prefetch-slots", "16", "--width", "2"],
    "stage-4-w4": ["--prefetch-slots", "4", "--width", "4"],
    "stage-4-w4-early": ["--prefetch-slots", "4", "--width", "4", "--lookahead", "0"],
    "stage-8-w4-early": ["--prefetch-slots", "8", "--width", "4", "--lookahead", "0"],
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bs.add_model_args(ap, "q8")
    ap.add_argument("--vocab", type=int, default=None, help="default: the shape's")
    ap.add_argument("--budgets", type=int, nargs="+", required=True, help="slot MiB")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=4, help="untimed decode tokens first")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--modes",
        nargs="+",
        choices=list(MODES),
        default=["demand", "fill", "evict"],
        help="the first is the baseline of the ratios",
    )
    ap.add_argument("--md", default=str(HERE / "PREFETCH.md"))
    a = ap.parse_args(argv)
    _, store, shape, _ = bs.model_pair(a)
    vocab = a.vocab or int(shape["vocab"])
    files = sorted(p for p in store.rglob("*") if p.is_file() and p.stat().st_size > 1 << 20)
    common = [
        "--engine", "czyx", "--store", str(store), "--tag", a.tag, "--vocab", str(vocab),
        "--text", str(bs.TEXT), "--prompt", str(a.prompt), "--warmup", str(a.warmup),
        "--tokens", str(a.tokens), "--threads", str(a.threads),
    ]  # fmt: skip
    load0 = os.getloadavg()
    runs: dict[tuple[int, str], list[dict]] = {}
    residents: list[dict] = []
    for r in range(a.rounds):
        print(f"round {r + 1} of {a.rounds} (load {os.getloadavg()[0]:.1f})", flush=True)
        bs.evict(files)
        resident = bs.run([*common, "--prewarm"], None, "resident")
        residents.append(resident)
        # The modes' order turns each round: the run after the resident one (whose large
        # arena the kernel is still reclaiming) is slower, whichever mode it is.
        names = list(a.modes)
        order = names[r % len(names) :] + names[: r % len(names)]
        for mb in a.budgets:
            for mode in order:
                flags = MODES[mode]
                bs.evict(files)
                res = bs.run([*common, "--cache-mb", str(mb), "--bound", *flags], None, mode)
                res["round"] = r
                runs.setdefault((mb, mode), []).append(res)
                print(f"  {mb} MiB {mode}: {res.get('decode_tok_s', 'failed')}", flush=True)
    load1 = os.getloadavg()
    lines = report(a, shape, runs, residents, load0, load1, argv)
    Path(a.md).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def report(a, shape, runs, residents, load0, load1, argv) -> list[str]:
    cmd = "python bench/bench_prefetch.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    res_tok = [r.get("decode_tok_s", float("nan")) for r in residents]
    lines = [
        "# Prefetch under a slot budget (generated by bench/bench_prefetch.py)",
        "",
        f"Machine: {machine()}. Load average {load0[0]:.1f} / {load0[1]:.1f} / {load0[2]:.1f}"
        f" before, {load1[0]:.1f} / {load1[1]:.1f} / {load1[2]:.1f} after.",
        "",
        f"Command: `{cmd}`",
        "",
        f"Model: `bench/realshape.py` {shape['arch']} shape, {shape['layers']} layers, "
        f"{shape['experts']} experts top-{shape['top_k']}, hidden {shape['hidden']}, expert "
        f"intermediate {shape['inter']} (`{a.tag}`). {a.prompt}-token prompt, {a.warmup} "
        f"untimed then {a.tokens} timed teacher-forced decode tokens, {a.threads} threads, "
        f"O_DIRECT reads, no memory cap (the slot budget is the constraint), files evicted "
        f"before each run; {a.rounds} interleaved rounds. Resident (every expert prewarmed): "
        f"{statistics.median(res_tok):.2f} tok/s (rounds "
        + ", ".join(f"{x:.2f}" for x in res_tok)
        + ").",
        "",
        "Modes: `demand` no prediction; `fill` (the default) predictions read into free "
        "slots only; `evict` (`--prefetch-evicts`) predictions may evict resident experts; "
        "`fill-uring` fill with the reads through io_uring (`--io io_uring`) instead of "
        "O_DIRECT preadv; `consumer-hash` fill with each extent's checksum taken on the "
        "decoding thread at first use (the native readers hash what they read otherwise); "
        "`stage-N` predictions into N slots set aside for them (`--prefetch-slots N`). "
        "Precision: the fraction of predicted reads a later acquire used.",
        "",
        f"| budget | mode | decode tok/s | vs {a.modes[0]} (rounds) | MB read / token | "
        "prefetches used / read | hit rate |",
        "|---|---|---|---|---|---|---|",
    ]
    for mb in a.budgets:
        base = {r["round"]: r for r in runs[(mb, a.modes[0])] if r.get("rc") == 0}
        for mode in a.modes:
            rs = runs[(mb, mode)]
            m = bs._median_run(rs)
            if m.get("rc") != 0:
                lines.append(f"| {mb} MiB | {mode} | failed | | | | |")
                continue
            ratios = sorted(
                r["decode_tok_s"] / base[r["round"]]["decode_tok_s"]
                for r in rs
                if r.get("rc") == 0 and r["round"] in base
            )
            vs = (
                f"{statistics.median(ratios):.2f}x ({', '.join(f'{x:.2f}' for x in ratios)})"
                if ratios
                else "-"
            )
            n = max(1, m["n_decode"])
            used = f"{m['prefetches_used']} / {m['prefetches']}" if m["prefetches"] else "-"
            lines.append(
                f"| {mb} MiB | {mode} | {m['decode_tok_s']:.2f} | {vs} | "
                f"{m['bytes_read'] / n / 1e6:.1f} | {used} | {m['hit_rate']:.3f} |"
            )
    lines += [
        "",
        "## The overlap bound, per run (resident compute from the same round)",
        "",
        "| budget, mode | MB read / token | raw read ms / token | compute ms / token | "
        "bound ms | serial ms | actual ms | bound / actual (rounds) | exposed wait ms / token "
        "| device busy ms / token (reads in flight) | read lead us (median / p10) | "
        "bytes / Belady |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mb in a.budgets:
        for mode in a.modes:
            per = [bs.bound_of(r, residents[r["round"]]) for r in runs[(mb, mode)]]
            lines.append(bs.bound_rows(f"{mb} MiB, {mode}", per))
    lines += [
        "",
        "## What the reads cost the CPU (the median-speed round)",
        "",
        "Per timed decode token: the process's CPU time, the decoding thread's, the rest "
        "(the kernel pool's workers and the expert readers); and the CPU time of the bound's "
        "raw re-read of the same extents, one thread, no compute, beside its wall time.",
        "",
        "| budget, mode | process CPU ms | decoding thread ms | other threads ms | "
        "raw read CPU ms | raw read wall ms |",
        "|---|---|---|---|---|---|",
    ]
    for mb in a.budgets:
        for mode in a.modes:
            m = bs._median_run(runs[(mb, mode)])
            if m.get("rc") != 0 or "decode_cpu_s" not in m:
                lines.append(f"| {mb} MiB, {mode} | failed | | | | |")
                continue
            n = max(1, m["n_decode"])
            cpu, main = m["decode_cpu_s"] / n * 1e3, m["decode_main_cpu_s"] / n * 1e3
            lines.append(
                f"| {mb} MiB, {mode} | {cpu:.1f} | {main:.1f} | {cpu - main:.1f} | "
                f"{m.get('raw_read_cpu_s', 0.0) / n * 1e3:.1f} | {m['raw_read_s'] / n * 1e3:.1f} |"
            )
    return lines


if __name__ == "__main__":
    main()
