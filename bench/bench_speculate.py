"""Speculative decoding on the shipped model: ``python bench/bench_speculate.py``.

Greedy decode of ``czyx-moe-stdlib`` (mounted into a scratch store, every expert
resident and warm) without drafts and with prompt lookup (``--speculate lookup``),
on code prompts written for this benchmark (not files of the model's training set:
they are new code) and on an English prose prompt; optionally (``--self``) with the
model's own quantized version as the draft (``draft:stdlib@q4``); optionally
(``--llama``) beside llama.cpp's prompt-lookup decoding on the same weights, exported
as GGUF by czyx (:mod:`bench._spec_llama`). Configurations are interleaved round by
round; each figure is the median over the rounds of decode tokens/s, with the ratio
to the non-speculative run of the same rounds. The tokens of every speculative run
are checked identical to the non-speculative ones. Writes ``bench/SPECULATE.md``.
``--realshape DIR`` instead runs the real-shape model under a memory cap with
drafts replayed at set acceptances (:mod:`bench._spec_realshape`) and writes
``bench/SPECULATE-realshape.md``.

Usage::

    python bench/bench_speculate.py                 # 96 tokens x 5 rounds (~2-3 min)
    python bench/bench_speculate.py --self          # also the q4 version as the draft
    python bench/bench_speculate.py --mtp           # also --speculate mtp (tiny DeepSeek-V3)
    python bench/bench_speculate.py --self --draft-policy selective --out bench/SPECULATE-q2.md
    python bench/bench_speculate.py --self --llama  # also llama.cpp's prompt lookup (~+3 min)
    python bench/bench_speculate.py --realshape /work/data/olmoe4   # as root: cgroup v1 cap
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

from bench._machine import machine  # noqa: E402
from bench._report import write_report  # noqa: E402
from bench._spec_llama import llama_missing  # noqa: E402

# Code the model never saw: written for this benchmark (its training set is CPython's
# own standard library; see inference/assets/czyx-moe-stdlib/TRAINING.md). Each prompt
# and the tokens generated after it fit in the 256-byte windows the model was trained on
# (:func:`trained_context`): past them its rope positions are ones it never saw and its
# greedy text is noise, which no drafter predicts.
DRAFT_TAG = "stdlib@draft"  # the --self draft version (quantized by --draft-policy)
GGUF_TAG = "stdlib@vocab"  # --llama: the model with a byte vocabulary, exported as GGUF

PROMPTS = {
    "code: ring buffer": '''class RingBuffer:
    """A fixed-size buffer that overwrites its oldest item."""

    def __init__(self, capacity):
        self.capacity = capacity
''',
    "code: config parser": """def parse_settings(lines):
    settings = {}
    section = None
    for number, line in enumerate(lines, 1):
        line = line.strip()
""",
    "code: vector": """class Vector:
    def __init__(self, x, y, z):
        self.x = x
        self.y = y
        self.z = z

    def __add__(self, other):
""",
    "prose": (
        "The harbour town woke slowly that autumn. Fishermen mended their nets on the "
        "quay while the baker's daughter carried warm bread up the hill to the old"
    ),
}


def trained_context() -> int:
    """The bytes a training window of the bundled model held (its ``seq_len``)."""
    import json

    from czyx.inference.assets import bundled_model_dir

    log = json.loads((bundled_model_dir() / "training_log.json").read_text())
    return int(log["args"]["seq_len"])


def load() -> str:
    """The 1, 5 and 15 minute load averages."""
    a, b, c = os.getloadavg()
    return f"{a:.2f} {b:.2f} {c:.2f}"


class Replay:
    """Drafts the reference continuation with each token kept with probability
    ``acceptance`` (else replaced by a wrong one), seeded: a drafter of a set
    acceptance, to measure what verification saves at that acceptance."""

    name = "replay"

    def __init__(self, ref: list[int], acceptance: float, vocab: int, seed: int = 0) -> None:
        import numpy as np

        self.ref, self.acceptance, self.vocab = ref, acceptance, vocab
        self.rng = np.random.default_rng(seed)

    def propose(self, history, k):
        n = len(history)
        out = self.ref[n : n + k]
        keep = self.rng.random(len(out)) < self.acceptance
        return [t if ok else (t + 1) % self.vocab for t, ok in zip(out, keep, strict=True)]

    def close(self) -> None:
        pass


def row_costs(engine, prompt: list[int], most: int, repeats: int = 200) -> list[tuple]:
    """What one more verified row costs: after ``prompt``, a decode step of its greedy
    continuation's first token and verification steps of that token and the next 1 ..
    ``most`` (the drafts of a step that accepts them all, each row its own token and
    experts), timed in turn (``repeats`` of each, the KV cut back after every step),
    medians. Per step size ``(rows, us, r, ceiling)``: ``r`` the cost of each row past
    the first relative to a decode step, ``ceiling`` the most a step of that many rows
    can speed decoding up, every draft accepted: rows / (1 + r * (rows - 1))."""
    from czyx.inference.generate import generate_ids

    cont = generate_ids(engine, prompt, most + 1)[0]
    engine.reset()
    engine.prefill(prompt)
    base = engine.position
    times: dict[int, list[float]] = {n: [] for n in range(1, most + 2)}
    for _ in range(repeats):
        for n in times:
            t0 = time.perf_counter()
            engine.decode(cont[0]) if n == 1 else engine.verify(cont[:n])
            times[n].append(time.perf_counter() - t0)
            engine.rollback(base)
    one = statistics.median(times[1])
    out = []
    for n, ts in times.items():
        med = statistics.median(ts)
        r = (med / one - 1.0) / (n - 1) if n > 1 else 1.0
        out.append((n, med * 1e6, r, n / (1.0 + r * (n - 1))))
    return out


def interleaved(engine, prompts, configs, tokens, rounds, make_spec):
    """Run every (prompt, config) ``rounds`` times, interleaved; per (prompt, config) the
    decode tok/s of each round and the summed (accepted, drafted, passes, tokens,
    decode expert bytes read). Checks the tokens equal the config ``off``'s."""
    from czyx.inference.generate import generate_ids

    want = {name: generate_ids(engine, ids, tokens)[0] for name, ids in prompts.items()}
    rate = {p: {c: [] for c in configs} for p in prompts}
    acc = {p: {c: [0, 0, 0, 0, 0] for c in configs} for p in prompts}
    for _ in range(rounds):
        for name, ids in prompts.items():
            for cfg in configs:
                spec = make_spec(cfg, ids + want[name])
                out, st = generate_ids(engine, ids, tokens, speculate=spec)
                if out != want[name]:
                    raise SystemExit(f"{cfg} on {name!r}: tokens differ from non-speculative")
                rate[name][cfg].append(st.decode_tokens_per_s)
                tally(acc[name][cfg], st)
    return rate, acc


def tally(t: list[int], st) -> None:
    """Add a czyx run's (accepted, drafted, forward passes, decoded tokens, decode expert
    bytes read) to the totals ``t``."""
    t[0] += st.accepted
    t[1] += st.drafted
    t[2] += len(st.draft_steps) if st.draft_steps else st.decode_steps
    t[3] += st.decode_steps
    t[4] += st.decode_cache.bytes_read


def counts(t: list[int]) -> str:
    """The acceptance and tokens-per-forward-pass cells of totals ``t`` (see :func:`tally`)."""
    accept = f"{t[0] / t[1]:.2f} ({t[0]}/{t[1]})" if t[1] else "-"
    return f"{accept} | {t[3] / t[2] if t[2] else 0.0:.2f}"


def rows(rate, acc, configs, bytes_column=False):
    """The table rows: per prompt and config, median tok/s and its ratio to ``off``."""
    out = []
    for name in rate:
        base = statistics.median(rate[name]["off"])
        for cfg in configs:
            med = statistics.median(rate[name][cfg])
            a = acc[name][cfg]
            row = f"| {name} | {cfg} | {med:.1f} | {med / base:.2f}x | {counts(a)} |"
            if bytes_column:
                row += f" {a[4] / max(a[3], 1) / 1024:.1f} |"
            out.append(row)
    return out


def served_rounds(opened, prompts, args):
    """Eight requests at once (the prompts, repeated to eight) through one
    :class:`Scheduler`, speculation off and by prompt lookup (the server default),
    interleaved: per config the rounds' aggregate generated tok/s, and the totals of
    (tokens, steps, drafted, accepted, expert bytes read)."""
    from czyx.inference.batch import BatchOptions, Scheduler
    from czyx.inference.engine import Engine
    from czyx.inference.options import BATCHED_OPTIONS, SpeculateOptions

    engine = Engine(
        opened.consumer,
        cache_fraction=args.fraction,
        options=BATCHED_OPTIONS,
        threads=args.threads,
    )
    texts = list(prompts.values())
    texts = (texts * 8)[:8]
    out = {}
    for cfg in ("off", "lookup"):
        spec = SpeculateOptions(cfg, draft_tokens=args.draft_tokens)
        out[cfg] = ([], [0, 0, 0, 0, 0], BatchOptions(max_batch=8, speculate=spec))
    want = None
    for _ in range(args.rounds):
        for cfg, (rates, tot, opts) in out.items():
            sched = Scheduler(engine.model, opts)
            try:
                s0, c0 = sched.stats(), engine.stats()
                t0 = time.perf_counter()
                handles = [sched.submit(ids, args.tokens) for ids in texts]
                got = [h.result(timeout=300)[0] for h in handles]
                dt = time.perf_counter() - t0
                s1, c1 = sched.stats(), engine.stats()
            finally:
                sched.close()
            if want is None:
                want = got
            elif got != want:
                raise SystemExit(f"served {cfg}: tokens differ from the other configuration")
            n = sum(len(g) for g in got)
            rates.append(n / dt)
            tot[0] += n
            tot[1] += s1.steps - s0.steps
            tot[2] += s1.drafted - s0.drafted
            tot[3] += s1.accepted - s0.accepted
            tot[4] += c1.bytes_read - c0.bytes_read
    engine.close()
    return out


def served_rows(served):
    """The served table's rows."""
    base = statistics.median(served["off"][0])
    out = []
    for cfg, (rates, tot, _) in served.items():
        med = statistics.median(rates)
        accept = f"{tot[3] / tot[2]:.2f} ({tot[3]}/{tot[2]})" if tot[2] else "-"
        out.append(
            f"| {cfg} | {med:.1f} | {med / base:.2f}x | {accept} | {tot[1]} | "
            f"{tot[4] / max(tot[0], 1) / 1024:.1f} |"
        )
    return out


LLAMA_CONFIGS = ("czyx off", "czyx lookup", "llama.cpp", "llama.cpp lookup")


def llama_rounds(engine, gguf: Path, prompts, args, lookup_opts):
    """czyx without drafts and with prompt lookup, llama.cpp without a draft model and with
    its ``LlamaPromptLookupDecoding`` (at most ``--draft-tokens`` tokens, as czyx's), on
    the same prompts, greedy length and threads, in the same rounds (the order rotated
    round by round). Per prompt and config: each round's decode tok/s, the totals of
    :func:`tally`, and the tokens (each config's checked equal over rounds; czyx's
    lookup's equal to czyx's off)."""
    from bench._spec_llama import LlamaGreedy
    from czyx.inference.generate import generate_ids
    from czyx.inference.speculative import Speculator

    n_ctx = max(len(ids) for ids in prompts.values()) + args.tokens + args.draft_tokens + 8
    llamas = {
        "llama.cpp": LlamaGreedy(gguf, args.threads, n_ctx),
        "llama.cpp lookup": LlamaGreedy(gguf, args.threads, n_ctx, lookup=args.draft_tokens),
    }
    rate = {p: {c: [] for c in LLAMA_CONFIGS} for p in prompts}
    acc = {p: {c: [0, 0, 0, 0, 0] for c in LLAMA_CONFIGS} for p in prompts}
    toks: dict[str, dict[str, list[int]]] = {p: {} for p in prompts}
    try:
        for r in range(args.rounds):
            k = r % len(LLAMA_CONFIGS)
            for name, ids in prompts.items():
                for cfg in LLAMA_CONFIGS[k:] + LLAMA_CONFIGS[:k]:
                    t = acc[name][cfg]
                    if cfg in llamas:
                        run = llamas[cfg].run(ids, args.tokens)
                        out = run.tokens
                        rate[name][cfg].append(run.decode_tok_s)
                        t[0] += run.accepted
                        t[1] += run.drafted
                        t[2] += run.passes
                        t[3] += len(out) - 1
                    else:
                        spec = Speculator.open(lookup_opts, engine) if cfg != "czyx off" else None
                        out, st = generate_ids(engine, ids, args.tokens, speculate=spec)
                        rate[name][cfg].append(st.decode_tokens_per_s)
                        tally(t, st)
                    if toks[name].setdefault(cfg, out) != out:
                        raise SystemExit(f"{cfg} on {name!r}: tokens differ between rounds")
            for name in prompts:
                if toks[name]["czyx lookup"] != toks[name]["czyx off"]:
                    raise SystemExit(f"czyx lookup on {name!r}: tokens differ from off")
    finally:
        for llm in llamas.values():
            llm.close()
    return rate, acc, toks


def llama_rows(rate, acc, toks) -> tuple[list[str], list[str]]:
    """The llama.cpp section's two tables' rows: per prompt and config (tok/s, ratio to its
    own engine's plain decode, acceptance, tokens per forward pass); per prompt the
    ratios across engines and whether the greedy tokens agree."""
    from bench._spec_llama import agreement

    runs, ratios = [], []
    for name in rate:
        med = {c: statistics.median(rate[name][c]) for c in LLAMA_CONFIGS}
        for cfg in LLAMA_CONFIGS:
            plain = med["llama.cpp" if cfg.startswith("llama") else "czyx off"]
            runs.append(
                f"| {name} | {cfg} | {med[cfg]:.1f} | {med[cfg] / plain:.2f}x | "
                f"{counts(acc[name][cfg])} |"
            )
        t = toks[name]
        ratios.append(
            f"| {name} | **{med['czyx lookup'] / med['llama.cpp lookup']:.2f}x** | "
            f"{med['czyx off'] / med['llama.cpp']:.2f}x | "
            f"{med['czyx lookup'] / med['czyx off']:.2f}x | "
            f"{med['llama.cpp lookup'] / med['llama.cpp']:.2f}x | "
            f"{agreement(t['czyx off'], t['llama.cpp'])} | "
            f"{agreement(t['llama.cpp'], t['llama.cpp lookup'])} |"
        )
    return runs, ratios


def wide_rounds(args, scratch: Path):
    """A synthetic Mixtral-shaped model read from disk (``--wide H``: hidden H, 8 layers of
    16 fp16 experts, top-2), a quarter of its experts cached, reads ``O_DIRECT`` where
    the filesystem allows it: decode without drafts and with replayed drafts at set
    acceptances. Returns (rates, totals, shape line)."""
    from czyx.inference import synthetic
    from czyx.inference.engine import Engine
    from czyx.inference.generate import generate_ids
    from czyx.inference.options import EngineOptions
    from czyx.inference.speculative import DraftLength, Speculator
    from czyx.store.io.iopaths import available_paths

    h = args.wide
    model = synthetic.create(
        scratch / "wide", hidden=h, inter=2 * h, layers=8, experts=16, vocab=256, dtype="f16"
    )
    io = "direct" if available_paths().get("direct") == "available" else "pread"
    engine = Engine(model, cache_fraction=0.25, options=EngineOptions(io=io), threads=args.threads)
    shape = (
        f"hidden {h}, intermediate {2 * h}, 8 layers x 16 fp16 experts, top-2, "
        f"{engine.expert_bytes / 2**20:.0f} MiB of experts, {engine.cache.n_slots} slots "
        f"(25 %), reads: {io}"
    )
    prompt = list(range(1, 17))
    n = max(16, args.tokens // 4)
    ref = prompt + generate_ids(engine, prompt, n)[0]
    configs = ["off", "replay p=0.6", "replay p=0.8", "replay p=0.9"]
    rates = {c: [] for c in configs}
    tot = {c: [0, 0, 0, 0, 0] for c in configs}
    for r in range(args.rounds):
        for cfg in configs:
            spec = None
            if cfg != "off":
                a = float(cfg.split("=")[1])
                drafter = Replay(ref, a, engine.cfg.vocab_size, seed=r)
                spec = Speculator(drafter, DraftLength(args.draft_tokens, adaptive=False))
            out, st = generate_ids(engine, prompt, n, speculate=spec)
            if out != ref[len(prompt) :]:
                raise SystemExit(f"wide {cfg}: tokens differ from non-speculative")
            rates[cfg].append(st.decode_tokens_per_s)
            tally(tot[cfg], st)
    engine.close()
    model.close()
    return rates, tot, shape


def mtp_rounds(args, scratch: Path):
    """A tiny random DeepSeek-V3 with an MTP layer appended (``czyx.testing``'s, mounted,
    every expert resident): decode without drafts and with ``--speculate mtp`` (fixed
    length), interleaved. Random weights give a meaningless acceptance: this measures
    the head's cost and checks the tokens, not what a trained MTP layer accepts.
    Returns (rates, totals)."""
    from safetensors.torch import load_file, save_file

    from czyx.inference.engine import Engine
    from czyx.inference.opened import OpenedModel
    from czyx.inference.options import SpeculateOptions
    from czyx.inference.speculative import DraftLength, Speculator
    from czyx.store import Store
    from czyx.store.models.mount import mount
    from czyx.testing.archparity import write_checkpoint
    from czyx.testing.tiny_models import build_tiny_model, mtp_layer_tensors

    base = dict(initializer_range=0.2, num_hidden_layers=3)
    main = build_tiny_model("deepseek_v3", 2, **base)
    block = build_tiny_model(
        "deepseek_v3", 7, **{**base, "num_hidden_layers": 1}, first_k_dense_replace=0
    )
    src = write_checkpoint(main, scratch / "mtp-ckpt", fused=False)
    file = src / "model.safetensors"
    save_file(
        {**load_file(str(file)), **mtp_layer_tensors(main, block)},
        str(file),
        metadata={"format": "pt"},
    )
    with Store.open(scratch / "mtp-store") as st:
        mount(st, src, "ds@mtp")
    opened = OpenedModel(str(scratch / "mtp-store"), "ds@mtp", None)
    engine = Engine(opened.consumer, threads=args.threads)
    spec = Speculator.open(SpeculateOptions("mtp", draft_tokens=args.draft_tokens), engine)

    def make_spec(cfg, ref):
        if cfg == "off":
            return None
        spec.length = DraftLength(args.draft_tokens, adaptive=False)
        spec.steps.clear()
        return spec

    prompt = {"random ids": [int(t) for t in range(1, 17)]}
    got = interleaved(engine, prompt, ["off", "mtp"], args.tokens, args.rounds, make_spec)
    spec.close()
    engine.close()
    opened.close()
    return got


def realshape_main(args, command: str) -> int:
    """``--realshape DIR``: that section alone (:mod:`bench._spec_realshape`), written to
    ``--out`` (default ``bench/SPECULATE-realshape.md``)."""
    from bench._spec_realshape import report, run_capped, targets

    out = Path(args.out or ROOT / "bench" / "SPECULATE-realshape.md")
    tgts = targets(args.rs_acceptances, args.draft_tokens)
    load0, t0 = load(), time.perf_counter()
    res = run_capped(args, Path(args.realshape), [p for _, _, p in tgts])
    wall = time.perf_counter() - t0
    lines = [
        "# Speculative decoding on the real-shape model in a memory group",
        "",
        f"`{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}); {machine()}.",
        "",
        f"Load average {load0} before, {load()} after ({wall:.0f} s in all, the child's "
        "store opening and warm-up included). The bundled model's own speculation figures "
        "are in `bench/SPECULATE.md`.",
        "",
        *report(res, tgts, args),
        "",
    ]
    return write_report(lines, out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=96, help="tokens generated per run")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (configurations interleaved)")
    ap.add_argument("--draft-tokens", type=int, default=4, help="draft length at most")
    ap.add_argument("--threads", type=int, default=1, help="engine kernel threads")
    ap.add_argument("--fraction", type=float, default=0.5, help="streamed: expert cache share")
    ap.add_argument("--self", action="store_true", help="also the q4 version as the draft")
    ap.add_argument(
        "--draft-policy",
        default="q4-all",
        help="quantization policy of the --self draft version (selective: experts q2)",
    )
    ap.add_argument(
        "--wide", type=int, default=512, metavar="H", help="synthetic model's hidden (0: skip)"
    )
    ap.add_argument(
        "--mtp",
        action="store_true",
        help="also --speculate mtp on a tiny random DeepSeek-V3 with an MTP layer "
        "(needs torch and transformers)",
    )
    ap.add_argument(
        "--llama",
        action="store_true",
        help="also llama.cpp's prompt-lookup decoding on the same weights (exported GGUF)",
    )
    ap.add_argument(
        "--realshape",
        metavar="DIR",
        help="only the real-shape model of DIR (realshape.py gen) under a memory cap, drafts "
        "replayed at set acceptances (writes bench/SPECULATE-realshape.md)",
    )
    ap.add_argument("--rs-tag", default="rs@q8", help="realshape: the version")
    ap.add_argument("--rs-ratio", type=float, default=3.6, help="realshape: stored bytes / cap")
    ap.add_argument("--rs-prompt", type=int, default=16, help="realshape: prompt tokens")
    ap.add_argument("--rs-warmup", type=int, default=24, help="realshape: untimed decode tokens")
    ap.add_argument("--rs-tokens", type=int, default=48, help="realshape: timed decode tokens")
    ap.add_argument("--rs-threads", type=int, default=2, help="realshape: kernel threads")
    ap.add_argument("--rs-rounds", type=int, default=3, help="realshape: rounds")
    ap.add_argument("--rs-prefetch", choices=["on", "off"], default="on")
    ap.add_argument(
        "--rs-policy", default=None, help="realshape: eviction policy (default: the engine's)"
    )
    ap.add_argument(
        "--rs-acceptances",
        nargs="+",
        default=["q2", "lookup", "0.6", "0.75"],
        help="realshape: target acceptances (numbers, or q2 / lookup: the bundled model's "
        "measured ones, from bench/SPECULATE-q2.md and bench/SPECULATE.md)",
    )
    ap.add_argument(
        "--rs-parts",
        nargs="+",
        default=["topk"],
        help="realshape: misses a verification step acquires together past its hits "
        "(topk: the model's top-k, the engine's; or a count), each a configuration",
    )
    ap.add_argument("--out", default=None, help="the report (default bench/SPECULATE.md)")
    args = ap.parse_args(argv)
    command = "python bench/bench_speculate.py " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )
    if args.realshape:
        return realshape_main(args, command.strip())
    args.out = args.out or str(ROOT / "bench" / "SPECULATE.md")
    llama_why = llama_missing() if args.llama else "not asked for (--llama)"

    from czyx.inference.assets import bundled_model_dir
    from czyx.inference.engine import Engine
    from czyx.inference.opened import OpenedModel
    from czyx.inference.options import SpeculateOptions
    from czyx.inference.speculative import DraftLength, Speculator
    from czyx.store import Store
    from czyx.store.models.mount import mount

    lookup_opts = SpeculateOptions("lookup", draft_tokens=args.draft_tokens)
    load0 = load()
    t_start = time.perf_counter()
    tmp = tempfile.TemporaryDirectory(prefix="czyx-spec-")
    store_dir = str(Path(tmp.name) / "store")
    with Store.open(store_dir) as st:
        mount(st, bundled_model_dir(), "stdlib@1")
        if args.self:
            from czyx.store.quant.codec import QuantCodec
            from czyx.store.quant.policy import parse_policy

            policy = QuantCodec(parse_policy(args.draft_policy))
            mount(st, bundled_model_dir(), DRAFT_TAG, quant=policy)
        gguf = None
        if llama_why is None:  # the same weights, written by czyx's own exporter
            from bench._spec_llama import with_byte_vocabulary
            from czyx.store.models.gguf_export import export_gguf

            # The checkpoint with a byte vocabulary (llama.cpp loads no GGUF without one),
            # its tensors stdlib@1's.
            ckpt = with_byte_vocabulary(bundled_model_dir(), Path(tmp.name) / "ckpt")
            mount(st, ckpt, GGUF_TAG)
            (gguf,) = export_gguf(st, GGUF_TAG, Path(tmp.name) / "stdlib.gguf")
    opened = OpenedModel(store_dir, "stdlib@1", None)
    prompts = {name: list(text.encode()) for name, text in PROMPTS.items()}
    context = trained_context()
    for name, ids in prompts.items():
        if len(ids) + args.tokens > context:
            raise SystemExit(
                f"{name!r}: {len(ids)} prompt bytes + --tokens {args.tokens} exceed the "
                f"{context} bytes the model was trained on"
            )

    # A: prompt lookup (and the q4 self-draft), every expert resident.
    engine = Engine(opened.consumer, threads=args.threads)
    configs = ["off", "lookup"] + ([f"draft:{DRAFT_TAG}"] if args.self else [])
    draft = None
    if args.self:
        draft = Speculator.open(
            SpeculateOptions(f"draft:{DRAFT_TAG}", draft_tokens=args.draft_tokens),
            engine,
            opened.store,
        )

    def make_spec(cfg, ref):
        if cfg == "off":
            return None
        if cfg == "lookup":
            return Speculator.open(lookup_opts, engine)
        # Fixed length: the draft model's acceptance over every step (adaptive, its
        # drafting, as costly as the model's own decode here, would stop it).
        draft.length = DraftLength(args.draft_tokens, adaptive=False)
        draft.steps.clear()
        return draft

    rate_a, acc_a = interleaved(engine, prompts, configs, args.tokens, args.rounds, make_spec)
    costs = row_costs(engine, prompts["code: ring buffer"], args.draft_tokens)
    engine.close()
    if draft is not None:
        draft.close()

    # A2: beside llama.cpp's prompt lookup on the same weights, every expert resident.
    llama = None
    if gguf is not None:
        engine = Engine(opened.consumer, threads=args.threads)
        llama = llama_rows(*llama_rounds(engine, gguf, prompts, args, lookup_opts))
        engine.close()

    # B: experts streamed through a partial cache, drafts at set acceptances.
    code = {k: v for k, v in prompts.items() if k.startswith("code")}
    engine = Engine(opened.consumer, cache_fraction=args.fraction, threads=args.threads)
    vocab = engine.cfg.vocab_size
    accs = (0.6, 0.8, 0.9)
    configs_b = ["off"] + [f"replay p={a:.1f}" for a in accs]

    def make_replay(cfg, ref):
        if cfg == "off":
            return None
        a = float(cfg.split("=")[1])
        return Speculator(Replay(ref, a, vocab), DraftLength(args.draft_tokens, adaptive=False))

    rate_b, acc_b = interleaved(engine, code, configs_b, args.tokens, args.rounds, make_replay)
    slots = engine.cache.n_slots
    engine.close()

    # C: eight clients at once through the scheduler (czyx serve's batching), no HTTP.
    served = served_rounds(opened, prompts, args)
    opened.close()
    wide = wide_rounds(args, Path(tmp.name)) if args.wide else None
    mtp = mtp_rounds(args, Path(tmp.name)) if args.mtp else None
    tmp.cleanup()
    wall = time.perf_counter() - t_start
    load1 = load()

    head = "| prompt | config | decode tok/s | vs off | acceptance | tokens per forward pass |"
    lines = [
        "# Speculative decoding on czyx-moe-stdlib",
        "",
        f"`{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}); {machine()}.",
        "",
        f"Greedy, {args.tokens} tokens per run, {args.rounds} rounds with the configurations "
        f"interleaved, medians of decode tokens/s; load average {load0} before, {load1} after "
        f"({wall:.0f} s in all). Engine kernel threads: {args.threads}. Draft length at most "
        f"{args.draft_tokens}. The tokens of every speculative run were checked identical to "
        "the non-speculative run's. Code prompts: code written for this benchmark (the model "
        "was trained on CPython's standard library; see `bench/bench_speculate.py`), each "
        f"prompt and its {args.tokens} tokens within the {context}-byte windows the model was "
        "trained on (past them its greedy text is noise no drafter predicts).",
        "",
        "## Prompt lookup, every expert resident",
        "",
        "Adaptive draft length (`--speculate lookup`, the default adaptivity)."
        + (
            f" `draft:{DRAFT_TAG}`: the model's own version quantized by the policy "
            f"`{args.draft_policy}` drafting, fixed length (the adaptive length would stop "
            "it: its decode costs as much as the model's)."
            if args.self
            else ""
        ),
        "",
        head,
        "| --- | --- | --- | --- | --- | --- |",
        *rows(rate_a, acc_a, configs),
        "",
        "What a verified row costs here (`row_costs`: after the ring-buffer prompt, a "
        "decode step of its continuation's first token and verification steps of that "
        "token and the next 1 .. k, the rows of a step that accepts every draft, timed in "
        "turn, 200 of each, "
        "medians; r: each row past the first relative to a decode step; ceiling: the "
        "speed-up of that step with every draft accepted, rows / (1 + r (rows - 1))). With "
        "every expert resident a step is its rows' arithmetic (each row's experts mostly its "
        "own, its attention over its own context), so a verified row costs a large share of "
        "a decode step, and the ceiling column bounds prompt lookup's gain on this model "
        "whatever the acceptance.",
        "",
        "| rows in the step | step us | r | ceiling at acceptance 1 |",
        "| --- | --- | --- | --- |",
        *(f"| {n} | {us:.0f} | {r:.2f} | {c:.2f}x |" for n, us, r, c in costs),
        "",
        f"## Experts streamed ({args.fraction:.0%} of them in {slots} slots), drafts at set "
        "acceptances",
        "",
        "The drafts replay the non-speculative continuation, each token kept with probability "
        "p (else a wrong token; seeded; acceptance, accepted over drafted, is lower: a draft "
        "after a rejected one is not accepted), fixed length: what verifying in one "
        "batched step saves at that acceptance (a drafter's real acceptance is in the table "
        "above). Bytes: expert bytes read per decoded token.",
        "",
        head + " expert KiB per token |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *rows(rate_b, acc_b, configs_b, bytes_column=True),
        "",
        f"## Served: eight requests at once ({args.fraction:.0%} of the experts cached)",
        "",
        "The scheduler `czyx serve` runs (continuous batching, its batched-engine options), "
        "eight greedy requests of the prompts above submitted together, speculation off and "
        "by prompt lookup (`czyx serve --speculate lookup`: every sequence's drafts verified "
        "in the shared steps); prompt processing included. Aggregate generated tokens/s "
        "(median of the rounds), expert bytes read per generated token, steps.",
        "",
        "| config | aggregate tok/s | vs off | acceptance | steps | expert KiB per token |",
        "| --- | --- | --- | --- | --- | --- |",
        *served_rows(served),
    ]
    lines += ["", "## Beside llama.cpp's prompt-lookup decoding, the same weights", ""]
    if llama is None:
        lines.append(f"Not run: {llama_why}.")
    else:
        lines += [
            f"The stored version `{GGUF_TAG}` (the bundled checkpoint, the same fp16 tensors as "
            "`stdlib@1`, mounted with a 256-token byte vocabulary added: llama.cpp loads no "
            "GGUF without one) "
            "written as GGUF by czyx's own exporter (`czyx export --format gguf`: F16 "
            "matrices, norms and router F32), run by "
            "llama-cpp-python's `Llama.generate` greedily, without a draft model and with "
            f"`LlamaPromptLookupDecoding(num_pred_tokens={args.draft_tokens})` (its default "
            "n-gram of 2, no adaptive length: it drafts whenever the last 2 or 1 tokens "
            "occurred before), `use_extra_bufts=False`, "
            f"{args.threads} thread(s), token ids in; czyx without drafts and with "
            f"`--speculate lookup` (n-gram 3, at most {args.draft_tokens} drafts, adaptive), "
            f"every expert resident, {args.threads} kernel thread(s). Same prompts, "
            f"{args.tokens} greedy tokens, all four in the same {args.rounds} rounds (order "
            "rotated round by round); decode tok/s as czyx counts it (every token but the "
            "first over the time from the first to the last), medians, ratios of medians. "
            "llama.cpp's acceptance: its drafts against the tokens it generated (accepted: "
            "each draft's prefix equal to the next tokens), within the requested length.",
            "",
            "| prompt | config | decode tok/s | vs its own plain decode | acceptance | "
            "tokens per forward pass |",
            "| --- | --- | --- | --- | --- | --- |",
            *llama[0],
            "",
            "| prompt | czyx lookup / llama.cpp lookup | czyx off / llama.cpp off | "
            "czyx lookup / czyx off | llama.cpp lookup / llama.cpp off | greedy ids: czyx vs "
            "llama.cpp | greedy ids: llama.cpp lookup vs off |",
            "| --- | --- | --- | --- | --- | --- | --- |",
            *llama[1],
        ]
    if wide is not None:
        rates, tot, shape = wide
        base = statistics.median(rates["off"])
        lines += [
            "",
            "## A wider model read from disk, drafts at set acceptances",
            "",
            f"A synthetic Mixtral-shaped model ({shape}); random weights give no real "
            "acceptance, so the drafts replay the non-speculative continuation, each token "
            "kept with probability p (seeded); acceptance is accepted over drafted. Fixed draft "
            "length.",
            "",
            "| config | decode tok/s | vs off | acceptance | tokens per forward pass | "
            "expert MiB per token |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for cfg, t in tot.items():
            med = statistics.median(rates[cfg])
            lines.append(
                f"| {cfg} | {med:.2f} | {med / base:.2f}x | {counts(t)} | "
                f"{t[4] / max(t[3], 1) / 2**20:.1f} |"
            )
    if mtp is not None:
        lines += [
            "",
            "## The MTP layer as the draft head (`--speculate mtp`), a tiny random DeepSeek-V3",
            "",
            "A 3-layer DeepSeek-V3 of `czyx.testing` (hidden 32) with a random MTP layer "
            "appended as published checkpoints lay it out, every expert resident, fixed draft "
            "length. Random weights give a meaningless acceptance: the row shows the head's "
            "cost and that the tokens are unchanged, not what a trained MTP layer accepts.",
            "",
            head,
            "| --- | --- | --- | --- | --- | --- |",
            *rows(*mtp, ["off", "mtp"]),
        ]
    lines += [
        "",
        "## Reading it",
        "",
        "- The bundled model is a small byte-level code model trained on "
        f"{context}-byte windows; within one, its greedy text often repeats a span of the "
        "prompt or of itself, and the drafts prompt lookup makes are mostly accepted (the "
        "acceptance column), but it makes few: see the next point. Where it drafted almost "
        "nothing, its ratio to off measures the drafter's per-token bookkeeping and this "
        "machine's run-to-run spread (the load average above), not verification.",
        "- Every expert resident, there is no read for a verified step to share, and a "
        "verified row costs about as much as a plain step on this model (its weights stay "
        "in the CPU's caches: a row is its own arithmetic; the row-cost table), so the "
        "measured row cost keeps the adaptive length near 0, and the ceiling column bounds "
        "what any drafter could gain here. The self-draft's acceptance and tokens per "
        "forward pass are in the table; its tok/s there includes the draft's own decode.",
        "- Where experts are read (the streamed and wider tables), one step reads each "
        "chosen expert once for all its rows, and tokens/s rises with the acceptance; "
        "expert bytes per token rise with rejected drafts (a step's rows choose a union of "
        "experts that a partial cache evicts and reads again), and fall to about the "
        "non-speculative figure only near full acceptance.",
    ]
    if llama is not None:
        lines.append(
            "- Beside llama.cpp: both drafters take the tokens after an earlier occurrence of "
            "the text's tail (llama.cpp: its earliest occurrence of the last 2 tokens, else "
            "of the last one; czyx: the latest of the last 3, 2 or 1). llama.cpp drafts its "
            "full length whenever there is a match (on a byte vocabulary a 1-token match is "
            "almost always there) and keeps every row's logits once a draft model is set; "
            "czyx's adaptive length drafts only where the measured acceptance and row cost "
            "say a draft pays."
        )
    lines.append(
        "- The real-shape model under a memory cap, drafts replayed at set acceptances: "
        "`bench/SPECULATE-realshape.md` (`--realshape DIR`)."
    )
    return write_report(lines, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
