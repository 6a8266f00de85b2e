"""Selective quantization on a real model: bytes, quality and decode speed per policy.

For a MoE checkpoint (a Hugging Face directory, or ``tiny:ARCH`` for a random
smoke-test model) this prints, all measured in the same run:

* model bytes on disk for each policy, against fp32;
* quality on held-out text against the unquantized model: mean per-token NLL
  drift, KL(ref || quant) of the next-token distribution and top-1 agreement,
  for q2-all, selective, selective with calibration, and q4-all (plus the
  calibrated q2-all and q4-all); calibration runs the float model over
  separate text (the importance map: mean squared activation per input
  column of every matrix, every routed expert on its own tokens);
* decode tokens/s of the selective model against the fp32 model (same
  engine) and against transformers on the same checkpoint, greedy, medians.

The quantized models are built in memory (``store.quant.memory``), the same
bytes a ``czyx mount --quant`` stores; the engine runs the C kernels on them.

Run: ``python bench/bench_quant_model.py --model inference/assets/czyx-moe-stdlib``.
Text: by default the shipped model's own split of this interpreter's standard
library (``tools/train_moe.py``: a file is validation when
``sha256(relative path)[0] < 13``): held-out windows come from validation
files, calibration windows from training files, so the quality is measured on
text neither training nor calibration saw. ``--calib``/``--eval`` take files
instead.
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

from czyx.inference.calibration import collect, input_key
from czyx.inference.engine import Engine
from czyx.inference.kernels import simd_level
from czyx.inference.quant_eval import evaluate, stdlib_split, text_windows, window_logits
from czyx.inference.tokenizer import load_tokenizer
from czyx.store.quant.memory import QuantizedConsumer
from czyx.store.quant.policy import POLICIES, parse_policy

ROWS = [
    ("q2-all", False),
    ("q2-all", True),
    ("selective", False),
    ("selective", True),
    ("q4-all", False),
    ("q4-all", True),
]


def load(model: str):
    """``(transformers model, float consumer, tokenizer)``."""
    import torch

    from czyx.testing.refmodels import StateDictConsumer, tiny_model

    torch.set_num_threads(1)
    if model.startswith("tiny:"):
        tm = tiny_model(model[5:], hidden_size=64, moe_intermediate_size=32, intermediate_size=64)
        tok_src = None
    else:
        from transformers import AutoModelForCausalLM

        tm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        tok_src = model
    base = StateDictConsumer(tm)
    return tm, base, load_tokenizer(tok_src, base.info.config["vocab_size"])


def decode_rate(step, prompt: np.ndarray, n: int, reps: int) -> float:
    """Median tokens/s of ``n`` greedy steps after a prefill of ``prompt``.

    Timed in CPU time of this process: every engine here runs one thread, and on
    a shared machine wall time would mostly measure the neighbours.
    """
    rates = []
    for _ in range(reps):
        first = step(prompt, True)
        t0 = time.process_time()
        tok = first
        for _ in range(n):
            tok = step(np.array([tok]), False)
        rates.append(n / (time.process_time() - t0))
    return float(np.median(rates))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="checkpoint directory, or tiny:ARCH")
    ap.add_argument("--calib", nargs="*", default=None, help="calibration text files")
    ap.add_argument("--eval", nargs="*", default=None, help="held-out text files")
    ap.add_argument("--window", type=int, default=128, help="tokens per window")
    ap.add_argument("--calib-windows", type=int, default=16)
    ap.add_argument("--eval-windows", type=int, default=8)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)

    import torch

    tm, base, tok = load(args.model)
    print(f"# bench_quant_model: {args.model}")
    print(
        f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')}, torch threads="
        f"{torch.get_num_threads()}, kernel path={simd_level()}, tokenizer={tok.name}"
    )
    train_files, val_files = stdlib_split()
    calib_files = args.calib or train_files[:: max(1, len(train_files) // 64)]
    eval_files = args.eval or val_files
    calib = text_windows(tok.encode, calib_files, args.window, args.calib_windows)
    held = text_windows(tok.encode, eval_files, args.window, args.eval_windows)
    n_calib = sum(w.size for w in calib)
    src = "stdlib training files" if args.calib is None else str(args.calib)
    dst = "stdlib validation files" if args.eval is None else str(args.eval)
    print(
        f"calibration: {n_calib} tokens from {src}; held-out: {len(held)} windows x "
        f"{args.window} tokens from {dst}"
    )

    ref_engine = Engine(base)
    ref = window_logits(ref_engine, held)
    col = collect(ref_engine, calib)
    imp = col.importance_map()  # routed experts shrunk toward their layer (few tokens)

    fp32 = QuantizedConsumer(base, POLICIES["none"])
    t32, e32 = fp32.model_nbytes()
    print("\n## Bytes and quality on held-out text (vs the fp32 model)")
    print(
        "| policy | calibrated | trunk MiB | experts MiB | total MiB | vs fp32 | NLL ref "
        "| NLL drift | KL | top-1 agree |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    tot32 = (t32 + e32) / 2**20
    print(
        f"| none (fp32) | - | {t32 / 2**20:.2f} | {e32 / 2**20:.2f} | {tot32:.2f} | 1.000 | | | | |"
    )
    if not args.model.startswith("tiny:"):
        disk = sum(p.stat().st_size for p in Path(args.model).glob("*.safetensors"))
        print(
            f"| checkpoint files | - | | | {disk / 2**20:.2f} | {disk / (t32 + e32):.3f} | | | | |"
        )
    models = {}
    for name, calibrated in ROWS:
        q = QuantizedConsumer(
            base, parse_policy(name), imp if calibrated else None, input_key if calibrated else None
        )
        tb, eb = q.model_nbytes()
        r = evaluate(ref, Engine(q), held)
        models[(name, calibrated)] = q
        print(
            f"| {name} | {'yes' if calibrated else 'no'} | {tb / 2**20:.2f} | {eb / 2**20:.2f} | "
            f"{(tb + eb) / 2**20:.2f} | {(tb + eb) / (t32 + e32):.3f} | {r.nll_ref:.4f} | "
            f"{r.nll_drift:+.4f} | "
            f"{r.kl:.4f} | {r.top1:.3f} |"
        )

    print(
        f"\n## Decode tokens/s ({args.decode_tokens} greedy tokens after {args.window}, "
        f"median of {args.reps}, CPU time, one thread each)"
    )
    prompt = held[0]

    def engine_step(eng):
        def step(ids, first):
            if first:
                eng.reset()
                return int(np.argmax(eng.prefill(ids)))
            return int(np.argmax(eng.decode(int(ids[0]))))

        return step

    past = {}

    def torch_step(ids, first):
        with torch.no_grad():
            if first:
                out = tm(torch.tensor(ids)[None], use_cache=True)
            else:
                out = tm(torch.tensor(ids)[None], past_key_values=past["kv"], use_cache=True)
            past["kv"] = out.past_key_values
            return int(out.logits[0, -1].argmax())

    n, reps = args.decode_tokens, args.reps
    r32 = decode_rate(engine_step(ref_engine), prompt, n, reps)
    rsel = decode_rate(engine_step(Engine(models[("selective", True)])), prompt, n, reps)
    rtf = decode_rate(torch_step, prompt, n, reps)
    print("| model | tokens/s | vs fp32 engine | vs transformers |")
    print("|---|---|---|---|")
    print(f"| fp32 (numpy engine) | {r32:.1f} | 1.00 | {r32 / rtf:.2f} |")
    print(f"| selective+calib (C kernels) | {rsel:.1f} | {rsel / r32:.2f} | {rsel / rtf:.2f} |")
    print(f"| transformers fp32 | {rtf:.1f} | {rtf / r32:.2f} | 1.00 |")

    # The same slot budget holds more quantized experts: hit rate at a fixed budget,
    # decoding held-out text token by token (teacher-forced, so routing follows real text).
    budget = int(0.25 * e32)
    text = np.concatenate(held)[: 16 + 4 * n]
    print(
        f"\n## One slot budget ({budget / 2**20:.2f} MiB = 25 % of the fp32 experts): "
        f"{text.size - 16} held-out tokens decoded one at a time after 16"
    )
    print("| model | slots | hit rate | expert MB read per token |")
    print("|---|---|---|---|")
    for label, consumer in (("fp32", base), ("selective+calib", models[("selective", True)])):
        eng = Engine(consumer, cache_bytes=budget)
        eng.prefill(text[:16])
        before = eng.stats()
        for t in text[16:].tolist():
            eng.decode(int(t))
        st = eng.stats()
        hits, misses = st.hits - before.hits, st.misses - before.misses
        mb = (st.bytes_read - before.bytes_read) / 1e6 / (text.size - 16)
        print(f"| {label} | {st.n_slots} | {hits / max(hits + misses, 1):.3f} | {mb:.4f} |")
        eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
