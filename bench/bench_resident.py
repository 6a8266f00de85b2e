"""Resident speed on the real-shape model: czyx vs llama.cpp, same format, same threads.

Runs on directories written by ``bench/realshape.py gen``: each ``--pair`` names a
czyx store, its version tag and the GGUF file of the matching llama.cpp format
(czyx q8 vs q8_0, czyx q4 vs q4_0). Every run is a fresh process
(``bench/_rs_run.py``): the model fully resident (czyx reads every expert before
the first token, ``--prewarm``; llama.cpp mmaps its file, already in the page
cache), one untimed prefill of the prompt first (``--warm-prefill``: mmap faults
and first-call costs are not measured), then the timed prefill of the prompt,
``--warmup`` untimed decode tokens and ``--tokens`` timed, teacher-forced decode
tokens. Rounds interleave the engines (their order alternates per round), so a
ratio is taken between runs of the same round, minutes apart at most; the report
gives per (format, threads) the median tokens/s of each engine over the rounds
and the median of the per-round ratios, with the load average before each round.

Writes ``--md`` (``bench/RESIDENT.md``) with the machine, every round's figures
and the command that reproduces it. The committed report ran on the OLMoE-shape
model at 4 of 16 layers: ``/work/data/rs`` (``realshape.py gen --scale 0.25``, q8)
and a directory holding the same ``hf/`` checkpoint with the q4 files
(``realshape.py gen --out DIR --scale 0.25 --gguf q4_0 --czyx q4``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _machine import machine  # noqa: E402

TEXT = HERE.parent / "store" / "models" / "mount.py"


def run(engine: str, fmt: dict, threads: int, a: argparse.Namespace) -> dict:
    """One ``_rs_run.py`` process; its JSON result (``rc`` set on failure)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable, str(HERE / "_rs_run.py"), "--engine", engine]
        if engine == "llama":
            cmd += ["--model", fmt["gguf"]]
        else:
            cmd += ["--store", fmt["store"], "--tag", fmt["tag"], "--prewarm"]
        cmd += [
            "--vocab", str(a.vocab), "--text", str(TEXT), "--prompt", str(a.prompt),
            "--warmup", str(a.warmup), "--tokens", str(a.tokens), "--threads", str(threads),
            "--warm-prefill", "--json", str(out),
        ]  # fmt: skip
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if p.returncode != 0 or not out.exists():
            return {"rc": p.returncode or 1, "err": p.stderr[-400:]}
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--pair", action="append", nargs=4, metavar=("NAME", "STORE", "TAG", "GGUF"),
        help="a format: its name, the czyx store and tag, the llama.cpp GGUF (repeatable)",
    )  # fmt: skip
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--md", default=str(HERE / "RESIDENT.md"))
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not a.pair:
        ap.error("give at least one --pair")
    fmts = [dict(name=n, store=s, tag=t, gguf=g) for n, s, t, g in a.pair]
    rows = []
    for rnd in range(a.rounds):
        for threads in a.threads:
            for f in fmts:
                load = os.getloadavg()[0]
                order = ("llama", "czyx") if rnd % 2 == 0 else ("czyx", "llama")
                res = {e: run(e, f, threads, a) for e in order}
                rows.append(dict(round=rnd, fmt=f["name"], threads=threads, load=load, **res))
                line = " ".join(
                    f"{e} " + ("FAILED" if r.get("rc") else
                               f"prefill {r['prefill_tok_s']:.1f} decode {r['decode_tok_s']:.2f}")
                    for e, r in res.items()
                )  # fmt: skip
                print(f"round {rnd} {f['name']} t{threads} load {load:.1f}: {line}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows))
    Path(a.md).write_text(report(rows, fmts, a, argv if argv is not None else sys.argv[1:]))
    print(f"wrote {a.md}")


def _ok(r: dict) -> bool:
    return not r["llama"].get("rc") and not r["czyx"].get("rc")


def model_line(f: dict) -> str | None:
    """What the pair's model is, from the ``shape.json`` realshape wrote beside its GGUF
    directory (None where there is none)."""
    gguf = Path(f["gguf"])
    meta_path = gguf.parent.parent / "shape.json"
    if not meta_path.exists():
        return None
    m = json.loads(meta_path.read_text())
    params = m["layers"] * m["experts"] * 3 * m["hidden"] * m["inter"]
    source = (
        f"czyx mounted `{gguf.name}` itself (the same codes)"
        if m.get("source") == "gguf"
        else "both quantized from the same bf16 checkpoint"
    )
    return (
        f"Model ({f['name']}): `bench/realshape.py` {m['arch']} shape, {m['layers']} layers x "
        f"{m['experts']} experts top-{m['top_k']}, hidden {m['hidden']}, expert intermediate "
        f"{m['inter']}, vocab {m['vocab']} ({params / 1e9:.1f} B routed-expert parameters); "
        f"llama.cpp `{gguf.name}` ({gguf.stat().st_size / 1e9:.2f} GB), czyx `{f['tag']}`: "
        f"{source}."
    )


def report(rows: list[dict], fmts: list[dict], a: argparse.Namespace, argv: list[str]) -> str:
    """The markdown report of every round and the medians."""
    models = [ln for ln in (model_line(f) for f in fmts) if ln]
    lines = [
        "# Resident speed on the real-shape model: czyx vs llama.cpp",
        "",
        "Generated by `bench/bench_resident.py` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}).",
        "",
        f"Machine: {machine()}. Each run a fresh process, model fully resident; "
        f"prompt {a.prompt} tokens (one untimed prefill first), {a.warmup} untimed then "
        f"{a.tokens} timed teacher-forced decode tokens; engines interleaved per round "
        "(order alternating), OPENBLAS_NUM_THREADS=1. Ratios are czyx / llama.cpp within "
        "one round; the table gives medians over rounds. The load average (1 min) before "
        "each round is printed: the machine is shared, so absolute figures move with it.",
        "",
        *[x for ln in models for x in (ln, "")],
        "| format | threads | rounds | load (median) | llama.cpp decode tok/s | czyx decode "
        "tok/s | decode ratio | llama.cpp prefill tok/s | czyx prefill tok/s | prefill ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in fmts:
        for t in a.threads:
            rs = [r for r in rows if r["fmt"] == f["name"] and r["threads"] == t and _ok(r)]
            if not rs:
                lines.append(f"| {f['name']} | {t} | 0 | - | failed | | | | | |")
                continue

            def med(key: str, eng: str, rs: list[dict] = rs) -> float:
                return median(r[eng][key] for r in rs)

            def ratio(key: str, rs: list[dict] = rs) -> float:
                return median(r["czyx"][key] / r["llama"][key] for r in rs)

            lines.append(
                f"| {f['name']} | {t} | {len(rs)} | {median(r['load'] for r in rs):.1f} | "
                f"{med('decode_tok_s', 'llama'):.2f} | {med('decode_tok_s', 'czyx'):.2f} | "
                f"**{ratio('decode_tok_s'):.2f}x** | {med('prefill_tok_s', 'llama'):.1f} | "
                f"{med('prefill_tok_s', 'czyx'):.1f} | **{ratio('prefill_tok_s'):.2f}x** |"
            )
    lines += [
        "",
        "Thread scaling (median over rounds of the 2-thread / 1-thread decode tok/s "
        "of the same round):",
        "",
    ]
    for f in fmts:
        for eng in ("czyx", "llama"):
            sc = []
            for rnd in sorted({r["round"] for r in rows}):
                by_t = {
                    r["threads"]: r
                    for r in rows
                    if r["round"] == rnd and r["fmt"] == f["name"] and _ok(r)
                }
                if 1 in by_t and 2 in by_t:
                    sc.append(by_t[2][eng]["decode_tok_s"] / by_t[1][eng]["decode_tok_s"])
            if sc:
                lines.append(f"- {f['name']} {eng}: {median(sc):.2f}x")
    lines += [
        "",
        "Every round:",
        "",
        "| round | format | threads | load | engine | prefill tok/s | decode tok/s | decode in C |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for eng in ("llama", "czyx"):
            x = r[eng]
            if x.get("rc"):
                lines.append(
                    f"| {r['round']} | {r['fmt']} | {r['threads']} | {r['load']:.1f} | "
                    f"{eng} | failed (rc {x['rc']}) | | |"
                )
                continue
            lines.append(
                f"| {r['round']} | {r['fmt']} | {r['threads']} | {r['load']:.1f} | {eng} | "
                f"{x['prefill_tok_s']:.1f} | {x['decode_tok_s']:.2f} | "
                f"{x.get('decode_in_c', '-')} |"
            )
    cmd = "python bench/bench_resident.py " + " ".join(shlex.quote(x) for x in argv)
    lines += ["", f"Command: `OPENBLAS_NUM_THREADS=1 {cmd.strip()}`", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
