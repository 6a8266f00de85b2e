"""czyx vs llama.cpp on the bundled trained model: decode and prefill tok/s, side by side.

The model: ``inference/assets/czyx-moe-stdlib`` (a byte-level Mixtral: hidden
128, 4 layers, 16 experts top-2). Both engines get the same weights:

* czyx: the checkpoint in float32 (transformers' loader), and quantized in
  memory (``store.quant.memory.QuantizedConsumer``: the bytes ``czyx mount
  --quant`` stores) as q8 and q4 on every matrix but the router, run by
  :class:`czyx.inference.engine.Engine` as ``czyx run`` builds it (streaming
  cache, everything resident), and also with the synchronous cache
  (``EngineOptions(stream=False)``);
* llama.cpp (``llama-cpp-python`` built from source, CPU): GGUF files written
  here with the ``gguf`` package the way llama.cpp's converter writes a
  Mixtral (architecture ``llama``; q/k rows permuted to its rope layout;
  experts stacked as ``ffn_{gate,up,down}_exps``; router ``ffn_gate_inp`` kept
  f32, as llama-quantize does), in f32, q8_0 and q4_0 (every other matrix in
  that type, as ``--pure``), loaded with ``use_extra_bufts=False`` (its AMX
  repacking crashes on these types here). Tokens are fed as ids (a 256-entry
  byte vocabulary), so neither engine tokenizes.

Each measurement: reset, prefill the same 128-byte prompt (timed: prefill
tok/s; ``--prompt-bytes`` sets its length, up to the model's 1024 positions
less the decoded ones, where attention over the context dominates a step),
then 64 greedy steps (argmax of the logits, timed: decode tok/s).
Every engine and thread count runs once per round, the order rotating per
round; the figures are medians over rounds, and ratios are czyx over
llama.cpp in the matching format and thread count, measured in the same run.
The load average is printed before and after (the machine is shared).

Run: ``OPENBLAS_NUM_THREADS=1 python bench/bench_speed.py`` (``--rounds``,
``--threads 1 2``, ``--prompt-bytes 128``, ``--out bench/SPEED.md``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _report import write_report

PROMPT_BYTES = 128
N_DECODE = 64
CZYX_FORMATS = {"fp32": None, "q8": "q8", "q4": "q4"}
LLAMA_FORMATS = {"fp32": "F32", "q8": "Q8_0", "q4": "Q4_0"}
DEFAULT_OUT = Path(__file__).resolve().with_name("SPEED.md")


def _rel(path: str) -> str:
    """``path`` relative to the repository when inside it (as the report's command)."""
    p = Path(path).resolve()
    try:
        return str(p.relative_to(DEFAULT_OUT.parents[1]))
    except ValueError:
        return str(p)


def prompt_tokens(n: int = PROMPT_BYTES) -> list[int]:
    """``n`` bytes of a standard-library source file (the domain the model was trained on)."""
    import json

    src = Path(json.__file__).with_name("decoder.py").read_bytes()
    start = src.index(b"def ")
    if start + n > len(src):
        raise SystemExit(f"--prompt-bytes {n}: json/decoder.py has {len(src) - start}")
    return list(src[start : start + n])


def load_model():
    """``(transformers model in float32, its config dict)``."""
    import torch
    from transformers import AutoModelForCausalLM

    from czyx.inference.assets import bundled_model_dir

    torch.set_num_threads(1)
    d = bundled_model_dir()
    tm = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    return tm, tm.config.to_dict()


# --------------------------------------------------------------------------- GGUF


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation of q/k rows (HF rotate-half -> interleaved rope)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(tm, cfg: dict, path: str, qtype_name: str, byte_bpe: bool = False) -> None:
    """Write the transformers Mixtral ``tm`` as a llama.cpp GGUF in ``qtype_name``.

    ``byte_bpe``: a GPT-2-style byte vocabulary without merges instead of
    sentencepiece byte tokens, so llama.cpp's own tokenizer maps text to one
    id per byte as czyx does (needed where text, not ids, goes in: its server).
    """
    import gguf
    from gguf.quants import quantize

    qtype = getattr(gguf.GGMLQuantizationType, qtype_name)
    sd = {k: v.detach().float().numpy() for k, v in tm.state_dict().items()}
    n_layers = cfg["num_hidden_layers"]
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    n_exp = cfg["num_local_experts"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("czyx-moe-stdlib")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(n_layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(n_exp)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(
        {"F32": gguf.LlamaFileType.ALL_F32, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}.get(
            qtype_name, gguf.LlamaFileType.MOSTLY_Q4_0
        )
    )
    if byte_bpe:  # byte-level BPE, no merges: each byte is its own token, id = byte
        # GPT-2's bytes_to_unicode: printable bytes stand for themselves, the rest
        # are shifted above U+0100 in order.
        keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
        b2u, extra = {b: chr(b) for b in keep}, 0
        for b in range(256):
            if b not in b2u:
                b2u[b], extra = chr(256 + extra), extra + 1
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list([b2u[i] for i in range(cfg["vocab_size"])])
        w.add_token_types([gguf.TokenType.NORMAL] * cfg["vocab_size"])
        # llama.cpp refuses a BPE vocabulary without merges: one that never applies
        # (two NUL bytes; text never holds them).
        w.add_token_merges([f"{b2u[0]} {b2u[0]}"])
    else:  # A byte vocabulary (sentencepiece byte tokens): ids are bytes, as for czyx.
        w.add_tokenizer_model("llama")
        w.add_token_list([f"<0x{i:02X}>" for i in range(cfg["vocab_size"])])
        w.add_token_scores([0.0] * cfg["vocab_size"])
        w.add_token_types([gguf.TokenType.BYTE] * cfg["vocab_size"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(False)

    def put(name: str, arr: np.ndarray, quant: bool = True) -> None:
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if quant and qtype != gguf.GGMLQuantizationType.F32 and arr.ndim >= 2:
            w.add_tensor(name, quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, arr)

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    put("output.weight", sd["lm_head.weight"])
    for i in range(n_layers):
        p = f"model.layers.{i}."
        b = f"blk.{i}."
        put(b + "attn_norm.weight", sd[p + "input_layernorm.weight"])
        put(b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        put(b + "attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], n_head))
        put(b + "attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], n_kv))
        put(b + "attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        put(b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        put(b + "ffn_gate_inp.weight", sd[p + "mlp.gate.weight"], quant=False)
        gate, up, down = _experts(sd, p, n_exp, cfg["intermediate_size"])
        put(b + "ffn_gate_exps.weight", gate)
        put(b + "ffn_up_exps.weight", up)
        put(b + "ffn_down_exps.weight", down)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _experts(sd: dict, p: str, n_exp: int, inter: int):
    """Stacked ``gate [E, I, H]``, ``up [E, I, H]``, ``down [E, H, I]`` of one layer."""
    fused = p + "mlp.experts.gate_up_proj"
    if fused in sd:  # transformers 5: gate_up_proj [E, 2I, H] (or [E, H, 2I]), down_proj
        gu = sd[fused]
        if gu.shape[1] != 2 * inter:
            gu = gu.transpose(0, 2, 1)
        down = sd[p + "mlp.experts.down_proj"]
        if down.shape[2] != inter:
            down = down.transpose(0, 2, 1)
        return gu[:, :inter], gu[:, inter:], down
    gate = np.stack([sd[f"{p}block_sparse_moe.experts.{e}.w1.weight"] for e in range(n_exp)])
    down = np.stack([sd[f"{p}block_sparse_moe.experts.{e}.w2.weight"] for e in range(n_exp)])
    up = np.stack([sd[f"{p}block_sparse_moe.experts.{e}.w3.weight"] for e in range(n_exp)])
    return gate, up, down


# --------------------------------------------------------------------------- engines


class LlamaRunner:
    """llama.cpp through llama-cpp-python: ids in, the last token's logits out."""

    def __init__(self, path: str, threads: int, vocab: int, n_ctx: int = 512) -> None:
        import llama_cpp
        import llama_cpp.llama_cpp as ll
        from _llama import without_extra_bufts

        with without_extra_bufts():
            self.llm = llama_cpp.Llama(
                model_path=path,
                n_ctx=n_ctx,
                n_batch=n_ctx,
                n_ubatch=n_ctx,
                n_threads=threads,
                n_threads_batch=threads,
                verbose=False,
            )
        self._ll = ll
        self.vocab = vocab

    def logits(self) -> np.ndarray:
        ptr = self._ll.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.vocab,))

    def run(self, prompt: list[int], n: int) -> tuple[float, float, list[int], float]:
        llm = self.llm
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1 = time.perf_counter()
        toks = []
        tok = int(np.argmax(self.logits()))
        c2, t2 = time.process_time(), time.perf_counter()
        for _ in range(n):
            toks.append(tok)
            llm.eval([tok])
            tok = int(np.argmax(self.logits()))
        c3, t3 = time.process_time(), time.perf_counter()
        return len(prompt) / (t1 - t0), n / (t3 - t2), toks, n / max(c3 - c2, 1e-9)

    def close(self) -> None:
        self.llm.close()


class CzyxRunner:
    """A czyx Engine on a consumer: prefill, then greedy decode steps."""

    def __init__(self, consumer, threads: int, stream: bool) -> None:
        from czyx.inference.engine import Engine
        from czyx.inference.options import EngineOptions

        options = None if stream else EngineOptions(stream=False)
        self.eng = Engine(consumer, threads=threads, options=options)

    def run(self, prompt: list[int], n: int) -> tuple[float, float, list[int], float]:
        eng = self.eng
        eng.reset()
        t0 = time.perf_counter()
        logits = eng.prefill(prompt)
        t1 = time.perf_counter()
        toks = []
        tok = int(np.argmax(logits))
        c2, t2 = time.process_time(), time.perf_counter()
        for _ in range(n):
            toks.append(tok)
            tok = int(np.argmax(eng.decode(tok)))
        c3, t3 = time.process_time(), time.perf_counter()
        return len(prompt) / (t1 - t0), n / (t3 - t2), toks, n / max(c3 - c2, 1e-9)

    def close(self) -> None:
        self.eng.close()


def czyx_consumer(base, fmt: str | None):
    """The float consumer, or it quantized in ``fmt`` on every matrix but the router."""
    if fmt is None:
        return base
    from czyx.store.quant.memory import QuantizedConsumer
    from czyx.store.quant.policy import parse_policy

    pol = f"none,expert={fmt},attention={fmt},embed={fmt},lm_head={fmt}"
    return QuantizedConsumer(base, parse_policy(pol))


def step_breakdown(consumer, prompt: list[int], reps: int = 400) -> dict[str, float]:
    """CPU microseconds per decode token: the whole step, and its C kernel calls alone.

    The kernel calls are replayed on the engine's own buffers and weights in
    the step's order (per layer: attention block, routing, MoE; then the
    head), so ``step - kernels`` is what the Python around them costs (the
    cache's acquire/release, the calls' wrappers, the loop). One thread, the
    engine as ``czyx run`` builds it (streaming cache, all resident), every
    expert read and verified first, so no read runs during the step.
    """
    from czyx.inference.engine import Engine

    eng = Engine(consumer, threads=1)
    m = eng.model
    cfg = m.cfg
    every = [(i, e) for i in range(cfg.n_layers) for e in range(cfg.n_experts)]
    eng.cache.prewarm(every)
    eng.prefill(prompt)
    pos = eng.position
    tok = 65

    def step() -> None:
        eng.kv.truncate(pos)
        eng.decode(tok)

    def calls() -> None:
        k = m.kernels()
        for i, lw in enumerate(m.layers):
            k.attention(
                lw, eng.kv.k[i], eng.kv.v[i], pos, cfg.sliding_windows[i], m.rotary,
                cfg.rms_eps, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
            )  # fmt: skip
            k.route(lw.router, cfg.top_k, cfg.renormalize)
            k.moe(m.experts, m.experts.table[i, k.idx].astype(np.int64), k.w)
        k.head(m.final_norm, m.lm_head, cfg.rms_eps)

    out = {}
    for name, fn in (("step", step), ("kernels", calls), ("step ", step), ("kernels ", calls)):
        for _ in range(20):
            fn()
        t0 = time.process_time()
        for _ in range(reps):
            fn()
        out[name.strip()] = min(out.get(name.strip(), 1e9), (time.process_time() - t0) / reps * 1e6)
    eng.close()
    return out


# --------------------------------------------------------------------------- main


def _agreement(a: list[int], b: list[int]) -> tuple[int, float]:
    """(tokens equal before the first difference, fraction of equal positions)."""
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    return first, float(np.mean([x == y for x, y in zip(a, b)]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--no-sync", action="store_true", help="skip the sync-cache czyx engines")
    ap.add_argument(
        "--prompt-bytes", type=int, default=PROMPT_BYTES, help="prompt length (the context)"
    )
    args = ap.parse_args(argv)

    from czyx.inference.kernels import fused
    from czyx.testing.refmodels import StateDictConsumer

    load0 = os.getloadavg()
    tm, cfg = load_model()
    base = StateDictConsumer(tm)
    prompt = prompt_tokens(args.prompt_bytes)
    if len(prompt) + N_DECODE > cfg["max_position_embeddings"]:
        raise SystemExit(
            f"--prompt-bytes {len(prompt)} + {N_DECODE} decoded exceed the model's "
            f"{cfg['max_position_embeddings']} positions"
        )
    n_ctx = max(512, len(prompt) + N_DECODE)
    work = tempfile.mkdtemp(prefix="bench_speed_")
    runners: dict[tuple[str, str, int], object] = {}
    consumers = {f: czyx_consumer(base, q) for f, q in CZYX_FORMATS.items()}
    for fmt, qname in LLAMA_FORMATS.items():
        path = os.path.join(work, f"model-{qname}.gguf")
        write_gguf(tm, cfg, path, qname)
        for t in args.threads:
            runners[("llama.cpp", fmt, t)] = LlamaRunner(path, t, cfg["vocab_size"], n_ctx)
    for fmt in CZYX_FORMATS:
        for t in args.threads:
            runners[("czyx", fmt, t)] = CzyxRunner(consumers[fmt], t, stream=True)
            if not args.no_sync:
                runners[("czyx-sync", fmt, t)] = CzyxRunner(consumers[fmt], t, stream=False)
    keys = list(runners)
    for k in keys:  # warm-up: first-call allocations, page faults
        runners[k].run(prompt, 8)
    res: dict[tuple, list[tuple[float, float, float]]] = {k: [] for k in keys}
    toks: dict[tuple, list[int]] = {}
    for r in range(args.rounds):
        order = keys[r % len(keys) :] + keys[: r % len(keys)]
        for k in order:
            pre, dec, tk, cpu = runners[k].run(prompt, N_DECODE)
            res[k].append((pre, dec, cpu))
            toks[k] = tk
        print(f"round {r + 1}/{args.rounds} done, load {os.getloadavg()}", file=sys.stderr)
    load1 = os.getloadavg()
    for k in keys:
        runners[k].close()
    breakdown = {fmt: step_breakdown(consumers[fmt], prompt) for fmt in CZYX_FORMATS}

    med = {k: tuple(statistics.median(r[i] for r in v) for i in range(3)) for k, v in res.items()}
    lines = _report(args, med, toks, load0, load1, fused.level(), breakdown)
    return write_report(lines, args.out)


def _table(title: str, threads: list[int], engines: list[str], med: dict, col: int) -> list[str]:
    """A markdown table of column ``col`` (0 prefill, 1 decode, 2 decode per CPU-second)."""
    out = [
        f"## {title}",
        "",
        "| threads | format | llama.cpp | " + " | ".join(f"{e} | ratio" for e in engines) + " |",
        "|---|---|---|" + "---|---|" * len(engines),
    ]
    for t in threads:
        for fmt in CZYX_FORMATS:
            base = med[("llama.cpp", fmt, t)][col]
            cells = [f"{med[(e, fmt, t)][col]:,.0f} | {med[(e, fmt, t)][col] / base:.2f}x"
                     for e in engines]  # fmt: skip
            row = f"| {t} | {fmt} / {LLAMA_FORMATS[fmt]} | {base:,.0f} | " + " | ".join(cells)
            out.append(row + " |")
    out.append("")
    return out


def _report(args, med, toks, load0, load1, simd: str, breakdown: dict) -> list[str]:
    engines = ["czyx"] + ([] if args.no_sync else ["czyx-sync"])
    cmd = "OPENBLAS_NUM_THREADS=1 python bench/bench_speed.py " + " ".join(
        [f"--rounds {args.rounds}", "--threads " + " ".join(map(str, args.threads))]
        + (["--no-sync"] if args.no_sync else [])
        + ([] if args.prompt_bytes == PROMPT_BYTES else [f"--prompt-bytes {args.prompt_bytes}"])
        + ([] if Path(args.out).resolve() == DEFAULT_OUT else [f"--out {_rel(args.out)}"])
    )
    out = [
        "# czyx vs llama.cpp: decode and prefill speed on the bundled model",
        "",
        "Generated by `bench/bench_speed.py` (its docstring states the method).",
        "",
        f"- command: `{cmd}`",
        f"- machine: {platform.machine()}, {os.cpu_count()} CPUs visible, "
        f"affinity {len(os.sched_getaffinity(0))}; czyx kernel path: {simd}; "
        f"python {platform.python_version()}",
        f"- load average before: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}; "
        f"after: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} (shared machine)",
        f"- model: inference/assets/czyx-moe-stdlib; prompt {args.prompt_bytes} bytes, "
        f"{N_DECODE} greedy tokens; medians of {args.rounds} interleaved rounds (wall time)",
        "- czyx: `Engine` as `czyx run` builds it (streaming cache, all resident); "
        "czyx-sync: `Engine(options=EngineOptions(stream=False))`",
        "",
    ]
    out += _table(
        "Decode tok/s (ratio: czyx / llama.cpp, same format and threads, same run)",
        args.threads, engines, med, 1,
    )  # fmt: skip
    title = f"Prefill tok/s ({args.prompt_bytes}-token prompt)"
    out += _table(title, args.threads, engines, med, 0)
    out += _table(
        "Decode tokens per CPU-second of the process (1 thread: robust to the neighbours' load)",
        args.threads[:1], engines, med, 2,
    )  # fmt: skip
    if len(args.threads) > 1:
        t1, t2 = args.threads[0], args.threads[-1]
        out += [f"## {t2} threads over {t1} (decode)", "",
                "Ratio of wall tok/s, and beside it the process's CPU time per token at "
                f"{t2} threads over {t1} (1.00: the same work; above: work added by the "
                "second thread, spinning or splitting).", "",
                "| engine | format | tok/s ratio | CPU per token ratio |",
                "|---|---|---|---|"]  # fmt: skip
        for e in ["llama.cpp", *engines]:
            for fmt in CZYX_FORMATS:
                r = med[(e, fmt, t2)][1] / med[(e, fmt, t1)][1]
                c = med[(e, fmt, t1)][2] / med[(e, fmt, t2)][2]
                out.append(f"| {e} | {fmt} | {r:.2f}x | {c:.2f}x |")
    out += [
        "",
        "## Greedy-token agreement with llama.cpp (64 tokens, first thread count)",
        "",
        "| format | identical prefix | equal positions |",
        "|---|---|---|",
    ]
    t = args.threads[0]
    for fmt in CZYX_FORMATS:
        first, frac = _agreement(toks[("czyx", fmt, t)], toks[("llama.cpp", fmt, t)])
        out.append(f"| {fmt} / {LLAMA_FORMATS[fmt]} | {first} | {frac:.2f} |")
    same = all(
        toks[(e, fmt, t)] == toks[("czyx", fmt, args.threads[0])]
        for e in engines
        for fmt in CZYX_FORMATS
        for t in args.threads
        if fmt
    )
    out += [
        "",
        "## Where a czyx decode step goes (CPU us per token, 1 thread, `czyx run`'s engine, warm)",
        "",
        "The step replayed as its C calls alone (per layer: attention block, routing, MoE; "
        "then the head) against the whole step; the difference is Python: the cache's "
        "acquire (a table read, warm), the call wrappers, the routing count, the layer loop.",
        "",
        "| format | whole step | C kernel calls | Python around them | per layer |",
        "|---|---|---|---|---|",
    ]
    for fmt, b in breakdown.items():
        py = b["step"] - b["kernels"]
        out.append(f"| {fmt} | {b['step']:.1f} | {b['kernels']:.1f} | {py:.1f} | {py / 4:.1f} |")
    out += [
        "",
        "## Notes (method and what the figures mean)",
        "",
        "- Threads: the engine's kernels run on its own pool, each loop cut into chunks "
        "claimed by whichever thread is free; a loop of fewer than 65,536 multiply-adds "
        "stays on the calling thread (waking a worker costs more). Every loop of this "
        "model's decode step is below that, so at 2 threads czyx runs its decode on one "
        "thread: the 2-thread column measures the same work, and differences are the "
        "machine's noise. BLAS (prefill) is held to one thread inside the engine.",
        "- Prefill: the prompt runs through the batched C step (`Engine.prefill`, "
        "`inference.engine.prompt_in_c`): its tokens' attention in groups of up to four "
        "that share each weight row, their (token, expert) pairs grouped by expert so "
        "each expert's rows are read once for the tokens that chose it, every token's "
        "arithmetic the C decode's (so the prompt's KV and logits are its tokens decoded "
        "one at a time, bit for bit).",
        "- The streaming cache under a budget that holds every expert (`czyx run`'s "
        "default): nothing is ever evicted, so once the experts a layer asks for are "
        "resident and verified its acquire is one table read (no hold, no policy touch, "
        "no reader-thread round-trip), and a layer whose experts were all resident is not "
        "predicted (no look-ahead product) until it has to read again. Warm, czyx and "
        "czyx-sync run the same per-layer work; a partial budget keeps the full "
        "streaming path (look-ahead, early routing, policy touches).",
        "- What stays in Python per layer of a warm decode step: the layer loop, the "
        "three kernel calls' wrappers (descriptor lookup, pointer casts), the routing "
        "count, that table read and the residual add. They stay in Python because the "
        "cache and its policies are Python objects other parts of czyx extend; one C "
        "call per layer (attention, routing, MoE together) is the next step if the "
        "per-layer figure above matters for a model this small (for a real model the "
        "kernels dominate).",
        "- The quantized decode kernels quantize each product's input to 8 bits per block "
        "of 32 and use integer dot products, as llama.cpp does; the prompt's products "
        "run the same kernels (several tokens per weight row, each token as its decode "
        "step computes it).",
        "",
    ]
    out.append(
        f"czyx tokens identical across engines and thread counts per format: {same}. "
        "The quantized formats differ in arithmetic (czyx: asymmetric groups with an fp16 "
        "min, llama.cpp: symmetric q8_0/q4_0), so their tokens may drift; fp32 should agree "
        "up to float rounding."
    )
    return out


if __name__ == "__main__":
    raise SystemExit(main())
