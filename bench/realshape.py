"""A real-shape MoE with deterministic random weights, for czyx and llama.cpp alike.

Writes, once, into ``--out`` (outside the repository, e.g. ``/work/data/realshape``):

* ``hf/``: a Hugging Face safetensors checkpoint (bf16, sharded by layer, with
  ``config.json`` and an index) that ``czyx mount`` accepts;
* ``gguf/model-q8_0.gguf`` and ``gguf/model-q4_0.gguf``: the same weights (the
  bf16 values, widened) for llama.cpp, matrices in q8_0 / q4_0, norms and
  routers f32 (as ``convert_hf_to_gguf`` leaves them).

Shapes: OLMoE-1B-7B by default (16 layers, 64 experts top-8, hidden 2048,
expert intermediate 1024, 16 heads, vocab 50304); ``--full`` is Qwen3-30B-A3B's
(48 layers, 128 experts top-8, hidden 2048, expert intermediate 768, GQA 32/4,
head dim 128, vocab 151936); ``--shape qwen3-next`` is Qwen3-Next-80B-A3B's
MoE shape (48 layers, 512 experts top-10, hidden 2048, expert intermediate 512,
GQA 16/2, head dim 256, vocab 151936) on Qwen3-MoE's full attention (its gated
DeltaNet layers and shared expert are not generated: the bench measures expert
streaming, which they do not change). ``--scale F`` keeps every per-tensor shape (so an
expert is as big as the real one and reads cost what they cost) and keeps
``F`` of the layers: a smaller model of the same shape class.

Streaming: tensors are generated one at a time (per-tensor seeds, so the
bytes do not depend on order), written straight into their shard; the GGUF
files are written from the safetensors (memory-mapped) one layer at a time.
Nothing holds the whole model.

Realistic routing, on purpose. In a random network the residual stream is
dominated by a token-independent part, routing collapses onto a few experts and
a memory cap barely bites. Here the embeddings dominate the residual (rows of
unit-variance entries, every layer's output projections scaled down), so each
token's router input is mostly its own embedding (diverse routing, like a
trained model's), and the attention output adds a context component of
relative size ``--mix`` that varies slowly along the text (temporal locality,
as trained models show). ``routing_stats`` measures per-layer usage entropy,
lag-1 reuse and distinct experts per 64 tokens; ``python bench/realshape.py
stats`` prints them beside the bundled model's on the same text.

Tokens: the czyx checkpoint has no tokenizer; the bench feeds token ids. A
text becomes ids by hashing byte bigrams into the vocabulary
(:func:`text_ids`), so both engines and every run see the same ids.

``--no-hf`` writes no checkpoint: the GGUF files are written straight from the
generator (the same bf16-rounded values) and each czyx version is mounted from
its GGUF file (Q8_0 / Q4_0 repacked into the store's q8 / q4 without loss, so
both engines hold the very same codes). It is how the full Qwen3-30B-A3B shape
fits a disk: its bf16 checkpoint alone is 61 GB, its Q4_0 file 17 GB.

Usage::

    python bench/realshape.py gen --out /work/data/rs --scale 0.25
    python bench/realshape.py gen --out /work/data/qwen3 --full --no-hf --gguf q4_0 --czyx q4
    python bench/realshape.py stats --out /work/data/rs
    python bench/realshape.py check --out /work/data/rs   # greedy tokens, both engines
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
BUNDLED = REPO / "inference" / "assets" / "czyx-moe-stdlib"
DEFAULT_TEXT = REPO / "store" / "models" / "mount.py"  # any stable text in the repo


@dataclass(frozen=True)
class Shape:
    """The architecture numbers of one model."""

    arch: str
    layers: int
    experts: int
    top_k: int
    hidden: int
    inter: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    norm_topk: bool
    rope_theta: float
    eps: float

    @property
    def expert_params(self) -> int:
        """Routed-expert weights of the whole model."""
        return self.layers * self.experts * 3 * self.hidden * self.inter

    @property
    def trunk_params(self) -> int:
        """Everything else (embeddings, head, attention, routers, norms)."""
        att = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return 2 * self.vocab * self.hidden + self.layers * (att + self.experts * self.hidden)


#: The attention-output scale of layers after the first (see :func:`generate`).
DEEP_MIX = 0.5

OLMOE = Shape("olmoe", 16, 64, 8, 2048, 1024, 50304, 16, 16, 128, False, 10000.0, 1e-5)
QWEN3 = Shape("qwen3_moe", 48, 128, 8, 2048, 768, 151936, 32, 4, 128, True, 1e6, 1e-6)
QWEN3_NEXT = Shape("qwen3_moe", 48, 512, 10, 2048, 512, 151936, 16, 2, 256, True, 1e7, 1e-6)
SHAPES = {"olmoe": OLMOE, "qwen3": QWEN3, "qwen3-next": QWEN3_NEXT}


def make_shape(full: bool | str, scale: float) -> Shape:
    """The published shape (``True``: Qwen3-30B-A3B's; or a :data:`SHAPES` name),
    keeping ``scale`` of its layers (at least one)."""
    base = SHAPES[full] if isinstance(full, str) else (QWEN3 if full else OLMOE)
    if not 0 < scale <= 1:
        raise SystemExit(f"--scale must be in (0, 1], got {scale}")
    layers = max(1, round(base.layers * scale))
    return Shape(**{**asdict(base), "layers": layers})


# ----------------------------------------------------------------- tensors


def hf_tensors(s: Shape) -> list[tuple[str, tuple[int, ...], str]]:
    """``(name, shape, kind)`` of every tensor, in file order (layer by layer)."""
    h, q, kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    qn = (q,) if s.arch == "olmoe" else (s.head_dim,)  # OLMoE norms all of q / k
    kn = (kv,) if s.arch == "olmoe" else (s.head_dim,)
    out = [("model.embed_tokens.weight", (s.vocab, h), "embed")]
    for i in range(s.layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (h,), "norm"),
            (p + "self_attn.q_proj.weight", (q, h), "in"),
            (p + "self_attn.k_proj.weight", (kv, h), "in"),
            (p + "self_attn.v_proj.weight", (kv, h), "in"),
            (p + "self_attn.o_proj.weight", (h, q), "attn_out"),
            (p + "self_attn.q_norm.weight", qn, "qnorm"),
            (p + "self_attn.k_norm.weight", kn, "norm"),
            (p + "post_attention_layernorm.weight", (h,), "norm"),
            (p + "mlp.gate.weight", (s.experts, h), "in"),
        ]
        for e in range(s.experts):
            x = f"{p}mlp.experts.{e}."
            out += [
                (x + "gate_proj.weight", (s.inter, h), "in"),
                (x + "up_proj.weight", (s.inter, h), "in"),
                (x + "down_proj.weight", (h, s.inter), "expert_out"),
            ]
    out += [("model.norm.weight", (h,), "norm"), ("lm_head.weight", (s.vocab, h), "in")]
    return out


def generate(name: str, shape: tuple[int, ...], kind: str, seed: int, mix: float) -> np.ndarray:
    """The float32 values of one tensor (its own seed: order-independent).

    Scales: embeddings unit variance (they dominate the residual); input
    projections ``1/sqrt(fan_in)`` (unit-variance outputs of a normalised input);
    attention output ``mix/sqrt(fan_in)`` (the context component); expert
    outputs ``0.1/sqrt(fan_in)``; norms ``1 + 0.02 N``, the query norm a tenth of
    that, so attention is nearly uniform over the context and its output is a
    running mean that drifts slowly along the text.
    """
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if kind in ("norm", "qnorm"):
        x = (1.0 + 0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
        return x * np.float32(0.1) if kind == "qnorm" else x
    x = rng.standard_normal(shape, dtype=np.float32)
    fan_in = shape[-1]
    if kind == "attn_out" and not name.startswith("model.layers.0."):
        # Layer 0 averages token embeddings, whose mean shrinks as 1/sqrt(context):
        # it needs the large mix. Deeper layers average a residual that already
        # holds that smooth context (it does not shrink), so a large mix there
        # would compound layer after layer until the context alone routes.
        mix = DEEP_MIX
    scale = {
        "embed": 1.0,
        "in": 1.0 / np.sqrt(fan_in),
        "attn_out": mix / np.sqrt(fan_in),
        "expert_out": 0.1 / np.sqrt(fan_in),
    }[kind]
    x *= np.float32(scale)
    return x


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (``uint16``), round to nearest even."""
    b = x.view(np.uint32)
    return ((b + np.uint32(0x7FFF) + ((b >> 16) & np.uint32(1))) >> 16).astype(np.uint16)


def hf_config(s: Shape) -> dict:
    """``config.json`` of the checkpoint (transformers' names for the arch)."""
    cfg = {
        "architectures": ["OlmoeForCausalLM" if s.arch == "olmoe" else "Qwen3MoeForCausalLM"],
        "model_type": s.arch,
        "hidden_size": s.hidden,
        "intermediate_size": s.inter,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "num_experts_per_tok": s.top_k,
        "norm_topk_prob": s.norm_topk,
        "vocab_size": s.vocab,
        "rms_norm_eps": s.eps,
        "rope_parameters": {"rope_theta": s.rope_theta, "rope_type": "default"},
        "max_position_embeddings": 4096,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    if s.arch == "olmoe":
        cfg["num_experts"] = s.experts
        cfg["clip_qkv"] = None
    else:
        cfg["num_local_experts"] = s.experts
        cfg["moe_intermediate_size"] = s.inter
        cfg["decoder_sparse_step"] = 1
        cfg["mlp_only_layers"] = []
        cfg["use_sliding_window"] = False
        cfg["sliding_window"] = None
    return cfg


def write_hf(out: Path, s: Shape, seed: int, mix: float) -> int:
    """Write the sharded bf16 checkpoint; returns its tensor bytes."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(s)

    def shard_key(name: str) -> str:
        parts = name.split(".")
        return parts[2] if name.startswith("model.layers.") else parts[0] + parts[1][:5]

    shards: list[list[tuple[str, tuple[int, ...], str]]] = []
    for t in tensors:  # one shard per layer, one for the embeddings, one for the head
        if not shards or shard_key(shards[-1][-1][0]) != shard_key(t[0]):
            shards.append([])
        shards[-1].append(t)
    n = len(shards)
    weight_map, total = {}, 0
    for k, group in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        header, off = {}, 0
        for name, shape, _ in group:
            nb = int(np.prod(shape)) * 2
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + nb]}
            off += nb
            weight_map[name] = fname
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        tmp = out / (fname + ".part")
        with open(tmp, "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)))
            fh.write(raw)
            for name, shape, kind in group:
                fh.write(to_bf16(generate(name, shape, kind, seed, mix)).tobytes())
        os.replace(tmp, out / fname)
        total += off
        print(f"  hf shard {k + 1}/{n} ({off / 1e9:.2f} GB)", flush=True)
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    (out / "config.json").write_text(json.dumps(hf_config(s), indent=1))
    return total


# -------------------------------------------------------------------- gguf

GGUF_FORMATS = ("q8_0", "q4_0")


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (what the checkpoint stores), as float32."""
    return (to_bf16(x).astype(np.uint32) << np.uint32(16)).view(np.float32)


def generated(s: Shape, seed: int, mix: float) -> Callable[[str], np.ndarray]:
    """The float32 values of each HF tensor straight from the generator, rounded to
    bf16 as :func:`write_hf` stores them (so a GGUF file written from either is the same)."""
    table = {name: (shape, kind) for name, shape, kind in hf_tensors(s)}

    def values(name: str) -> np.ndarray:
        shape, kind = table[name]
        return bf16_round(generate(name, shape, kind, seed, mix))

    return values


def write_gguf(values: Callable[[str], np.ndarray], path: Path, s: Shape, fmt: str) -> int:
    """The GGUF file of the model whose HF tensors ``values(name)`` gives (float32),
    matrices in ``fmt`` (q8_0 / q4_0)."""
    import gguf

    qt = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}[fmt]
    arch = "olmoe" if s.arch == "olmoe" else "qwen3moe"
    w = gguf.GGUFWriter(str(path) + ".part", arch)
    w.add_context_length(4096)
    w.add_embedding_length(s.hidden)
    w.add_block_count(s.layers)
    w.add_feed_forward_length(s.inter)
    w.add_expert_feed_forward_length(s.inter)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_layer_norm_rms_eps(s.eps)
    w.add_rope_freq_base(s.rope_theta)
    w.add_expert_count(s.experts)
    w.add_expert_used_count(s.top_k)
    w.add_file_type(
        gguf.LlamaFileType.MOSTLY_Q8_0 if fmt == "q8_0" else gguf.LlamaFileType.MOSTLY_Q4_0
    )
    # A vocabulary llama.cpp accepts (SentencePiece-style, byte tokens present); the
    # bench feeds token ids, so the strings never matter.
    toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    toks += [f"t{i}" for i in range(len(toks), s.vocab)]
    types = [2, 3, 3] + [6] * 256 + [1] * (s.vocab - 259)
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores([0.0] * s.vocab)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)

    plan: list[tuple[str, object]] = []  # (gguf name, producer)
    plan.append(("token_embd.weight", lambda: values("model.embed_tokens.weight")))
    for i in range(s.layers):
        p = f"model.layers.{i}."
        b = f"blk.{i}."
        for gn, hn in (
            ("attn_norm", "input_layernorm"),
            ("attn_q", "self_attn.q_proj"),
            ("attn_k", "self_attn.k_proj"),
            ("attn_v", "self_attn.v_proj"),
            ("attn_output", "self_attn.o_proj"),
            ("attn_q_norm", "self_attn.q_norm"),
            ("attn_k_norm", "self_attn.k_norm"),
            ("ffn_norm", "post_attention_layernorm"),
            ("ffn_gate_inp", "mlp.gate"),
        ):
            plan.append((b + gn + ".weight", (lambda hn=hn, p=p: values(p + hn + ".weight"))))
        for gn, part in (
            ("ffn_gate_exps", "gate"),
            ("ffn_up_exps", "up"),
            ("ffn_down_exps", "down"),
        ):
            plan.append(
                (
                    b + gn + ".weight",
                    (
                        lambda part=part, p=p: np.stack(
                            [
                                values(f"{p}mlp.experts.{e}.{part}_proj.weight")
                                for e in range(s.experts)
                            ]
                        )
                    ),
                )
            )
    plan.append(("output_norm.weight", lambda: values("model.norm.weight")))
    plan.append(("output.weight", lambda: values("lm_head.weight")))

    def is_quant(gname: str, shape: tuple[int, ...]) -> bool:
        short = gname.split(".")[-2]
        return len(shape) >= 2 and short != "ffn_gate_inp"

    # tensor infos first (shapes only), then the data, one tensor at a time
    shapes = {}
    for gname, _ in plan:
        hn_shape = _gguf_shape(gname, s)
        shapes[gname] = hn_shape
        if is_quant(gname, hn_shape):
            bs, ts = gguf.GGML_QUANT_SIZES[qt]
            byte_shape = (*hn_shape[:-1], hn_shape[-1] // bs * ts)
            w.add_tensor_info(gname, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), qt)
        else:
            w.add_tensor_info(gname, hn_shape, np.dtype(np.float32), int(np.prod(hn_shape)) * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total = 0
    for gname, make in plan:
        arr = make()  # type: ignore[operator]
        if is_quant(gname, shapes[gname]):
            arr = gguf.quants.quantize(arr, qt)
        w.write_tensor_data(np.ascontiguousarray(arr))
        total += arr.nbytes
    w.close()
    os.replace(str(path) + ".part", path)
    return total


def _gguf_shape(gname: str, s: Shape) -> tuple[int, ...]:
    h, q, kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    short = gname.split(".")[-2]
    return {
        "token_embd": (s.vocab, h),
        "output": (s.vocab, h),
        "output_norm": (h,),
        "attn_norm": (h,),
        "ffn_norm": (h,),
        "attn_q": (q, h),
        "attn_k": (kv, h),
        "attn_v": (kv, h),
        "attn_output": (h, q),
        "attn_q_norm": (q,) if s.arch == "olmoe" else (s.head_dim,),
        "attn_k_norm": (kv,) if s.arch == "olmoe" else (s.head_dim,),
        "ffn_gate_inp": (s.experts, h),
        "ffn_gate_exps": (s.experts, s.inter, h),
        "ffn_up_exps": (s.experts, s.inter, h),
        "ffn_down_exps": (s.experts, h, s.inter),
    }[short]


# ------------------------------------------------------------------ tokens


def text_ids(text: bytes, vocab: int, n: int) -> list[int]:
    """``n`` token ids of ``text``: byte bigrams hashed into ``[3, vocab)`` (deterministic)."""
    ids = []
    for i in range(n):
        a, b = text[i % len(text)], text[(i + 1) % len(text)]
        ids.append(3 + (a * 257 + b) * 2654435761 % (vocab - 3))
    return ids


def routing_stats(trace_idx: np.ndarray, n_experts: int) -> dict[str, float]:
    """Routing statistics of ``[T, L, k]`` expert ids (one sequence).

    usage entropy: per layer, the entropy of the expert usage histogram over
    the text divided by ``log(n_experts)`` (1: every expert equally used),
    averaged over layers; lag-1 reuse: the fraction of a token's top-k that
    the previous token also chose, averaged; distinct/64: experts used per
    layer in each 64-token window, averaged (``n_experts`` at most).
    """
    t, n_l, k = trace_idx.shape
    ent, reuse, distinct = [], [], []
    for layer in range(n_l):
        sel = trace_idx[:, layer, :].astype(np.int64)
        counts = np.bincount(sel.ravel(), minlength=n_experts).astype(np.float64)
        p = counts / counts.sum()
        nz = p[p > 0]
        ent.append(float(-(nz * np.log(nz)).sum() / np.log(n_experts)))
        if t > 1:
            prev = np.zeros((t - 1, n_experts), bool)
            np.put_along_axis(prev, sel[:-1], True, axis=1)
            reuse.append(float(np.take_along_axis(prev, sel[1:], axis=1).mean()))
        for w0 in range(0, t - 63, 64):
            distinct.append(len(np.unique(sel[w0 : w0 + 64])))
    return {
        "entropy": float(np.mean(ent)),
        "lag1_reuse": float(np.mean(reuse)) if reuse else float("nan"),
        "distinct_per_64": float(np.mean(distinct)) if distinct else float("nan"),
        "chance_reuse": k / n_experts,
    }


def czyx_trace(store_dir: Path, tag: str, ids: list[int]) -> tuple[np.ndarray, int]:
    """``([T, L, k] routed experts, n_experts)`` of czyx prefilling ``ids`` (resident)."""
    from czyx.inference.engine import Engine
    from czyx.inference.opened import OpenedModel
    from czyx.inference.profile import RouteRecorder

    with OpenedModel(store_dir, tag, None) as model:
        eng = Engine(model.consumer, cache_fraction=1.0, stream=None)
        cfg = eng.cfg
        rec = RouteRecorder(cfg.sparse_layers, cfg.n_experts, cfg.top_k)
        rec.new_segment(len(ids))
        eng.model.recorder = rec
        for s0 in range(0, len(ids), 64):
            eng.prefill(ids[s0 : s0 + 64])
        tr = rec.trace("x", "0" * 64, "probs")
        eng.cache.close()
        return np.asarray(tr.experts), cfg.n_experts


# --------------------------------------------------------------------- cli


def _mount(source: Path, store_dir: Path, tag: str, policy: str | None) -> None:
    """Mount ``source`` (the HF checkpoint, or a GGUF file with ``policy`` None) as ``tag``."""
    from czyx.store import Store
    from czyx.store.models.mount import mount
    from czyx.store.quant.codec import QuantCodec
    from czyx.store.quant.policy import parse_policy

    with Store.open(store_dir) as store:
        codec = None if policy in (None, "none") else QuantCodec(parse_policy(policy))
        t0 = time.perf_counter()
        res = mount(store, source, tag, quant=codec)
        print(f"  {res.summary()} ({time.perf_counter() - t0:.1f} s)", flush=True)


#: czyx policies matching llama.cpp's q8_0 / q4_0 files (matrices quantized, routers float)
CZYX_POLICY = {
    "q8": "q4-all,expert=q8,attention=q8,shared_expert=q8,dense_mlp=q8,embed=q8,lm_head=q8,"
    "router=f32",
    "q4": "q4-all,router=f32",
    "bf16": "none",
}
#: the GGUF file a czyx version is mounted from under ``--no-hf`` (native, lossless)
GGUF_OF = {"q8": "q8_0", "q4": "q4_0"}


def cmd_gen(a: argparse.Namespace) -> None:
    s = make_shape(a.shape or a.full, a.scale)
    out = Path(a.out)
    if a.no_hf:
        missing = [q for q in a.czyx if GGUF_OF.get(q) not in a.gguf]
        if missing:
            raise SystemExit(
                f"--no-hf mounts each czyx version from its GGUF file: --czyx {' '.join(missing)} "
                f"needs --gguf {' '.join(GGUF_OF.get(q, '?') for q in missing)}"
            )
    out.mkdir(parents=True, exist_ok=True)
    meta = {**asdict(s), "seed": a.seed, "mix": a.mix, "source": "gguf" if a.no_hf else "hf"}
    meta["name"] = a.shape or ("qwen3" if a.full else "olmoe")
    (out / "shape.json").write_text(json.dumps(meta))
    print(
        f"{s.arch} shape: {s.layers} layers x {s.experts} experts (top-{s.top_k}), hidden "
        f"{s.hidden}, expert inter {s.inter}, vocab {s.vocab}: "
        f"{(s.expert_params + s.trunk_params) / 1e9:.2f} B params",
        flush=True,
    )
    t0 = time.perf_counter()
    ck = None
    if a.no_hf:
        values = generated(s, a.seed, a.mix)
    else:
        from czyx.store.models.checkpoint import Checkpoint, to_float32

        if not (out / "hf" / "config.json").exists():
            nb = write_hf(out / "hf", s, a.seed, a.mix)
            print(f"hf: {nb / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s", flush=True)
        ck = Checkpoint(out / "hf")

        def values(name: str) -> np.ndarray:
            return to_float32(ck.array(name), "BF16")

    for fmt in a.gguf:
        path = out / "gguf" / f"model-{fmt}.gguf"
        if path.exists():
            continue
        path.parent.mkdir(exist_ok=True)
        t1 = time.perf_counter()
        nb = write_gguf(values, path, s, fmt)
        print(f"gguf {fmt}: {nb / 1e9:.2f} GB in {time.perf_counter() - t1:.0f} s", flush=True)
    if ck is not None:
        ck.close()
    for q in a.czyx:
        if a.no_hf:
            _mount(out / "gguf" / f"model-{GGUF_OF[q]}.gguf", out / "store", f"rs@{q}", None)
        else:
            _mount(out / "hf", out / "store", f"rs@{q}", CZYX_POLICY[q])
    if a.stats:
        cmd_stats(
            argparse.Namespace(
                out=a.out, tag=f"rs@{a.czyx[0]}", text=str(DEFAULT_TEXT), tokens=256, json=None
            )
        )


def cmd_check(a: argparse.Namespace) -> None:
    """Greedy tokens of both engines on the same weights, per format pair."""
    import subprocess

    out = Path(a.out)
    vocab = json.loads((out / "shape.json").read_text())["vocab"]
    common = [
        "--vocab",
        str(vocab),
        "--text",
        str(DEFAULT_TEXT),
        "--prompt",
        str(a.prompt),
        "--tokens",
        str(a.tokens),
        "--greedy",
        "--threads",
        "2",
    ]
    run = [sys.executable, str(Path(__file__).parent / "_rs_run.py")]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    for cz, gg in (("q8", "q8_0"), ("q4", "q4_0")):
        gpath = out / "gguf" / f"model-{gg}.gguf"
        if not gpath.exists():
            continue
        subprocess.run(
            [
                *run,
                "--engine",
                "llama",
                "--model",
                str(gpath),
                *common,
                "--json",
                "/tmp/rs-check-l.json",
                "--logits",
                "/tmp/rs-check-l.npy",
            ],
            check=True,
            env=env,
        )
        subprocess.run(
            [
                *run,
                "--engine",
                "czyx",
                "--store",
                str(out / "store"),
                "--tag",
                f"rs@{cz}",
                "--io",
                "pread",
                *common,
                "--json",
                "/tmp/rs-check-c.json",
                "--logits",
                "/tmp/rs-check-c.npy",
            ],
            check=True,
            env=env,
        )
        tl = json.loads(Path("/tmp/rs-check-l.json").read_text())["tokens"]
        tc = json.loads(Path("/tmp/rs-check-c.json").read_text())["tokens"]
        same = next((i for i, (x, y) in enumerate(zip(tl, tc)) if x != y), len(tl))
        print(f"czyx {cz} vs llama.cpp {gg}: {same}/{len(tl)} greedy tokens identical")
        # Greedy tokens of a random model part at near-ties; the prompt's logits say
        # whether the engines compute the same function or merely round differently.
        lg, cg = (np.load(f"/tmp/rs-check-{e}.npy").astype(np.float64) for e in "lc")
        top = np.sort(lg)[::-1]
        print(
            f"  prompt logits: correlation {np.corrcoef(lg, cg)[0, 1]:.5f}, max abs diff "
            f"{np.abs(lg - cg).max():.3f} (std {lg.std():.3f}); llama.cpp's top-2 margin "
            f"{top[0] - top[1]:.3f}"
        )
        print(f"  llama.cpp {tl}\n  czyx      {tc}")


def cmd_remix(a: argparse.Namespace) -> None:
    """Rewrite the attention output projections in place for another ``--mix``."""
    out = Path(a.out)
    meta = json.loads((out / "shape.json").read_text())
    if meta.get("source", "hf") != "hf":
        raise SystemExit(f"{out} was generated with --no-hf: there is no checkpoint to remix")
    s = Shape(**{k: meta[k] for k in asdict(OLMOE)})
    index = json.loads((out / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    for name, shape, kind in hf_tensors(s):
        if kind != "attn_out":
            continue
        path = out / "hf" / index[name]
        with open(path, "r+b") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            head = json.loads(fh.read(n))
            start = 8 + n + head[name]["data_offsets"][0]
            fh.seek(start)
            fh.write(to_bf16(generate(name, shape, kind, meta["seed"], a.mix)).tobytes())
    meta["mix"] = a.mix
    (out / "shape.json").write_text(json.dumps(meta))
    print(f"mix set to {a.mix}")


def stats_rows(out: Path, tag: str, text_path: Path, n: int) -> list[tuple[str, dict]]:
    """Routing statistics of the bundled model and of ``tag`` on the same text."""
    import tempfile

    from czyx.store import Store
    from czyx.store.models.mount import mount

    text = text_path.read_bytes()
    shape = json.loads((out / "shape.json").read_text())
    rows = []
    with tempfile.TemporaryDirectory() as td:
        with Store.open(Path(td) / "s") as st:
            mount(st, BUNDLED, "bundled@f")
        tr, ne = czyx_trace(Path(td) / "s", "bundled@f", list(text[:n]))
        rows.append(("bundled czyx-moe-stdlib (trained, 16 experts top-2)", routing_stats(tr, ne)))
    tr, ne = czyx_trace(out / "store", tag, text_ids(text, shape["vocab"], n))
    name = f"realshape {shape['arch']}, {shape['layers']} layers, mix {shape['mix']} ({tag})"
    rows.append((name, routing_stats(tr, ne)))
    return rows


def stats_table(rows: list[tuple[str, dict]]) -> list[str]:
    """The rows as a markdown table."""
    out = [
        "| model | usage entropy | lag-1 reuse | chance (k/E) | distinct experts / 64 tokens |",
        "|---|---|---|---|---|",
    ]
    for name, st_ in rows:
        out.append(
            f"| {name} | {st_['entropy']:.3f} | {st_['lag1_reuse']:.3f} | "
            f"{st_['chance_reuse']:.3f} | {st_['distinct_per_64']:.1f} |"
        )
    return out


def cmd_stats(a: argparse.Namespace) -> None:
    rows = stats_rows(Path(a.out), a.tag, Path(a.text), a.tokens)
    print(f"routing statistics, {a.tokens} tokens of {a.text}")
    print("\n".join(stats_table(rows)))
    if a.json:
        Path(a.json).write_text(json.dumps(rows))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gen", help="write the checkpoint, GGUF files and czyx versions")
    g.add_argument("--out", required=True)
    g.add_argument("--full", action="store_true", help="Qwen3-30B-A3B's shape")
    g.add_argument("--shape", choices=sorted(SHAPES), default=None, help="a named shape")
    g.add_argument("--scale", type=float, default=1.0, help="fraction of the layers kept")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--mix", type=float, default=8.0, help="attention output vs embedding")
    g.add_argument("--gguf", nargs="*", default=list(GGUF_FORMATS), choices=GGUF_FORMATS)
    g.add_argument("--czyx", nargs="*", default=["q8", "q4"], choices=sorted(CZYX_POLICY))
    g.add_argument(
        "--no-hf",
        action="store_true",
        help="no HF checkpoint: GGUF files straight from the generator, czyx mounts them",
    )
    g.add_argument("--stats", action="store_true", help="print routing statistics after")
    g.set_defaults(fn=cmd_gen)
    c = sub.add_parser("check", help="greedy tokens of both engines, per format pair")
    c.add_argument("--out", required=True)
    c.add_argument("--prompt", type=int, default=32)
    c.add_argument("--tokens", type=int, default=16)
    c.set_defaults(fn=cmd_check)
    r = sub.add_parser("remix", help="rewrite the attention outputs for another --mix")
    r.add_argument("--out", required=True)
    r.add_argument("--mix", type=float, required=True)
    r.set_defaults(fn=cmd_remix)
    s = sub.add_parser("stats", help="routing statistics beside the bundled model's")
    s.add_argument("--out", required=True)
    s.add_argument("--tag", default="rs@q8")
    s.add_argument("--text", default=str(DEFAULT_TEXT))
    s.add_argument("--tokens", type=int, default=256)
    s.add_argument("--json", default=None)
    s.set_defaults(fn=cmd_stats)
    a = ap.parse_args(argv)
    a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
