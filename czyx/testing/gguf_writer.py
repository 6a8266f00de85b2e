"""Write a transformers MoE model as GGUF the way llama.cpp's ``convert_hf_to_gguf.py`` does.

Tests only. Independent of the store's GGUF reader (its own name table, so a
mistake in one is not mirrored by the other): the converter's layout for the
architectures czyx runs, written with the ``gguf`` package's ``GGUFWriter``:

* Mixtral as llama.cpp's ``llama`` arch with q/k rows permuted to its rope
  order (``LlamaModel.permute``); Qwen2-MoE ``qwen2moe``, Qwen3-MoE
  ``qwen3moe``, OLMoE ``olmoe``, PhiMoE ``phimoe`` (``PhiMoeModel``: its
  LayerNorm, attention and head biases kept) unpermuted (NEOX rope);
* DeepSeek-V3 / Kimi-K2 / DeepSeek-V2 as ``deepseek2`` (``DeepseekV2Model``):
  latent attention as MQA of one head, ``kv_b_proj`` split into ``attn_k_b`` /
  ``attn_v_b``, ``exp_probs_b.bias``, shared experts ``ffn_*_shexp``,
  multi-token-prediction layers dropped;
* routed experts stacked per layer as ``ffn_{gate,up,down}_exps [E, I, H]``;
* a Llama 4 with llama3 rope scaling gets ``rope_freqs.weight`` first, as
  ``LlamaModel.generate_extra_tensors`` computes it (torch, its loop);
* 1-D tensors and the routers (``ffn_gate_inp``) kept F32, as the converter
  forces; other matrices in ``qtype`` (``f32``, ``f16``, ``bf16``, ``q8_0``,
  and, as ``llama-quantize`` would produce them, ``q4_0``/``q4_1``), a matrix
  whose row length is not a multiple of the block size falling back to F16;
* the hyper-parameters as the converter's ``set_gguf_parameters`` writes them
  and, given a byte-level BPE ``tokenizer.json``, its ``_set_vocab_gpt2``
  vocabulary (ids without a token padded as ``[PADn]``, UNUSED).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

_ARCH = {
    "mixtral": "llama",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "olmoe": "olmoe",
    "deepseek_v2": "deepseek2",
    "deepseek_v3": "deepseek2",
    "phimoe": "phimoe",
    "llama4_text": "llama4",
    "qwen3_next": "qwen3next",
    "jamba": "jamba",
}
_MAP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.norm.bias": "output_norm.bias",
    "lm_head.bias": "output.bias",
}
_LAYER = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "ffn_norm",
    "self_attn.q_proj.weight": "attn_q",
    "self_attn.k_proj.weight": "attn_k",
    "self_attn.v_proj.weight": "attn_v",
    "self_attn.o_proj.weight": "attn_output",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "input_layernorm.bias": "attn_norm.bias",
    "post_attention_layernorm.bias": "ffn_norm.bias",
    "mlp.router.weight": "ffn_gate_inp",
    "self_attn.q_norm.weight": "attn_q_norm",
    "self_attn.k_norm.weight": "attn_k_norm",
    "mlp.gate.weight": "ffn_gate_inp",
    "block_sparse_moe.gate.weight": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp",
    "mlp.gate_proj.weight": "ffn_gate",
    "mlp.up_proj.weight": "ffn_up",
    "mlp.down_proj.weight": "ffn_down",
}
# DeepseekV2Model's names (gguf.MODEL_ARCH.DEEPSEEK2's tensor table); kv_b_proj is split.
_MLA = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "ffn_norm",
    "self_attn.q_proj.weight": "attn_q",
    "self_attn.q_a_proj.weight": "attn_q_a",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm",
    "self_attn.q_b_proj.weight": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm",
    "self_attn.o_proj.weight": "attn_output",
    "mlp.gate.weight": "ffn_gate_inp",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp",
    "mlp.gate_proj.weight": "ffn_gate",
    "mlp.up_proj.weight": "ffn_up",
    "mlp.down_proj.weight": "ffn_down",
}


_PACKAGE_NAMED = ("llama4", "qwen3next", "jamba")


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.LlamaModel.permute."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _gguf_package_state(model: Any, arch: str) -> dict[str, np.ndarray]:
    """The converter's tensors of the architectures it names with the ``gguf`` package's
    own ``TensorNameMap`` (Llama 4, Qwen3-Next, Jamba), so this writer shares no name
    table with czyx.

    The stacked experts are HF's ``gate_up_proj [E, 2I, H]`` (Llama 4: transposed,
    ``[E, H, 2I]``, gate the first half of the last axis) and ``down_proj [E, H, I]``
    (Llama 4 ``[E, I, H]``), written as llama.cpp's ``[E, I, H]`` / ``[E, H, I]`` stacks.
    Llama 4's q/k rows as they are (``undo_permute = False``); Qwen3-Next and Jamba
    through :func:`_hybrid_tensors` first.
    """
    import gguf

    cfg = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    transposed = arch == "llama4"
    out: dict[str, np.ndarray] = {}
    for name, t in model.state_dict().items():
        a = t.detach().float().numpy()
        if name.endswith(".experts.gate_up_proj"):
            gate_up = a.swapaxes(1, 2) if transposed else a
            half = gate_up.shape[1] // 2
            stem = name.removesuffix(".gate_up_proj")
            out[names[f"{stem}.gate_proj"] + ".weight"] = gate_up[:, :half]
            out[names[f"{stem}.up_proj"] + ".weight"] = gate_up[:, half:]
        elif name.endswith(".experts.down_proj"):
            out[names[name] + ".weight"] = a.swapaxes(1, 2) if transposed else a
        else:
            for new, b in _hybrid_tensors(cfg, arch, name, t.detach().float()):
                mapped = new if new.startswith("blk.") else _mapped(names, arch, new)
                if mapped.endswith("ffn_gate_inp_shexp.weight"):
                    b = b.reshape(-1)  # ([1, H] in HF: llama.cpp's files hold it 1-D)
                if arch == "jamba" and "ssm_conv1d" in mapped:
                    b = b.squeeze()  # JambaModel: squeezes what maps to SSM_CONV1D
                out[mapped] = b.numpy()
    return out


def _mapped(names: Any, arch: str, name: str) -> str:
    mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
    if mapped is None:
        raise KeyError(f"the gguf package maps no {arch} tensor {name}")
    return mapped


def _hybrid_tensors(cfg: Any, arch: str, name: str, t: Any) -> list[tuple[str, Any]]:
    """``(name, tensor)`` pairs the converter makes of HF tensor ``name`` before naming it.

    Qwen3-Next (``Qwen3NextModel.modify_tensors``): ``A_log`` as ``-exp(A_log)``,
    ``dt_bias`` renamed ``dt_proj.bias``, ``conv1d`` squeezed, every ``*norm.weight`` but
    ``linear_attn.norm`` as ``w + 1``, and ``in_proj_qkvz`` split into ``attn_qkv`` (every
    key head's q, then k, then v) and ``attn_gate`` (z), named here. Jamba
    (``JambaModel.modify_tensors``): ``A_log`` as ``-exp(A_log)`` (its squeeze is by GGUF
    name, in :func:`_gguf_package_state`). Llama 4: unchanged.
    """
    import gguf
    import torch

    if arch not in ("qwen3next", "jamba"):
        return [(name, t)]
    if name.endswith(".A_log"):
        return [(name, -torch.exp(t))]
    if arch == "jamba":
        return [(name, t)]
    if name.endswith(".dt_bias"):
        return [(name.rpartition(".dt_bias")[0] + ".dt_proj.bias", t)]
    if "conv1d" in name:
        return [(name, t.squeeze())]
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return [(name, t + 1)]
    if "in_proj_qkvz.weight" not in name:
        return [(name, t)]
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    split = [dk, dk, nv // nk * dv, nv // nk * dv]
    q, k, v, z = torch.split(t.permute(1, 0).reshape(-1, nk, sum(split)), split, dim=-1)
    hidden = cfg.hidden_size
    qkv = torch.cat([x.reshape(hidden, -1) for x in (q, k, v)], dim=-1).permute(1, 0)
    bid = int(name.split(".")[2])
    fmt = gguf.TENSOR_NAMES
    return [
        (fmt[gguf.MODEL_TENSOR.ATTN_QKV].format(bid=bid) + ".weight", qkv.contiguous()),
        (fmt[gguf.MODEL_TENSOR.ATTN_GATE].format(bid=bid) + ".weight",
         z.reshape(hidden, -1).permute(1, 0).contiguous()),
    ]  # fmt: skip


def _state(model: Any) -> dict[str, np.ndarray]:
    """Per-layer experts stacked as [E, I, H] gate/up and [E, H, I] down, other tensors f32.

    DeepSeek (``deepseek2``): ``kv_b_proj`` split per head into ``attn_k_b`` (the
    no-rope key rows, transposed: ``[n_head, kv_lora_rank, qk_nope]``) and
    ``attn_v_b`` (``[n_head, v_head_dim, kv_lora_rank]``), as the converter does for
    llama.cpp's absorbed MLA; the multi-token-prediction layers are dropped.
    """
    cfg = model.config
    if _ARCH[cfg.model_type] in _PACKAGE_NAMED:
        return _gguf_package_state(model, _ARCH[cfg.model_type])
    mla = _ARCH[cfg.model_type] == "deepseek2"
    table = _MLA if mla else _LAYER
    out: dict[str, np.ndarray] = {}
    per_expert: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, t in model.state_dict().items():
        a = t.detach().float().numpy()
        parts = name.split(".")
        if ".experts.gate_up_proj" in name:
            layer, half = int(parts[2]), a.shape[1] // 2
            out[f"blk.{layer}.ffn_gate_exps.weight"] = a[:, :half]
            out[f"blk.{layer}.ffn_up_exps.weight"] = a[:, half:]
        elif ".experts.down_proj" in name and name.endswith("down_proj"):
            out[f"blk.{parts[2]}.ffn_down_exps.weight"] = a
        elif ".experts." in name:
            layer, e, kind = int(parts[2]), int(parts[5]), parts[6]
            stack = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up"}.get(
                kind, "down"
            )
            per_expert.setdefault((layer, stack), {})[e] = a
        elif name in _MAP:
            out[_MAP[name]] = a
        elif mla and name.endswith("kv_b_proj.weight"):
            heads, nope = cfg.num_attention_heads, cfg.qk_nope_head_dim
            kv_b = a.reshape(heads, -1, a.shape[-1])
            out[f"blk.{parts[2]}.attn_k_b.weight"] = kv_b[:, :nope].transpose(0, 2, 1)
            out[f"blk.{parts[2]}.attn_v_b.weight"] = kv_b[:, nope:]
        elif mla and int(parts[2]) >= cfg.num_hidden_layers:
            continue  # DeepseekV2Model.skip_mtp
        else:
            rest = ".".join(parts[3:])
            key = table[rest]
            out[f"blk.{parts[2]}.{key}" + ("" if key.endswith(".bias") else ".weight")] = a
    for (layer, stack), experts in per_expert.items():
        out[f"blk.{layer}.ffn_{stack}_exps.weight"] = np.stack(
            [experts[e] for e in sorted(experts)]
        )
    return out


def _vocab(writer: Any, tokenizer_json: str, n_vocab: int, pre: str = "gpt-2") -> None:
    import gguf

    data = json.loads(tokenizer_json)
    vocab = dict(data["model"]["vocab"])
    added = {a["content"]: a for a in data.get("added_tokens") or []}
    for a in added.values():
        vocab[a["content"]] = a["id"]
    by_id = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(n_vocab):
        t = by_id.get(i)
        if t is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif t in added:
            tokens.append(t)
            types.append(
                gguf.TokenType.CONTROL if added[t].get("special") else gguf.TokenType.USER_DEFINED
            )
        else:
            tokens.append(t)
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    merges = data["model"].get("merges") or []
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])


def _qtype(qtype: str) -> Any:
    import gguf

    q = gguf.GGMLQuantizationType
    return {
        "f32": q.F32,
        "f16": q.F16,
        "bf16": q.BF16,
        "q8_0": q.Q8_0,
        "q4_0": q.Q4_0,
        "q4_1": q.Q4_1,
        "q5_0": q.Q5_0,
        "mxfp4": q.MXFP4,
    }[qtype]


def _tensor_type(name: str, a: np.ndarray, qt: Any) -> Any:
    """The converter's choice: 1-D and routers F32; a row length off the block size F16."""
    import gguf

    q = gguf.GGMLQuantizationType
    # routers: GGUF ffn_gate_inp(_shexp), HF *.gate.weight / shared_expert_gate.weight /
    # *.router.weight (a dense layer's ffn_gate / mlp.gate_proj is an ordinary matrix)
    router = name.endswith((".gate.weight", "shared_expert_gate.weight", ".router.weight"))
    if a.ndim == 1 or "ffn_gate_inp" in name or router:
        return q.F32
    # forced F32 too: conv1d, and names without .weight (Jamba's 2-D A_log / ssm_a)
    if "conv1d" in name or name.endswith((".A_log", ".ssm_a")):
        return q.F32
    if qt not in (q.F32, q.F16, q.BF16) and a.shape[-1] % 32:
        return q.F16
    return qt


def reference_model(model: Any, qtype: str) -> Any:
    """A copy of ``model`` whose weights are what the GGUF of ``qtype`` holds, dequantized
    by the ``gguf`` package (the source's own dequantized reference)."""
    import copy

    import gguf
    import torch

    ref = copy.deepcopy(model)
    qt = _qtype(qtype)

    def held(name: str, a: np.ndarray) -> np.ndarray:
        t = _tensor_type(name, a, qt)
        if t == gguf.GGMLQuantizationType.F32:
            return a
        if t == gguf.GGMLQuantizationType.F16:
            return a.astype(np.float16).astype(np.float32)
        return gguf.quants.dequantize(gguf.quants.quantize(a, t), t)

    mla = _ARCH[model.config.model_type] == "deepseek2"
    transposed = _ARCH[model.config.model_type] == "llama4"  # HF's experts [E, H, 2I], [E, I, H]
    with torch.no_grad():
        for name, p in ref.state_dict().items():
            a = p.detach().float().numpy()
            if transposed and name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                back = held(name, a.swapaxes(1, 2).copy()).swapaxes(1, 2)  # ([E, H, .] stacks)
            elif mla and name.endswith("kv_b_proj.weight"):  # held as its two halves
                heads, nope = model.config.num_attention_heads, model.config.qk_nope_head_dim
                kv_b = a.reshape(heads, -1, a.shape[-1])
                k_b = held("attn_k_b.weight", np.ascontiguousarray(kv_b[:, :nope].swapaxes(1, 2)))
                v_b = held("attn_v_b.weight", np.ascontiguousarray(kv_b[:, nope:]))
                back = np.concatenate(
                    [
                        k_b.reshape(heads, a.shape[-1], nope).swapaxes(1, 2),
                        v_b.reshape(heads, -1, a.shape[-1]),
                    ],
                    axis=1,
                )
            else:
                back = held(name, a)
            p.copy_(torch.from_numpy(np.ascontiguousarray(back, np.float32)).reshape(p.shape))
    return ref


def write_gguf(
    model: Any,
    path: str | os.PathLike[str],
    qtype: str = "f32",
    *,
    tokenizer_json: str | None = None,
    spm_vocab: dict[str, Any] | None = None,
    chat_template: str | None = None,
    split_max_tensors: int = 0,
    pre: str = "gpt-2",
) -> list[Path]:
    """Write ``model`` (a transformers MoE ``*ForCausalLM``) as GGUF at ``path``.

    ``split_max_tensors > 0`` writes ``-0000N-of-0000M.gguf`` splits as
    ``gguf-split`` does; ``pre`` is the ``tokenizer.ggml.pre`` the converter's
    hash of ``tokenizer_json``'s pre-tokenizer would give. Returns the files written.
    """
    import gguf

    cfg = model.config
    arch = _ARCH[cfg.model_type]
    qt = _qtype(qtype)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    if arch == "deepseek2":
        _deepseek_parameters(writer, cfg)
    elif arch == "jamba":
        _jamba_parameters(writer, cfg)
    else:
        _parameters(writer, cfg, arch)
    writer.add_file_type(
        {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7, "q4_0": 2, "q4_1": 3, "q5_0": 8, "mxfp4": 38}[
            qtype
        ]
    )
    if tokenizer_json is not None:
        _vocab(writer, tokenizer_json, cfg.vocab_size, pre)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    if spm_vocab is not None:  # as _set_vocab_sentencepiece writes it
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(spm_vocab["tokens"])
        writer.add_token_scores(spm_vocab["scores"])
        writer.add_token_types(spm_vocab["types"])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_space_prefix(True)
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    state = _state(model)
    if arch == "llama4" and (cfg.rope_parameters or {}).get("rope_type") == "llama3":
        state = {"rope_freqs.weight": _converter_rope_freqs(cfg.to_dict()), **state}
    for name, a in state.items():
        if arch == "llama" and name.endswith("attn_q.weight"):
            a = _permute(a, heads)
        elif arch == "llama" and name.endswith("attn_k.weight"):
            a = _permute(a, kv)
        a = np.ascontiguousarray(a, np.float32)
        t = _tensor_type(name, a, qt)
        if t == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, a)
        elif t == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, a.astype(np.float16))
        else:
            data = gguf.quants.quantize(a, t)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if split_max_tensors:
        return sorted(path.parent.glob(path.stem + "-*-of-*.gguf"))
    return [path]


def _converter_rope_freqs(hparams: dict[str, Any]) -> np.ndarray:
    """``LlamaModel.generate_extra_tensors``' llama3 factors, step by step as it computes
    them (0-d float32 torch tensors; ``original_max_position_embeddings`` read at the top
    level only, 8192 without it)."""
    import math

    import torch

    rope = hparams.get("rope_parameters") or hparams.get("rope_scaling") or {}
    base = rope.get("rope_theta", 10000.0)
    dim = hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low_freq_factor = rope.get("low_freq_factor", 1.0)
    high_freq_factor = rope.get("high_freq_factor", 4.0)
    old_context_len = hparams.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    rope_factors: list[Any] = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(rope_factors, dtype=torch.float32).numpy()


def _parameters(writer: Any, cfg: Any, arch: str) -> None:
    """The hyper-parameters of the non-DeepSeek architectures (``set_gguf_parameters``)."""
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads
    kv = cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(hidden)
    llama4 = arch == "llama4"  # (Llama4Model swaps intermediate_size and _mlp)
    writer.add_feed_forward_length(cfg.intermediate_size_mlp if llama4 else cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    rope = getattr(cfg, "rope_theta", None) or (cfg.rope_parameters or {}).get("rope_theta")
    writer.add_rope_freq_base(float(rope))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    n_experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    writer.add_expert_count(n_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if arch != "phimoe":  # Phi3MiniModel.set_gguf_parameters writes no key/value length
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    params = getattr(cfg, "rope_parameters", None) or {}
    partial = params.get("partial_rotary_factor") or getattr(cfg, "partial_rotary_factor", 0.25)
    # (Qwen3NextModel: the partial rope width)
    writer.add_rope_dimension_count(int(head_dim * partial) if arch == "qwen3next" else head_dim)
    if arch == "phimoe":
        writer.add_sliding_window(cfg.sliding_window or 0)
    if arch in ("qwen2moe", "qwen3moe", "qwen3next"):
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch in ("qwen2moe", "qwen3next"):
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch == "qwen3next":  # Qwen3NextModel.set_gguf_parameters
        writer.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
        writer.add_ssm_state_size(cfg.linear_key_head_dim)
        writer.add_ssm_group_count(cfg.linear_num_key_heads)
        writer.add_ssm_time_step_rank(cfg.linear_num_value_heads)
        writer.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
        # (read from config.json, where transformers' save keeps no such key: 4)
        writer.add_full_attention_interval(getattr(cfg, "full_attention_interval", 4))
    if arch == "olmoe" and getattr(cfg, "clip_qkv", None) is not None:
        writer.add_clamp_kqv(float(cfg.clip_qkv))
    if arch in ("llama", "llama4"):
        writer.add_vocab_size(cfg.vocab_size)
    if llama4:  # Llama4Model.set_gguf_parameters
        writer.add_interleave_moe_layer_step(cfg.interleave_moe_layer_step)
        writer.add_expert_feed_forward_length(cfg.intermediate_size)
        if all(t == "full_attention" for t in getattr(cfg, "layer_types", None) or ["x"]):
            writer.add_sliding_window(0)  # every layer full attention: llama.cpp's no-SWA


def _jamba_parameters(writer: Any, cfg: Any) -> None:
    """``JambaModel.set_gguf_parameters``: KV heads per layer (0 on Mamba layers)."""
    hidden, n = cfg.hidden_size, cfg.num_hidden_layers
    offset, period = cfg.attn_layer_offset, cfg.attn_layer_period
    kv = [0] * offset + [
        cfg.num_key_value_heads if (i - offset) % period == 0 else 0 for i in range(offset, n)
    ]
    writer.add_block_count(n)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(kv)
    writer.add_ssm_conv_kernel(cfg.mamba_d_conv or 4)
    writer.add_ssm_inner_size(cfg.mamba_expand * hidden)
    writer.add_ssm_state_size(cfg.mamba_d_state or 16)
    writer.add_ssm_time_step_rank(cfg.mamba_dt_rank or -(hidden // -16))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps or 1e-6)
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)


def _deepseek_parameters(writer: Any, cfg: Any) -> None:
    """``DeepseekV2Model.set_gguf_parameters`` (after ``TextModel``'s): MLA written as
    MQA of one latent head, the per-head widths under ``*_mla``.

    The gating function is what the published ``config.json`` names in
    ``scoring_func`` (DeepSeek-V3 and Kimi-K2 ``sigmoid``, V2 ``softmax``): transformers'
    configs do not keep that key, their classes imply it.
    """
    import gguf

    rope = cfg.rope_theta if hasattr(cfg, "rope_theta") else None
    rope = rope or (cfg.rope_parameters or {}).get("rope_theta")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(1)
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    yarn = params.get("rope_type") == "yarn"
    if yarn:  # TextModel.set_gguf_parameters
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(params["factor"])
        writer.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
        if params.get("beta_fast") is not None:
            writer.add_rope_scaling_yarn_beta_fast(params["beta_fast"])
        if params.get("beta_slow") is not None:
            writer.add_rope_scaling_yarn_beta_slow(params["beta_slow"])
    writer.add_rope_freq_base(float(rope))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_expert_count(cfg.n_routed_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if cfg.n_group is not None:
        writer.add_expert_group_count(cfg.n_group)
    if cfg.topk_group is not None:
        writer.add_expert_group_used_count(cfg.topk_group)
    sigmoid = cfg.model_type == "deepseek_v3"
    g = gguf.ExpertGatingFuncType
    writer.add_expert_gating_func(g.SIGMOID if sigmoid else g.SOFTMAX)
    writer.add_leading_dense_block_count(cfg.first_k_dense_replace)
    writer.add_vocab_size(cfg.vocab_size)
    if cfg.q_lora_rank is not None:
        writer.add_q_lora_rank(cfg.q_lora_rank)
    writer.add_kv_lora_rank(cfg.kv_lora_rank)
    writer.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    writer.add_value_length(cfg.kv_lora_rank)
    writer.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    writer.add_value_length_mla(cfg.v_head_dim)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_shared_count(cfg.n_shared_experts or 0)
    if cfg.routed_scaling_factor is not None:
        writer.add_expert_weights_scale(cfg.routed_scaling_factor)
    if getattr(cfg, "norm_topk_prob", False):
        writer.add_expert_weights_norm(True)
    writer.add_rope_dimension_count(cfg.qk_rope_head_dim)
    if yarn and params.get("mscale_all_dim") is not None:
        writer.add_rope_scaling_yarn_log_mul(0.1 * params["mscale_all_dim"])


def same_tensors(
    src: str | os.PathLike[str], out: str | os.PathLike[str], ulp: tuple[str, ...] = ()
) -> set[str]:
    """Assert two GGUF files hold the same tensors, each of the same type and bytes.

    ``ulp``: name endings of F32 tensors allowed to differ by one unit in the last place
    (a transcendental function's rounding: torch's float32 exp is not correctly rounded).

    Returns
    -------
    set of str
        Their tensor names.
    """
    import gguf

    a = {t.name: t for t in gguf.GGUFReader(src).tensors}
    b = {t.name: t for t in gguf.GGUFReader(out).tensors}
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    for name, t in a.items():
        assert b[name].tensor_type == t.tensor_type, name
        x, y = np.asarray(t.data), np.asarray(b[name].data)
        if name.endswith(ulp) and t.tensor_type == gguf.GGMLQuantizationType.F32:
            steps = np.abs(x.view(np.int32).astype(np.int64) - y.view(np.int32))
            assert x.shape == y.shape and steps.max(initial=0) <= 1, name
        else:
            assert np.array_equal(y, x), name
    return set(b)


def tiny_bpe_tokenizer_json(vocab: int) -> str:
    """A byte-level BPE ``tokenizer.json`` of at most ``vocab`` tokens (llama.cpp needs one)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab - 8,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = ["the quick brown fox jumps over the lazy dog. " * 3, "mixture of experts, 42 tokens!"]
    tok.train_from_iterator(text * 20, trainer)
    return tok.to_str()


def tiny_spm_vocab(vocab: int) -> dict[str, Any]:
    """A sentencepiece-BPE vocabulary as llama.cpp's ``llama`` tokenizer reads it:
    ``<unk>``, ``<s>``, ``</s>``, the 256 ``<0xXX>`` byte tokens, then pieces
    learned by ``tokenizers``' SentencePieceBPE with score ``-id`` (earlier merges
    rank higher), padded to ``vocab`` with UNUSED ``[PADn]``."""
    import gguf
    from tokenizers.implementations import SentencePieceBPETokenizer

    sp = SentencePieceBPETokenizer()
    text = ["the quick brown fox jumps over the lazy dog. " * 3, "mixture of experts, 42 tokens!"]
    sp.train_from_iterator(text * 20, vocab_size=vocab - 259 - 8, show_progress=False)
    learned = sorted(sp.get_vocab().items(), key=lambda kv: kv[1])
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256
    scores = [0.0] * len(tokens)
    for piece, i in learned:
        if piece in tokens:
            continue
        tokens.append(piece)
        types.append(gguf.TokenType.NORMAL)
        scores.append(-float(i))
    while len(tokens) < vocab:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(gguf.TokenType.UNUSED)
        scores.append(-1e9)
    return {"tokens": tokens, "scores": scores, "types": types}
