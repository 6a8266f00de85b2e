"""Per-expert precision tiers on the bundled model: quality and bytes, writes ``bench/TIERS.md``.

Quality (the evidence harness, :mod:`czyx.inference.quant_eval`): KL(ref || model),
top-1 agreement and NLL on held-out stdlib text (the model's own validation
split) against the unquantized model, for pure q4, pure q2 and q4/q2 tiers at
each high-tier fraction. The versions: ``q4-all`` (every matrix q4) and
``q4-all,expert=q2`` (the same q4 trunk, experts q2), built in memory as a
quantizing mount stores them. The hot list that picks the high experts is the
routing profile of the float model on training text (never the held-out text).

Then decode at a tight slot budget (a fraction of the q4 experts' bytes; slots sized
for q4 in every run): expert bytes read per token, hit rate and decode tokens/s
(CPU time, one thread) of the tiers against pure q4, interleaved rounds, medians.

Run: ``python bench/bench_tiers.py`` (``--out bench/TIERS.md``).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from czyx.inference.assets import bundled_model_dir
from czyx.inference.engine import Engine
from czyx.inference.options import EngineOptions
from czyx.inference.quant_eval import evaluate, stdlib_split, text_windows, window_logits
from czyx.inference.tokenizer import load_tokenizer
from czyx.store.models.tiered import TieredModel
from czyx.store.quant.memory import QuantizedConsumer
from czyx.store.quant.policy import parse_policy

HIGH, LOW = "q4-all", "q4-all,expert=q2"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--profile-windows", type=int, default=16)
    ap.add_argument("--fractions", default="0.25,0.5", help="high-tier shares of the experts")
    ap.add_argument("--budget", type=float, default=0.25, help="tight budget, share of q4 experts")
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from czyx.testing.refmodels import StateDictConsumer

    torch.set_num_threads(1)
    model_dir = bundled_model_dir()
    tm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    base = StateDictConsumer(tm)
    tok = load_tokenizer(str(model_dir), base.info.config["vocab_size"])
    train, val = stdlib_split()
    held = text_windows(tok.encode, val, args.window, args.eval_windows)
    prof_text = text_windows(tok.encode, train[:: max(1, len(train) // 64)], args.window,
                             args.profile_windows)  # fmt: skip
    out: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        out.append(line)

    say("# Per-expert precision tiers (q4/q2) on the bundled model")
    say()
    cmd = " ".join(argv or sys.argv[1:])
    say(f"Command: `OPENBLAS_NUM_THREADS=1 python bench/bench_tiers.py {cmd}`")
    say(f"Load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    ref_engine = Engine(base, threads=1)
    ref = window_logits(ref_engine, held)
    for w in prof_text:  # the usage profile: the float model on training text
        ref_engine.reset()
        ref_engine.prefill(w, all_logits=True)
    hot = ref_engine.routing_profile().hot_list()
    ref_engine.close()
    q4 = QuantizedConsumer(base, parse_policy(HIGH))
    q2 = QuantizedConsumer(base, parse_policy(LOW))
    n_experts = base.info.n_experts
    say(
        f"Held-out: {len(held)} windows x {args.window} tokens (stdlib validation files); "
        f"hot list: routing counts of the float model on {len(prof_text)} x {args.window} "
        f"training tokens ({len(hot)} experts chosen at least once). Versions: {HIGH} "
        f"(q4 experts) and {LOW} (the same trunk, q2 experts); {n_experts} experts per layer."
    )
    say()
    say("## Quality against the unquantized model")
    say()
    say("| model | experts at q4 | NLL ref | NLL | NLL drift | KL | top-1 agreement |")
    say("|---|---|---|---|---|---|---|")
    fractions = [float(f) for f in args.fractions.split(",")]
    rows = [("pure q4", q4, None, 1.0), ("pure q2", q2, None, 0.0)]
    rows += [(f"tiers q4,q2:{f:g}", None, f"q4,q2:{f:g}", f) for f in fractions]
    for label, consumer, tiers, frac in rows:
        if tiers is None:
            eng = Engine(consumer, threads=1)
        else:
            eng = Engine(TieredModel(q4, q2, ("m@q4", "m@q2")), threads=1, hot=hot,
                         options=EngineOptions(tiers=tiers))  # fmt: skip
            frac = float((eng.consumer.tier == 0).sum()) / eng.cache.n_experts_total
        r = evaluate(ref, eng, held)
        if consumer is q4:
            q4_bytes = eng.expert_bytes  # every routed expert's q4 slot
        eng.close()
        say(
            f"| {label} | {frac:.0%} | {r.nll_ref:.4f} | {r.nll:.4f} | {r.nll_drift:+.4f} | "
            f"{r.kl:.4f} | {r.top1:.3f} |"
        )

    # Decode at a tight budget: bytes per token, hit rate, tokens/s; interleaved rounds.
    budget = int(args.budget * q4_bytes)
    text = np.concatenate(held)[: 16 + args.decode_tokens]
    say()
    say(
        f"## Decode at a tight budget ({budget / 2**20:.2f} MiB: {args.budget:.0%} of the "
        f"q4 experts' slots), {text.size - 16} held-out tokens teacher-forced after 16, "
        f"{args.rounds} interleaved rounds, medians (CPU time, one thread). Slots are sized "
        "for q4 in every run; the tiers' FRACTION is here a share of this budget's slots, "
        "filled from the hot list (the rest of the experts read at q2)"
    )
    say()
    say("| model | slots | hit rate | expert bytes read / token | vs q4 | tokens/s | vs q4 |")
    say("|---|---|---|---|---|---|---|")
    configs = [("pure q4", None)] + [(f"tiers q4,q2:{f:g}", f"q4,q2:{f:g}") for f in fractions]
    res: dict[str, list[tuple[float, float, float, int]]] = {c: [] for c, _ in configs}
    for _ in range(args.rounds):
        for label, tiers in configs:
            if tiers is None:
                eng = Engine(q4, cache_bytes=budget, threads=1)
            else:
                eng = Engine(TieredModel(q4, q2, ("m@q4", "m@q2")), cache_bytes=budget,
                             threads=1, hot=hot, options=EngineOptions(tiers=tiers))  # fmt: skip
            eng.prefill(text[:16])
            before = eng.stats()
            t0 = time.process_time()
            for t in text[16:].tolist():
                eng.decode(int(t))
            dt = time.process_time() - t0
            st = eng.stats().minus(before)
            n = text.size - 16
            res[label].append((st.bytes_read / n, st.hit_rate, n / dt, st.n_slots))
            eng.close()
    med = {k: tuple(float(np.median([r[i] for r in v])) for i in range(3)) for k, v in res.items()}
    b0, _, r0 = med["pure q4"]
    for label, _ in configs:
        b, h, r = med[label]
        say(
            f"| {label} | {res[label][0][3]} | {h:.3f} | {b / 1e3:.1f} kB | {b / b0:.2f}x | "
            f"{r:.0f} | {r / r0:.2f}x |"
        )
    say()
    say(
        "Reading: the versions here are in memory (a read is a copy), so tokens/s measures "
        "compute, not I/O; what tiers save is the bytes column, which only turns into "
        "speed where reads bound the step (the real-shape capped run, bench/_rs_run.py "
        "--tiers)."
    )
    say()
    say(f"Load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.out:
        Path(args.out).write_text("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
