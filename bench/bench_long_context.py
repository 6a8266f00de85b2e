"""czyx vs llama.cpp at long contexts on a grouped-query attention, side by side.

Scope: decode and prefill tok/s after prompts of growing length, where attention over
the context takes a growing share of a step. The model: a random Mixtral-format
checkpoint with Qwen3-30B-A3B's attention shape (hidden 2048, 32 query heads sharing
4 key-value heads, head_dim 128) and two layers of 8 small experts top-2
(``czyx.testing.refmodels.tiny_model``, seed 3): the attention is full-size, the rest
small, so the context's cost shows. Both engines get the same weights in q8 (czyx:
``QuantizedConsumer`` on every matrix but the router; llama.cpp: Q8_0, written by
``bench/bench_speed.py``'s GGUF writer), one thread each, ids in (a byte vocabulary).
Per context: reset, prefill the prompt (timed: prefill tok/s), then greedy decode steps
(timed: decode tok/s). Engines and contexts run in every round, the engine order
alternating round by round; figures are medians over rounds, ratios czyx over
llama.cpp in the same run; the load average is printed.

Run: ``OPENBLAS_NUM_THREADS=1 python bench/bench_long_context.py`` (``--contexts``,
``--rounds``, ``--decode``, ``--format``, ``--out bench/LONG-CONTEXT.md``).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy

import argparse
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _machine import machine  # noqa: E402
from _report import write_report  # noqa: E402

FORMATS = {"q8": "Q8_0", "q4": "Q4_0"}  # czyx format -> llama.cpp type
# Qwen3-30B-A3B's attention (32 query heads over 4 key-value heads of 128, hidden 2048);
# two layers of small experts, no sliding window.
ATTENTION = {"hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4}
SHAPE = {**ATTENTION, "head_dim": 128, "num_hidden_layers": 2, "intermediate_size": 256}


def text_ids(n: int) -> list[int]:
    """``n`` bytes of standard-library source (repeated if shorter) as ids."""
    import json

    src = Path(json.__file__).with_name("decoder.py").read_bytes()
    return list((src * (n // len(src) + 1))[:n])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode", type=int, default=32, help="greedy tokens per run")
    ap.add_argument("--format", choices=sorted(FORMATS), default="q8")
    ap.add_argument("--out", default=str(ROOT / "bench" / "LONG-CONTEXT.md"))
    args = ap.parse_args(argv)
    from bench._spec_llama import llama_missing

    why = llama_missing()
    if why is not None:
        raise SystemExit(f"llama.cpp is needed beside czyx: {why}")
    import bench_speed as speed

    from czyx.inference.kernels import fused
    from czyx.testing.refmodels import StateDictConsumer, tiny_model

    load0 = os.getloadavg()
    t_start = time.perf_counter()
    most = max(args.contexts) + args.decode
    tm = tiny_model(
        "mixtral", seed=3, max_position_embeddings=most + 64, sliding_window=None, **SHAPE
    )
    cfg = tm.config.to_dict()
    work = tempfile.TemporaryDirectory(prefix="bench_long_")
    gguf = str(Path(work.name) / f"model-{FORMATS[args.format]}.gguf")
    speed.write_gguf(tm, cfg, gguf, FORMATS[args.format])
    runners = {
        "llama.cpp": speed.LlamaRunner(gguf, 1, cfg["vocab_size"], most + 8),
        "czyx": speed.CzyxRunner(speed.czyx_consumer(StateDictConsumer(tm), args.format), 1, True),
    }
    ids = text_ids(max(args.contexts))
    for r in runners.values():  # warm-up: first-call allocations, page faults
        r.run(ids[:64], 4)
    got: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for rnd in range(args.rounds):
        names = list(runners) if rnd % 2 == 0 else list(runners)[::-1]
        for n in args.contexts:
            for name in names:
                pre, dec, _, _ = runners[name].run(ids[:n], args.decode)
                got.setdefault((name, n), []).append((pre, dec))
        print(f"round {rnd + 1}/{args.rounds}, load {os.getloadavg()}", file=sys.stderr)
    for r in runners.values():
        r.close()
    work.cleanup()
    load1 = os.getloadavg()
    med = {k: tuple(statistics.median(x[i] for x in v) for i in (0, 1)) for k, v in got.items()}
    cmd = "python bench/bench_long_context.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    lines = [
        "# czyx vs llama.cpp at long contexts, grouped-query attention",
        "",
        f"`OPENBLAS_NUM_THREADS=1 {cmd.strip()}` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}); {machine()}; "
        f"czyx kernel path: {fused.level()}.",
        "",
        f"Load average {' '.join(f'{x:.2f}' for x in load0)} before, "
        f"{' '.join(f'{x:.2f}' for x in load1)} after "
        f"({time.perf_counter() - t_start:.0f} s). The script's docstring states the method.",
        "",
        f"Model: random Mixtral-format, hidden {SHAPE['hidden_size']}, "
        f"{SHAPE['num_attention_heads']} query heads sharing {SHAPE['num_key_value_heads']} "
        f"key-value heads of {SHAPE['head_dim']}, {SHAPE['num_hidden_layers']} layers of 8 "
        f"experts top-2 (intermediate {SHAPE['intermediate_size']}); {args.format} "
        f"({FORMATS[args.format]} for llama.cpp); 1 thread each; {args.decode} greedy tokens "
        f"after each prompt; medians of {args.rounds} rounds.",
        "",
        "| context | llama.cpp decode tok/s | czyx decode tok/s | decode czyx / llama.cpp "
        "| llama.cpp prefill tok/s | czyx prefill tok/s | prefill czyx / llama.cpp |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    pairs = [(n, med[("llama.cpp", n)], med[("czyx", n)]) for n in args.contexts]
    lines += [
        f"| {n} | {ld:.1f} | {cd:.1f} | **{cd / ld:.2f}x** | {lp:.0f} | {cp:.0f} | {cp / lp:.2f}x |"
        for n, (lp, ld), (cp, cd) in pairs
    ]
    return write_report(lines, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
