"""What a GGUF file means to the store: llama.cpp's names, metadata and quant types.

Scope: pure knowledge, no file I/O. For each architecture czyx runs (Mixtral,
which llama.cpp converts as ``llama``; Qwen2-MoE ``qwen2moe``; Qwen3-MoE
``qwen3moe``; OLMoE ``olmoe``; PhiMoE ``phimoe``, with its LayerNorm,
attention and head biases; DeepSeek-V3, Kimi-K2 and DeepSeek-V2 ``deepseek2``,
told apart by ``expert_gating_func``, sigmoid or softmax, :func:`resolve_arch`;
Llama 4 text ``llama4``, whose chunked attention, NoPE layers and temperature
llama.cpp fixes in code, :data:`LLAMA4_CHUNK`; the hybrids Qwen3-Next ``qwen3next``
and Jamba ``jamba``, whose converter transforms are described at ``_QWEN3NEXT_LAYER``):

* the map between llama.cpp tensor names (``blk.N.attn_q.weight``,
  stacked experts ``blk.N.ffn_{gate,up,down}_exps.weight [E, I, H]``...) and
  the Hugging Face names the store's architecture tables classify
  (:mod:`store.models.archs`); a GGUF file is read as the HF checkpoint it
  was converted from, so planning and the engine need nothing new;
* the hybrids' recurrent layers: Qwen3-Next's ``in_proj_qkvz`` is split into
  ``attn_qkv`` / ``attn_gate`` (:func:`qkvz_rows`, a row permutation joined back at
  mount), conv1d squeezed; ``ssm_a = -exp(A_log)`` and Qwen3-Next's ``1 + w`` norms are
  kept as the file holds them (roles ``lin_neg_a`` / ``mamba_neg_a``, config key
  :data:`~store.models.archs.NORMS_HOLD_ONE_PLUS`), since neither inverse is exact in
  float32: the engine uses them as llama.cpp does and an export writes the same bytes;
  Jamba's attention and expert layers are its per-layer ``head_count_kv`` and the
  layers with an ``ffn_gate_inp``, read back as its periods and offsets;
* llama.cpp's rope layout: its converter permutes the q/k rows of ``llama``
  models (Mixtral) from the HF rotate-half order to interleaved pairs
  (``convert_hf_to_gguf.LlamaModel.permute``); :func:`qk_rows` gives the
  row order that undoes it (and, inverted, redoes it on export). The NEOX-rope
  architectures (Qwen, OLMoE) are stored unpermuted, and so is ``deepseek2``
  (HF's ``rope_interleave`` and llama.cpp's rope both rotate adjacent pairs);
* ``deepseek2``'s latent attention: the converter writes MLA as MQA of one
  latent head (``head_count_kv`` 1, ``key_length`` ``kv_lora_rank +
  qk_rope_head_dim``, per-head widths under ``key_length_mla`` /
  ``value_length_mla``) and splits ``kv_b_proj`` into ``attn_k_b`` (the no-rope
  key rows of each head, transposed) and ``attn_v_b`` (:func:`kv_b_split`,
  :func:`kv_b_join`); the selection bias is ``exp_probs_b.bias``, shared experts
  ``ffn_*_shexp``, the leading dense layers ``ffn_{gate,up,down}``; its YaRN
  (DeepSeek-V3's and Kimi-K2's rope) is ``rope.scaling.*`` with
  ``yarn_log_multiplier = 0.1 * mscale_all_dim``, read back with
  ``mscale == mscale_all_dim`` (what llama.cpp computes);
* the HF ``config.json`` rebuilt from GGUF metadata (:func:`config_from_gguf`)
  and the metadata written from a config (:func:`gguf_metadata`), with
  llama.cpp's routing conventions made explicit (``norm_topk_prob``: llama.cpp
  renormalises top-k for ``llama`` and ``qwen3moe``, not for ``qwen2moe`` or
  ``olmoe``);
* the tokenizer: a byte-level BPE ``tokenizer.ggml.model = gpt2`` vocabulary
  rebuilt as ``tokenizer.json`` (:func:`tokenizer_json_from_gguf`) and back
  (:func:`gguf_tokenizer_fields`);
* the quant types the store holds natively (:data:`NATIVE_QTYPES`): Q8_0,
  Q4_0 and Q4_1 are exactly the store's ``q8``/``q4`` groups of 32 (a
  symmetric ``d * (q - z)`` is ``d * q + m`` with ``m = -z d``, exact in fp16),
  so they are repacked without drift; every other type needs an explicit
  conversion policy (:mod:`store.models.gguf_source`).

* a ``llama4`` file's ``rope_freqs.weight`` (the converter's llama3 rope scaling, one
  divisor per rotary frequency): kept as the trunk role ``rope_freqs`` and run as the
  rope type :data:`~store.models.rope.FREQ_FACTORS` (the file's values, as llama.cpp
  applies them); a llama3 config exports it as :func:`llama3_rope_freqs` computes it.

Anything else (another architecture, an unknown tensor, a rope scaling other
than deepseek2's YARN and llama4's rope_freqs, an unknown gating function) is
refused with :class:`UnsupportedGGUFError`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from czyx.store.models.archs import NORMS_HOLD_ONE_PLUS, ROPE_FREQS_NAME, llama4_moe_layers
from czyx.store.models.mount_errors import CheckpointError
from czyx.store.models.rope import FREQ_FACTORS, rope_params

#: PhiMoE's ``router_jitter_noise`` (transformers' default): GGUF has no field for it,
#: so only this value goes to and comes from a GGUF file.
PHIMOE_JITTER = 0.01


class GGUFError(CheckpointError):
    """A GGUF file czyx cannot read faithfully (malformed, or missing metadata)."""


class UnsupportedGGUFError(GGUFError):
    """A GGUF architecture, tensor, quant type or tokenizer czyx does not support."""


class ConversionPolicyError(GGUFError):
    """A source format needs a conversion policy that was not given (or is unknown)."""


@dataclass(frozen=True)
class GGUFArch:
    """One architecture as llama.cpp spells it.

    ``permute_qk``: q/k rows are in llama.cpp's interleaved rope order.
    ``renormalize``: llama.cpp renormalises the top-k routing weights.
    ``expert_names``: HF per-expert names for gate, up, down (``{l}``, ``{e}``).
    ``layer_names``: where the HF names of a layer's tensors differ from the common
    table (``blk.N.<key>`` -> ``model.layers.N.<value>``).
    """

    gguf: str
    czyx: str
    hf_class: str
    permute_qk: bool
    renormalize: bool
    router: str
    expert_names: tuple[str, str, str]
    layer_names: Mapping[str, str] | None = None  # blk.N.<key> overrides of _LAYER


_PROJ = tuple(
    f"model.layers.{{l}}.mlp.experts.{{e}}.{p}_proj.weight" for p in ("gate", "up", "down")
)
_MIX = tuple(
    f"model.layers.{{l}}.block_sparse_moe.experts.{{e}}.{w}.weight" for w in ("w1", "w3", "w2")
)

_DEEPSEEK_V3 = GGUFArch(
    "deepseek2",
    "deepseek_v3",
    "DeepseekV3ForCausalLM",
    False,  # rope_interleave: HF and llama.cpp both rotate adjacent pairs
    True,
    "model.layers.{l}.mlp.gate.weight",
    _PROJ,  # type: ignore[arg-type]
)
_DEEPSEEK_V2 = GGUFArch(
    "deepseek2",
    "deepseek_v2",
    "DeepseekV2ForCausalLM",
    False,
    False,
    "model.layers.{l}.mlp.gate.weight",
    _PROJ,  # type: ignore[arg-type]
)
_FEED = "model.layers.{l}.feed_forward"
# Llama 4: HF's feed_forward.* names (the converter maps them with gguf's TensorNameMap).
_LLAMA4_LAYER = {
    "ffn_gate_shexp.weight": "feed_forward.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "feed_forward.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "feed_forward.shared_expert.down_proj.weight",
    "ffn_gate.weight": "feed_forward.gate_proj.weight",
    "ffn_up.weight": "feed_forward.up_proj.weight",
    "ffn_down.weight": "feed_forward.down_proj.weight",
}
_LLAMA4 = GGUFArch(
    "llama4",
    "llama4_text",
    "Llama4ForCausalLM",
    # Llama4Model sets undo_permute = False: HF's Llama 4 rope already rotates adjacent
    # pairs (complex multiply), as llama.cpp's LLAMA_ROPE_TYPE_NORM does
    False,
    False,  # (top-k sigmoid gates: nothing to renormalise)
    _FEED + ".router.weight",
    tuple(f"{_FEED}.experts.{{e}}.{p}_proj.weight" for p in ("gate", "up", "down")),  # type: ignore[arg-type]
    _LLAMA4_LAYER,
)
# Qwen3NextModel.modify_tensors: in_proj_qkvz is split into attn_qkv / attn_gate
# (QKVZ_HALVES, rows regrouped: qkvz_rows), dt_bias renamed ssm_dt.bias, conv1d squeezed
# to [C, K], A_log written as ssm_a = -exp(A_log), and every RMS norm weight but the
# DeltaNet's own (ssm_norm) as 1 + w; post_attention_layernorm is post_attention_norm.
# ssm_a reads back as the role lin_neg_a (linear_attn.ssm_a) and the norms as they are
# (archs.NORMS_HOLD_ONE_PLUS): neither inverse is exact in float32, so czyx keeps what the file
# holds, runs it as llama.cpp does and exports it byte for byte.
_QWEN3NEXT_LAYER = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.ssm_a",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}
# JambaModel.modify_tensors: Mamba's A_log as ssm_a = -exp(A_log) (read back as the role
# mamba_neg_a, mamba.ssm_a), conv1d squeezed; dense layers' MLP as ffn_{gate,up,down}.
_JAMBA_LAYER = {
    "ffn_norm.weight": "pre_ff_layernorm.weight",
    "ssm_in.weight": "mamba.in_proj.weight",
    "ssm_conv1d.weight": "mamba.conv1d.weight",
    "ssm_conv1d.bias": "mamba.conv1d.bias",
    "ssm_x.weight": "mamba.x_proj.weight",
    "ssm_dt.weight": "mamba.dt_proj.weight",
    "ssm_dt.bias": "mamba.dt_proj.bias",
    "ssm_a": "mamba.ssm_a",
    "ssm_d": "mamba.D",
    "ssm_dt_norm.weight": "mamba.dt_layernorm.weight",
    "ssm_b_norm.weight": "mamba.b_layernorm.weight",
    "ssm_c_norm.weight": "mamba.c_layernorm.weight",
    "ssm_out.weight": "mamba.out_proj.weight",
    "ffn_gate.weight": "feed_forward.gate_proj.weight",
    "ffn_up.weight": "feed_forward.up_proj.weight",
    "ffn_down.weight": "feed_forward.down_proj.weight",
}
#: llama.cpp's ``expert_gating_func`` values (``LLAMA_EXPERT_GATING_FUNC_TYPE_*``).
GATING_SOFTMAX, GATING_SIGMOID = 1, 2

ARCHS: dict[str, GGUFArch] = {
    a.gguf: a
    for a in (
        GGUFArch(
            "llama",
            "mixtral",
            "MixtralForCausalLM",
            True,
            True,
            "model.layers.{l}.block_sparse_moe.gate.weight",
            _MIX,  # type: ignore[arg-type]
        ),
        GGUFArch(
            "qwen2moe",
            "qwen2_moe",
            "Qwen2MoeForCausalLM",
            False,
            False,
            "model.layers.{l}.mlp.gate.weight",
            _PROJ,  # type: ignore[arg-type]
        ),
        GGUFArch(
            "qwen3moe",
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            False,
            True,
            "model.layers.{l}.mlp.gate.weight",
            _PROJ,  # type: ignore[arg-type]
        ),
        # PhiMoE: NEOX rope (unpermuted), biased LayerNorms, attention and head biases.
        # llama.cpp routes it by softmax top-2; the file is read as the HF checkpoint it
        # was converted from, whose sparsemixer routing czyx runs.
        GGUFArch(
            "phimoe",
            "phimoe",
            "PhimoeForCausalLM",
            False,
            False,
            "model.layers.{l}.block_sparse_moe.gate.weight",
            _MIX,  # type: ignore[arg-type]
        ),
        GGUFArch(
            "olmoe",
            "olmoe",
            "OlmoeForCausalLM",
            False,
            False,
            "model.layers.{l}.mlp.gate.weight",
            _PROJ,  # type: ignore[arg-type]
        ),
        _DEEPSEEK_V3,
        _LLAMA4,
        # Qwen3-Next (Qwen3NextModel): gated DeltaNet beside gated attention; Jamba
        # (JambaModel): Mamba beside attention. Their converter transforms: _QWEN3NEXT_LAYER.
        GGUFArch(
            "qwen3next",
            "qwen3_next",
            "Qwen3NextForCausalLM",
            False,  # NEOX rope (partial): unpermuted
            True,
            "model.layers.{l}.mlp.gate.weight",
            _PROJ,  # type: ignore[arg-type]
            _QWEN3NEXT_LAYER,
        ),
        GGUFArch(
            "jamba",
            "jamba",
            "JambaForCausalLM",
            False,  # (no rope at all)
            False,
            _FEED + ".router.weight",
            tuple(f"{_FEED}.experts.{{e}}.{p}_proj.weight" for p in ("gate", "up", "down")),  # type: ignore[arg-type]
            _JAMBA_LAYER,
        ),
    )
}
# llama.cpp's deepseek2 holds DeepSeek-V2 and V3 (and Kimi-K2): the gating function
# tells them apart (resolve_arch); ARCHS names the V3 reading, BY_CZYX has both.
BY_CZYX = {a.czyx: a for a in (*ARCHS.values(), _DEEPSEEK_V2)}

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "output_norm.bias": "model.norm.bias",  # PhiMoE's LayerNorm and head biases
    "output.bias": "lm_head.bias",
}
# blk.N.<key> -> model.layers.N.<value>
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_norm.bias": "input_layernorm.bias",
    "ffn_norm.bias": "post_attention_layernorm.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# deepseek2 (multi-head latent attention): blk.N.<key> -> model.layers.N.<value>. The
# converter splits kv_b_proj into attn_k_b (the no-rope key rows, transposed per head:
# [n_head, kv_lora_rank, qk_nope]) and attn_v_b ([n_head, v_head_dim, kv_lora_rank]);
# files from before that split hold attn_kv_b as HF has it.
_MLA_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",  # no q LoRA (DeepSeek-V2-Lite)
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
KV_B_HALVES = {"attn_k_b.weight": "k", "attn_v_b.weight": "v"}
KV_B = "self_attn.kv_b_proj.weight"
QKVZ_HALVES = {"attn_qkv.weight": "qkv", "attn_gate.weight": "z"}
QKVZ = "linear_attn.in_proj_qkvz.weight"
EXPERT_STACKS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
_BLK = re.compile(r"blk\.(\d+)\.(.+)")


@dataclass(frozen=True)
class GGUFName:
    """What one GGUF tensor is: a single HF tensor (``hf``) or a stacked expert
    part (``part`` in 0, 1, 2 for gate, up, down) of ``layer``."""

    hf: str | None
    layer: int | None
    part: int | None = None
    qk: str | None = None  # "q" or "k": rows in rope order when the arch permutes
    # a half of a tensor the converter splits: "k" or "v" of deepseek2's kv_b_proj,
    # "qkv" or "z" of qwen3next's in_proj_qkvz
    kv: str | None = None
    squeezed: bool = False  # a depthwise conv1d [C, K] whose HF form is [C, 1, K]


def classify(arch: GGUFArch, name: str) -> GGUFName | None:
    """The HF meaning of GGUF tensor ``name``; ``None`` if unknown (the caller refuses)."""
    if name == ROPE_FREQS and arch.gguf in ROPE_FREQS_ARCHS:
        return GGUFName(ROPE_FREQS_NAME, None)
    if name == "output_norm.weight" and arch.gguf == "jamba":
        return GGUFName("model.final_layernorm.weight", None)
    if name in _GLOBAL:
        return GGUFName(_GLOBAL[name], None)
    m = _BLK.fullmatch(name)
    if not m:
        return None
    layer, rest = int(m.group(1)), m.group(2)
    if rest in EXPERT_STACKS:
        return GGUFName(None, layer, EXPERT_STACKS.index(rest))
    if rest == "ffn_gate_inp.weight":
        return GGUFName(arch.router.format(l=layer), layer)
    if arch.gguf == "deepseek2":
        if rest in KV_B_HALVES:
            return GGUFName(f"model.layers.{layer}.{KV_B}", layer, kv=KV_B_HALVES[rest])
        hf = _MLA_LAYER.get(rest)
        return None if hf is None else GGUFName(f"model.layers.{layer}.{hf}", layer)
    if arch.gguf == "qwen3next" and rest in QKVZ_HALVES:
        return GGUFName(f"model.layers.{layer}.{QKVZ}", layer, kv=QKVZ_HALVES[rest])
    hf = (arch.layer_names or {}).get(rest) or _LAYER.get(rest)
    if hf is None:
        return None
    qk = rest[5] if rest.startswith(("attn_q.", "attn_k.")) and arch.permute_qk else None
    squeezed = rest == "ssm_conv1d.weight"
    return GGUFName(f"model.layers.{layer}.{hf}", layer, qk=qk, squeezed=squeezed)


# The recurrent layers' roles by llama.cpp arch: role -> blk.N.<name> (a recurrent
# layer's o_proj is its ssm_out). ssm_a is written from either A_log or A (see _QWEN3NEXT_LAYER).
_RECURRENT_ROLES = {
    "qwen3next": {
        "post_attn_norm": "post_attention_norm.weight",
        "lin_ba": "ssm_ba.weight",
        "lin_conv": "ssm_conv1d.weight",
        "lin_dt_bias": "ssm_dt.bias",
        "lin_a_log": "ssm_a",
        "lin_neg_a": "ssm_a",
        "lin_norm": "ssm_norm.weight",
    },
    "jamba": {
        "mamba_in_proj": "ssm_in.weight",
        "mamba_conv": "ssm_conv1d.weight",
        "mamba_conv_bias": "ssm_conv1d.bias",
        "mamba_x_proj": "ssm_x.weight",
        "mamba_dt_proj": "ssm_dt.weight",
        "mamba_dt_bias": "ssm_dt.bias",
        "mamba_a_log": "ssm_a",
        "mamba_neg_a": "ssm_a",
        "mamba_d": "ssm_d",
        "mamba_dt_norm": "ssm_dt_norm.weight",
        "mamba_b_norm": "ssm_b_norm.weight",
        "mamba_c_norm": "ssm_c_norm.weight",
    },
}


def gguf_name(arch: GGUFArch, role: str, layer: int | None, recurrent: bool = False) -> str:
    """The llama.cpp name of trunk ``role`` (czyx role names, :mod:`store.models.archs`);
    ``recurrent``: ``layer`` is a DeltaNet or Mamba layer (its ``o_proj`` is ``ssm_out``)."""
    if recurrent and role == "o_proj":
        return f"blk.{layer}.ssm_out.weight"
    hybrid = _RECURRENT_ROLES.get(arch.gguf, {})
    if layer is not None and role in hybrid:
        return f"blk.{layer}.{hybrid[role]}"
    if layer is None:
        return {
            "embed": "token_embd.weight",
            "final_norm": "output_norm.weight",
            "lm_head": "output.weight",
            "final_norm_bias": "output_norm.bias",
            "lm_head_bias": "output.bias",
            "rope_freqs": ROPE_FREQS,
        }.get(role) or _refuse_role(role)
    inv = {
        "input_norm": "attn_norm.weight",
        "post_attn_norm": "ffn_norm.weight",
        "q_proj": "attn_q.weight",
        "k_proj": "attn_k.weight",
        "v_proj": "attn_v.weight",
        "o_proj": "attn_output.weight",
        "q_bias": "attn_q.bias",
        "k_bias": "attn_k.bias",
        "v_bias": "attn_v.bias",
        "o_bias": "attn_output.bias",
        "input_norm_bias": "attn_norm.bias",
        "post_attn_norm_bias": "ffn_norm.bias",
        "q_norm": "attn_q_norm.weight",
        "k_norm": "attn_k_norm.weight",
        "router": "ffn_gate_inp.weight",
        "shared_gate_proj": "ffn_gate_shexp.weight",
        "shared_up_proj": "ffn_up_shexp.weight",
        "shared_down_proj": "ffn_down_shexp.weight",
        "shared_expert_gate": "ffn_gate_inp_shexp.weight",
        "mlp_gate_proj": "ffn_gate.weight",
        "mlp_up_proj": "ffn_up.weight",
        "mlp_down_proj": "ffn_down.weight",
    }
    if arch.gguf == "deepseek2":
        inv = {
            **{k: v for k, v in inv.items() if k in _MLA_ROLES_KEPT},
            "q_a_proj": "attn_q_a.weight",
            "q_a_norm": "attn_q_a_norm.weight",
            "q_b_proj": "attn_q_b.weight",
            "kv_a_proj": "attn_kv_a_mqa.weight",
            "kv_a_norm": "attn_kv_a_norm.weight",
            "router_bias": "exp_probs_b.bias",
        }
    if role not in inv:
        _refuse_role(role)
    return f"blk.{layer}.{inv[role]}"


# The shared roles a deepseek2 layer has (kv_b_proj is written as its two halves).
_MLA_ROLES_KEPT = frozenset(
    (
        "input_norm",
        "post_attn_norm",
        "q_proj",
        "o_proj",
        "router",
        "shared_gate_proj",
        "shared_up_proj",
        "shared_down_proj",
        "mlp_gate_proj",
        "mlp_up_proj",
        "mlp_down_proj",
    )
)


def _refuse_role(role: str) -> str:
    raise UnsupportedGGUFError(f"trunk role {role!r} has no llama.cpp tensor name")


def qk_rows(rows: int, n_head: int) -> np.ndarray:
    """Row order undoing llama.cpp's rope permutation of a q or k projection.

    llama.cpp's converter writes ``W.reshape(n_head, 2, d/2, C).swapaxes(1, 2)``;
    HF row ``perm[i]`` is GGUF row ``i``... inverted: ``hf = gguf[qk_rows(...)]``.
    """
    if rows % (2 * n_head):
        raise GGUFError(f"q/k rows {rows} are not a multiple of 2 x {n_head} heads")
    half = rows // n_head // 2
    # GGUF row (h, j, t) holds HF row (h, t, j): gguf = hf[permute]
    permute = np.arange(rows).reshape(n_head, 2, half).swapaxes(1, 2).reshape(-1)
    return np.argsort(permute)


def qkvz_rows(n_k_heads: int, n_v_heads: int, k_dim: int, v_dim: int) -> np.ndarray:
    """Row order joining llama.cpp's ``attn_qkv`` and ``attn_gate`` into HF's
    ``in_proj_qkvz``: ``hf = np.concatenate([qkv, gate])[qkvz_rows(...)]``.

    HF groups the rows by key head, ``[q (k_dim), k (k_dim), v (r v_dim), z (r v_dim)]``
    each (``r = n_v_heads / n_k_heads``); ``Qwen3NextModel.modify_tensors`` regroups them
    as every head's q, then k, then v (``attn_qkv``) and every z (``attn_gate``). A pure
    row permutation: exact for every type, quantized rows included.
    """
    r = n_v_heads // n_k_heads
    kd, vd, vg = n_k_heads * k_dim, n_v_heads * v_dim, r * v_dim
    parts = []
    for g in range(n_k_heads):
        q = np.arange(g * k_dim, (g + 1) * k_dim)
        v = np.arange(g * vg, (g + 1) * vg)
        parts += [q, kd + q, 2 * kd + v, 2 * kd + vd + v]
    return np.concatenate(parts)


def qkvz_dims(config: Mapping[str, Any]) -> tuple[int, int, int, int]:
    """``(n_k_heads, n_v_heads, k_dim, v_dim)`` of a Qwen3-Next config (for :func:`qkvz_rows`)."""
    return (
        int(config["linear_num_key_heads"]),
        int(config["linear_num_value_heads"]),
        int(config["linear_key_head_dim"]),
        int(config["linear_value_head_dim"]),
    )


def qkvz_split(hf_rows: np.ndarray, dims: tuple[int, int, int, int]) -> tuple:
    """``(attn_qkv, attn_gate)`` rows of HF ``in_proj_qkvz`` rows (any element type), as
    the converter splits them; ``dims`` as :func:`qkvz_dims` gives them."""
    joined = np.empty_like(hf_rows)
    joined[qkvz_rows(*dims)] = hf_rows
    n_qkv = 2 * dims[0] * dims[2] + dims[1] * dims[3]
    return joined[:n_qkv], joined[n_qkv:]


def kv_b_join(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """HF ``kv_b_proj [n_head * (qk_nope + v_head_dim), kv_lora_rank]`` of llama.cpp's
    ``attn_k_b [n_head, kv_lora_rank, qk_nope]`` and ``attn_v_b [n_head, v_head_dim,
    kv_lora_rank]`` (numpy shapes; any element type)."""
    if k_b.ndim != 3 or v_b.ndim != 3 or k_b.shape[0] != v_b.shape[0]:
        raise GGUFError(f"attn_k_b {list(k_b.shape)} and attn_v_b {list(v_b.shape)} do not pair")
    if k_b.shape[1] != v_b.shape[2]:
        raise GGUFError(f"attn_k_b {list(k_b.shape)} and attn_v_b {list(v_b.shape)} do not pair")
    joined = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)
    return np.ascontiguousarray(joined.reshape(-1, k_b.shape[1]))


def kv_b_split(kv_b: np.ndarray, n_head: int, qk_nope: int) -> tuple[np.ndarray, np.ndarray]:
    """``(attn_k_b, attn_v_b)`` of HF ``kv_b_proj``, as llama.cpp's converter splits it."""
    rows, rank = kv_b.shape
    if rows % n_head or rows // n_head <= qk_nope:
        raise GGUFError(f"kv_b_proj rows {rows} are not {n_head} heads of more than {qk_nope}")
    per_head = kv_b.reshape(n_head, rows // n_head, rank)
    k_b = np.ascontiguousarray(per_head[:, :qk_nope].transpose(0, 2, 1))
    return k_b, np.ascontiguousarray(per_head[:, qk_nope:])


def resolve_arch(name: str, meta: Mapping[str, Any]) -> GGUFArch | None:
    """The :class:`GGUFArch` of a file's ``general.architecture``; ``None`` if unknown.

    ``deepseek2`` is DeepSeek-V3 (Kimi-K2...) when its experts are gated by a sigmoid
    and DeepSeek-V2 when by a softmax (llama.cpp's default when the key is absent).
    """
    if name != "deepseek2":
        return ARCHS.get(name)
    gating = int(_get(meta, "deepseek2.expert_gating_func", GATING_SOFTMAX))
    if gating == GATING_SIGMOID:
        return _DEEPSEEK_V3
    if gating == GATING_SOFTMAX:
        return _DEEPSEEK_V2
    raise UnsupportedGGUFError(f"deepseek2.expert_gating_func {gating} is not supported")


def qk_permute(rows: int, n_head: int) -> np.ndarray:
    """Row order of llama.cpp's rope permutation: ``gguf = hf[qk_permute(...)]``."""
    return np.argsort(qk_rows(rows, n_head))


# ------------------------------------------------------------------ metadata


def _get(meta: Mapping[str, Any], key: str, default: Any = None, *, need: bool = False) -> Any:
    if key in meta:
        return meta[key]
    if need:
        raise GGUFError(f"metadata lacks {key!r}")
    return default


def config_from_gguf(
    meta: Mapping[str, Any],
    arch: GGUFArch,
    n_vocab: int,
    tied: bool,
    names: Collection[str] = (),
) -> dict:
    """The HF ``config.json`` of a GGUF model, from its metadata (and tensor ``names``,
    which say whether PhiMoE's attention and head carry biases).

    Fields the metadata cannot hold take llama.cpp's behaviour (routing
    renormalisation per architecture, no sliding window), or, for PhiMoE's
    ``router_jitter_noise`` (its sparsemixer threshold), transformers' default.
    """
    a = arch.gguf
    scaling = _get(meta, f"{a}.rope.scaling.type")
    if scaling not in (None, "none") and not (a == "deepseek2" and scaling == "yarn"):
        raise UnsupportedGGUFError(f"rope scaling {scaling!r} in a GGUF file is not supported")
    hidden = int(_get(meta, f"{a}.embedding_length", need=True))
    heads = int(_get(meta, f"{a}.attention.head_count", need=True))
    n_experts = int(_get(meta, f"{a}.expert_count", 0) or 0)
    if n_experts == 0:
        raise UnsupportedGGUFError(f"{a} GGUF without experts (a dense model) is not a MoE")
    if arch.gguf == "deepseek2":
        return _deepseek_config(meta, arch, n_vocab, tied)
    cfg: dict[str, Any] = {
        "architectures": [arch.hf_class],
        "model_type": arch.czyx,
        "hidden_size": hidden,
        "num_hidden_layers": int(_get(meta, f"{a}.block_count", need=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": _kv_heads(_get(meta, f"{a}.attention.head_count_kv", heads)),
        "max_position_embeddings": int(_get(meta, f"{a}.context_length", 4096)),
        "rms_norm_eps": float(_get(meta, f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_get(meta, f"{a}.rope.freq_base", 10000.0)),
        "vocab_size": n_vocab,
        "num_experts_per_tok": int(_get(meta, f"{a}.expert_used_count", need=True)),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "norm_topk_prob": arch.renormalize,
    }
    if a in ROPE_FREQS_ARCHS and ROPE_FREQS in names:  # the trunk's factors (rope_freqs)
        cfg["rope_parameters"] = {"rope_type": FREQ_FACTORS, "rope_theta": cfg["rope_theta"]}
    if arch.czyx == "jamba":
        _jamba_config(meta, cfg, n_experts, names)
        _token_ids(meta, cfg)
        return cfg
    key_len = _get(meta, f"{a}.attention.key_length")
    if key_len is not None and int(key_len) != hidden // heads:
        cfg["head_dim"] = int(key_len)
    ff = _get(meta, f"{a}.feed_forward_length")
    expert_ff = _get(meta, f"{a}.expert_feed_forward_length")
    if arch.czyx == "mixtral":
        cfg.update(num_local_experts=n_experts, intermediate_size=int(ff), sliding_window=None)
    elif arch.czyx == "phimoe":
        if f"{a}.rope.scaling.attn_factor" in meta or "rope_factors_long.weight" in names:
            raise UnsupportedGGUFError(
                "a phimoe GGUF with longrope: its short_mscale/long_mscale have no GGUF field"
            )
        window = int(_get(meta, f"{a}.attention.sliding_window", 0) or 0)
        cfg.update(
            num_local_experts=n_experts,
            intermediate_size=int(ff),
            sliding_window=window or None,
            attention_bias="blk.0.attn_q.bias" in names,
            lm_head_bias="output.bias" in names,
            router_jitter_noise=PHIMOE_JITTER,
        )
        del cfg["norm_topk_prob"]
    elif arch.czyx == "llama4_text":
        _llama4_config(meta, cfg, n_experts)
    elif arch.czyx == "olmoe":
        cfg.update(num_experts=n_experts, intermediate_size=int(expert_ff or ff))
        clamp = _get(meta, f"{a}.attention.clamp_kqv")
        cfg["clip_qkv"] = None if clamp is None else float(clamp)
    else:
        cfg.update(
            num_experts=n_experts,
            moe_intermediate_size=int(_get(meta, f"{a}.expert_feed_forward_length", need=True)),
            intermediate_size=int(ff) if ff is not None else int(expert_ff),
            use_sliding_window=False,
        )
        if arch.czyx in ("qwen2_moe", "qwen3_next"):
            shared = _get(meta, f"{a}.expert_shared_feed_forward_length")
            if shared is not None:
                cfg["shared_expert_intermediate_size"] = int(shared)
        if arch.czyx == "qwen3_next":
            _qwen3next_config(meta, cfg)
    _token_ids(meta, cfg)
    return cfg


def _kv_heads(value: Any) -> int:
    """``num_key_value_heads`` of ``attention.head_count_kv``: a number, or per layer
    (Jamba's, 0 on its Mamba layers) one count shared by every attention layer."""
    if not isinstance(value, list):
        return int(value)
    counts = {int(v) for v in value if int(v)}
    if len(counts) > 1:
        raise UnsupportedGGUFError(f"attention.head_count_kv {value}: layers differ in KV heads")
    return counts.pop() if counts else 1


def _qwen3next_config(meta: Mapping[str, Any], cfg: dict[str, Any]) -> None:
    """The Qwen3-Next fields of ``cfg`` (``Qwen3NextModel.set_gguf_parameters``: the
    DeltaNet widths under ``ssm.*``, the partial rope as ``rope.dimension_count``)."""
    a = "qwen3next"
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    v_heads = int(_get(meta, f"{a}.ssm.time_step_rank", need=True))
    inner = int(_get(meta, f"{a}.ssm.inner_size", need=True))
    if v_heads <= 0 or inner % v_heads:
        raise GGUFError(f"{a}.ssm.inner_size {inner} is not {v_heads} value heads")
    # llama.cpp's default interval when the key is absent
    every = int(_get(meta, f"{a}.full_attention_interval", 4))
    if every < 1:
        raise GGUFError(f"{a}.full_attention_interval {every}")
    n = cfg["num_hidden_layers"]
    cfg.update(
        head_dim=head_dim,
        partial_rotary_factor=int(_get(meta, f"{a}.rope.dimension_count", need=True)) / head_dim,
        linear_conv_kernel_dim=int(_get(meta, f"{a}.ssm.conv_kernel", need=True)),
        linear_key_head_dim=int(_get(meta, f"{a}.ssm.state_size", need=True)),
        linear_num_key_heads=int(_get(meta, f"{a}.ssm.group_count", need=True)),
        linear_num_value_heads=v_heads,
        linear_value_head_dim=inner // v_heads,
        full_attention_interval=every,
        layer_types=[_QWEN3NEXT_TYPES[(i + 1) % every == 0] for i in range(n)],
        decoder_sparse_step=1,
        mlp_only_layers=[],
        **{NORMS_HOLD_ONE_PLUS: True},
    )


_QWEN3NEXT_TYPES = ("linear_attention", "full_attention")


def _every(layers: list[int], n: int, what: str) -> tuple[int, int]:
    """``(period, offset)`` with ``layers == [i for i < n if i % period == offset]``
    (Jamba's attention and expert layers); none: ``(n + 1, n)``."""
    if not layers:
        return n + 1, n
    period = layers[1] - layers[0] if len(layers) > 1 else n
    offset = layers[0] % period
    if [i for i in range(n) if i % period == offset] != layers:
        raise UnsupportedGGUFError(
            f"jamba {what} layers {layers}: not every n-th layer from an offset"
        )
    return period, offset


def _jamba_config(
    meta: Mapping[str, Any], cfg: dict[str, Any], n_experts: int, names: Collection[str]
) -> None:
    """The Jamba fields of ``cfg`` (``JambaModel.set_gguf_parameters``). llama.cpp finds
    the attention layers by their ``head_count_kv`` entry (0 on Mamba layers) and the
    expert layers by their ``ffn_gate_inp``: read back as Jamba's periods and offsets."""
    a, n = "jamba", cfg["num_hidden_layers"]
    kv = _get(meta, f"{a}.attention.head_count_kv", need=True)
    per_layer = [int(v) for v in kv] if isinstance(kv, list) else [int(kv)] * n
    if len(per_layer) != n:
        raise GGUFError(f"{a}.attention.head_count_kv has {len(per_layer)} layers, not {n}")
    attn = _every([i for i, h in enumerate(per_layer) if h], n, "attention")
    moe = _every([i for i in range(n) if f"blk.{i}.ffn_gate_inp.weight" in names], n, "expert")
    hidden = cfg["hidden_size"]
    inner = int(_get(meta, f"{a}.ssm.inner_size", need=True))
    if inner % hidden:
        raise UnsupportedGGUFError(f"{a}.ssm.inner_size {inner} is not a multiple of {hidden}")
    cfg.update(
        num_experts=n_experts,
        intermediate_size=int(_get(meta, f"{a}.feed_forward_length", need=True)),
        attn_layer_period=attn[0],
        attn_layer_offset=attn[1],
        expert_layer_period=moe[0],
        expert_layer_offset=moe[1],
        mamba_d_state=int(_get(meta, f"{a}.ssm.state_size", need=True)),
        mamba_d_conv=int(_get(meta, f"{a}.ssm.conv_kernel", need=True)),
        mamba_dt_rank=int(_get(meta, f"{a}.ssm.time_step_rank", need=True)),
        mamba_expand=inner // hidden,
        mamba_conv_bias=any(f"blk.{i}.ssm_conv1d.bias" in names for i in range(n)),
        mamba_proj_bias=False,
        use_mamba_kernels=False,
    )
    del cfg["rope_theta"], cfg["norm_topk_prob"]  # (no rope; top-k never renormalised)


# What llama.cpp's llama4 fixes in code (llama-model.cpp, LLM_ARCH_LLAMA4) rather than
# reads from the file: chunked attention of 8192 tokens on three layers of four, NoPE on
# the fourth, whose queries get the temperature scale (floor 8192, scale 0.1); q and k
# L2-normed on the rope layers. A file with attention.sliding_window 0 (what the
# converter writes when every layer_types entry is full_attention) turns both off.
LLAMA4_CHUNK = 8192
LLAMA4_NOPE_INTERVAL = 4
LLAMA4_TEMPERATURE = {"attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1}


def _llama4_config(meta: Mapping[str, Any], cfg: dict[str, Any], n_experts: int) -> None:
    """The Llama 4 fields of ``cfg`` (see :data:`LLAMA4_CHUNK`)."""
    a, n = "llama4", cfg["num_hidden_layers"]
    ff = int(_get(meta, f"{a}.feed_forward_length", need=True))
    expert_ff = int(_get(meta, f"{a}.expert_feed_forward_length", need=True))
    step = int(_get(meta, f"{a}.interleave_moe_layer_step", need=True))
    if step < 1:
        raise GGUFError(f"{a}.interleave_moe_layer_step {step}")
    chunked = int(_get(meta, f"{a}.attention.sliding_window", LLAMA4_CHUNK)) != 0
    every = LLAMA4_NOPE_INTERVAL if chunked else n + 1
    cfg.update(
        num_local_experts=n_experts,
        intermediate_size=expert_ff,
        intermediate_size_mlp=ff,
        interleave_moe_layer_step=step,
        moe_layers=list(range(step - 1, n, step)),
        no_rope_layers=[int((i + 1) % every != 0) for i in range(n)],
        no_rope_layer_interval=LLAMA4_NOPE_INTERVAL,
        attention_chunk_size=LLAMA4_CHUNK if chunked else None,
        layer_types=["chunked_attention" if chunked else "full_attention"] * n,
        use_qk_norm=True,
        **(LLAMA4_TEMPERATURE if chunked else {"attn_temperature_tuning": False}),
    )
    if chunked:
        for i in range(LLAMA4_NOPE_INTERVAL - 1, n, LLAMA4_NOPE_INTERVAL):
            cfg["layer_types"][i] = "full_attention"
    del cfg["norm_topk_prob"]


def _llama4_metadata(config: Mapping[str, Any], meta: dict[str, Any]) -> None:
    """``llama4.*`` keys of a Llama 4 text config (``Llama4Model.set_gguf_parameters``);
    refuses what llama.cpp would run otherwise (:data:`LLAMA4_CHUNK`)."""
    a, n = "llama4", int(config["num_hidden_layers"])
    step = int(config.get("interleave_moe_layer_step") or 1)
    if list(llama4_moe_layers(config, n)) != list(range(step - 1, n, step)):
        raise UnsupportedGGUFError(
            f"moe_layers {config.get('moe_layers')}: llama.cpp's llama4 has only "
            "interleave_moe_layer_step"
        )
    if not config.get("use_qk_norm", True):
        raise UnsupportedGGUFError("use_qk_norm=false: llama.cpp's llama4 always L2-norms q, k")
    nope = [int(x) for x in config.get("no_rope_layers") or []]
    types = list(config.get("layer_types") or [])
    full = bool(types) and all(t == "full_attention" for t in types)
    if full and nope == [1] * n:  # rope and full attention everywhere: sliding_window 0
        meta[f"{a}.attention.sliding_window"] = 0
    else:
        want = [int((i + 1) % LLAMA4_NOPE_INTERVAL != 0) for i in range(n)]
        temp = {k: config.get(k) for k in LLAMA4_TEMPERATURE}
        if (
            nope != want
            or config.get("attention_chunk_size") != LLAMA4_CHUNK
            or temp != LLAMA4_TEMPERATURE
        ):
            raise UnsupportedGGUFError(
                f"llama.cpp's llama4 fixes chunked attention at {LLAMA4_CHUNK}, NoPE every "
                f"{LLAMA4_NOPE_INTERVAL}th layer and its temperature {LLAMA4_TEMPERATURE}"
            )
    meta[f"{a}.expert_count"] = int(config["num_local_experts"])
    meta[f"{a}.feed_forward_length"] = int(config["intermediate_size_mlp"])
    meta[f"{a}.vocab_size"] = int(config["vocab_size"])
    meta[f"{a}.interleave_moe_layer_step"] = step
    meta[f"{a}.expert_feed_forward_length"] = int(config["intermediate_size"])


def _token_ids(meta: Mapping[str, Any], cfg: dict[str, Any]) -> None:
    for field, key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ):
        if key in meta:
            cfg[field] = int(meta[key])


def _deepseek_config(meta: Mapping[str, Any], arch: GGUFArch, n_vocab: int, tied: bool) -> dict:
    """The HF config of a ``deepseek2`` GGUF (DeepSeek-V2 or V3, see :func:`resolve_arch`).

    llama.cpp's converter writes MLA as MQA of one latent head: ``head_count_kv`` 1,
    ``key_length`` ``kv_lora_rank + qk_rope_head_dim``, ``value_length`` ``kv_lora_rank``,
    the per-head widths under ``key_length_mla`` / ``value_length_mla`` (files from
    before those keys hold them in ``key_length`` / ``value_length``).
    """
    a = arch.gguf
    heads = int(_get(meta, f"{a}.attention.head_count", need=True))
    n_experts = int(_get(meta, f"{a}.expert_count", 0) or 0)
    if n_experts == 0:
        raise UnsupportedGGUFError(f"{a} GGUF without experts (a dense model) is not a MoE")
    rope = int(_get(meta, f"{a}.rope.dimension_count", need=True))
    kv_rank = int(_get(meta, f"{a}.attention.kv_lora_rank", need=True))
    if f"{a}.attention.key_length_mla" in meta:
        qk_head = int(meta[f"{a}.attention.key_length_mla"])
        v_head = int(_get(meta, f"{a}.attention.value_length_mla", need=True))
    else:
        qk_head = int(_get(meta, f"{a}.attention.key_length", need=True))
        v_head = int(_get(meta, f"{a}.attention.value_length", need=True))
    if qk_head <= rope:
        raise GGUFError(f"{a}: key length {qk_head} leaves no no-rope part beside rope {rope}")
    q_rank = _get(meta, f"{a}.attention.q_lora_rank")
    # kept absent when the file has none (both engines read absent as 1), so an
    # export writes back exactly the keys it read
    groups = _get(meta, f"{a}.expert_group_count")
    groups_used = _get(meta, f"{a}.expert_group_used_count")
    scale = _get(meta, f"{a}.expert_weights_scale")
    n_group = int(groups or 1)
    topk_group = int(groups_used or 1)
    norm = bool(_get(meta, f"{a}.expert_weights_norm", False))
    if arch.czyx == "deepseek_v2" and norm:
        raise UnsupportedGGUFError(
            "deepseek2 softmax gating with expert_weights_norm: DeepSeek-V2 never renormalises"
        )
    if arch.czyx == "deepseek_v2" and n_group > 1 and topk_group < n_group:
        raise UnsupportedGGUFError(
            "deepseek2 softmax gating with expert groups: llama.cpp scores a group by its two "
            "best experts, DeepSeek-V2's group_limited_greedy by its best"
        )
    cfg: dict[str, Any] = {
        "architectures": [arch.hf_class],
        "model_type": arch.czyx,
        "hidden_size": int(_get(meta, f"{a}.embedding_length", need=True)),
        "num_hidden_layers": int(_get(meta, f"{a}.block_count", need=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": heads,  # MLA: the converter's head_count_kv 1 is its MQA view
        "max_position_embeddings": int(_get(meta, f"{a}.context_length", 4096)),
        "rms_norm_eps": float(_get(meta, f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_get(meta, f"{a}.rope.freq_base", 10000.0)),
        "vocab_size": n_vocab,
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "intermediate_size": int(_get(meta, f"{a}.feed_forward_length", need=True)),
        "moe_intermediate_size": int(_get(meta, f"{a}.expert_feed_forward_length", need=True)),
        "n_routed_experts": n_experts,
        "n_shared_experts": int(_get(meta, f"{a}.expert_shared_count", 0) or 0),
        "num_experts_per_tok": int(_get(meta, f"{a}.expert_used_count", need=True)),
        "first_k_dense_replace": int(_get(meta, f"{a}.leading_dense_block_count", 0) or 0),
        "moe_layer_freq": 1,
        "q_lora_rank": None if q_rank is None else int(q_rank),
        "kv_lora_rank": kv_rank,
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": qk_head - rope,
        "v_head_dim": v_head,
        "head_dim": rope,  # transformers' DeepSeek configs set head_dim to the rope width
        "n_group": None if groups is None else n_group,
        "topk_group": None if groups_used is None else topk_group,
        "routed_scaling_factor": None if scale is None else float(scale),
        "norm_topk_prob": norm,
        "num_nextn_predict_layers": 0,  # the converter drops multi-token-prediction layers
    }
    if arch.czyx == "deepseek_v3":
        cfg["rope_interleave"] = True  # llama.cpp's deepseek2 rope rotates adjacent pairs
    else:
        cfg["topk_method"] = "greedy"
    if _get(meta, f"{a}.rope.scaling.type") == "yarn":
        cfg["rope_parameters"] = _deepseek_yarn(meta, cfg["rope_theta"])
    _token_ids(meta, cfg)
    return cfg


# YaRN keys of llama.cpp that a DeepSeek config has no field for (its yarn is
# transformers' with an attention scale from mscale / mscale_all_dim).
_YARN_UNMAPPED = ("rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor")


def _deepseek_yarn(meta: Mapping[str, Any], theta: float) -> dict[str, Any]:
    """HF ``rope_parameters`` of a deepseek2 file's YaRN keys.

    llama.cpp scales DeepSeek's attention by ``1 + yarn_log_multiplier * ln(factor)``
    (the converter writes ``0.1 * mscale_all_dim``) and leaves cos/sin unscaled: that
    is transformers' DeepSeek YaRN with ``mscale == mscale_all_dim``.
    """
    a = "deepseek2"
    for key in _YARN_UNMAPPED:
        if f"{a}.{key}" in meta:
            raise UnsupportedGGUFError(f"{a}.{key}: DeepSeek's YaRN has no such parameter")
    log_mul = _get(meta, f"{a}.rope.scaling.yarn_log_multiplier")
    if log_mul is None:
        raise UnsupportedGGUFError(f"{a} YaRN without rope.scaling.yarn_log_multiplier")
    mscale = round(float(log_mul) / 0.1, 6)  # (a float32 of 0.1 * mscale_all_dim)
    params: dict[str, Any] = {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": float(_get(meta, f"{a}.rope.scaling.factor", need=True)),
        "original_max_position_embeddings": int(
            _get(meta, f"{a}.rope.scaling.original_context_length", need=True)
        ),
        "mscale": mscale,
        "mscale_all_dim": mscale,
    }
    for field in ("beta_fast", "beta_slow"):
        v = _get(meta, f"{a}.rope.scaling.yarn_{field}")
        if v is not None:
            params[field] = float(v)
    return params


def _deepseek_yarn_metadata(config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``rope.scaling.*`` keys of a DeepSeek config (none for the default rope)."""
    params = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return {}
    if kind != "yarn":
        raise UnsupportedGGUFError(f"rope scaling {kind!r}: llama.cpp's deepseek2 has only yarn")
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    if mscale_all is None or float(mscale or 0) != float(mscale_all):
        raise UnsupportedGGUFError(
            f"yarn mscale={mscale} mscale_all_dim={mscale_all}: llama.cpp's deepseek2 needs "
            "them equal"
        )
    for field in ("attention_factor", "extrapolation_factor"):
        if params.get(field) is not None:
            raise UnsupportedGGUFError(f"yarn {field}: llama.cpp's deepseek2 has no such key")
    a = "deepseek2"
    out: dict[str, Any] = {
        f"{a}.rope.scaling.type": "yarn",
        f"{a}.rope.scaling.factor": float(params["factor"]),
        f"{a}.rope.scaling.original_context_length": int(
            params.get("original_max_position_embeddings")
            or config.get("original_max_position_embeddings")
        ),
    }
    for field in ("beta_fast", "beta_slow"):
        if params.get(field) is not None:
            out[f"{a}.rope.scaling.yarn_{field}"] = float(params[field])
    return out


def _deepseek_metadata(config: Mapping[str, Any], arch: GGUFArch) -> dict[str, Any]:
    """``deepseek2`` metadata of a DeepSeek-V2/V3 config, as the converter writes it."""
    a = arch.gguf
    heads = int(config["num_attention_heads"])
    kv_heads = config.get("num_key_value_heads")
    if kv_heads is not None and int(kv_heads) != heads:
        # the converter splits kv_b_proj by num_key_value_heads: only MLA's own count works
        raise UnsupportedGGUFError("llama.cpp's deepseek2 needs num_key_value_heads == heads")
    if arch.czyx == "deepseek_v3" and not config.get("rope_interleave", True):
        raise UnsupportedGGUFError("rope_interleave=false: llama.cpp's deepseek2 rotates pairs")
    if int(config.get("moe_layer_freq") or 1) != 1:
        raise UnsupportedGGUFError("moe_layer_freq > 1: deepseek2 has only leading dense layers")
    if arch.czyx == "deepseek_v2" and (config.get("topk_method") or "greedy") != "greedy":
        raise UnsupportedGGUFError(
            f"topk_method={config.get('topk_method')!r}: llama.cpp's deepseek2 scores "
            "expert groups otherwise"
        )
    rope = int(config["qk_rope_head_dim"])
    kv_rank = int(config["kv_lora_rank"])
    theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta")
    yarn = _deepseek_yarn_metadata(config)
    meta: dict[str, Any] = {
        f"{a}.block_count": int(config["num_hidden_layers"]),
        f"{a}.context_length": int(config.get("max_position_embeddings") or 4096),
        f"{a}.embedding_length": int(config["hidden_size"]),
        f"{a}.feed_forward_length": int(config["intermediate_size"]),
        f"{a}.attention.head_count": heads,
        f"{a}.attention.head_count_kv": 1,
        **yarn,
        f"{a}.rope.freq_base": float(theta or 10000.0),
        f"{a}.attention.layer_norm_rms_epsilon": float(config.get("rms_norm_eps", 1e-6)),
        f"{a}.expert_count": int(config["n_routed_experts"]),
        f"{a}.expert_used_count": int(config["num_experts_per_tok"]),
    }
    if config.get("n_group") is not None:
        meta[f"{a}.expert_group_count"] = int(config["n_group"])
    if config.get("topk_group") is not None:
        meta[f"{a}.expert_group_used_count"] = int(config["topk_group"])
    gating = GATING_SIGMOID if arch.czyx == "deepseek_v3" else GATING_SOFTMAX
    meta[f"{a}.expert_gating_func"] = gating
    meta[f"{a}.leading_dense_block_count"] = int(config.get("first_k_dense_replace") or 0)
    meta[f"{a}.vocab_size"] = int(config["vocab_size"])
    if config.get("q_lora_rank") is not None:
        meta[f"{a}.attention.q_lora_rank"] = int(config["q_lora_rank"])
    meta[f"{a}.attention.kv_lora_rank"] = kv_rank
    meta[f"{a}.attention.key_length"] = kv_rank + rope
    meta[f"{a}.attention.value_length"] = kv_rank
    meta[f"{a}.attention.key_length_mla"] = int(config["qk_nope_head_dim"]) + rope
    meta[f"{a}.attention.value_length_mla"] = int(config["v_head_dim"])
    meta[f"{a}.expert_feed_forward_length"] = int(config["moe_intermediate_size"])
    meta[f"{a}.expert_shared_count"] = int(config.get("n_shared_experts") or 0)
    if config.get("routed_scaling_factor") is not None:
        meta[f"{a}.expert_weights_scale"] = float(config["routed_scaling_factor"])
    if arch.czyx == "deepseek_v3" and config.get("norm_topk_prob", True):
        meta[f"{a}.expert_weights_norm"] = True
    meta[f"{a}.rope.dimension_count"] = rope
    if yarn:
        # DeepseekV2Model writes 0.1 * mscale_all_dim ([TAG_DEEPSEEK2_YARN_LOG_MUL_FIX])
        params = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
        meta[f"{a}.rope.scaling.yarn_log_multiplier"] = 0.1 * float(params["mscale_all_dim"])
    return meta


def gguf_metadata(config: Mapping[str, Any]) -> tuple[GGUFArch, dict[str, Any]]:
    """``(arch, {key: value})`` of the GGUF metadata that describes ``config``.

    Raises
    ------
    UnsupportedGGUFError
        An architecture llama.cpp names differently, a sliding window or rope
        scaling GGUF cannot express, or routing llama.cpp would compute otherwise.
    """
    arch = BY_CZYX.get(str(config.get("model_type")))
    if arch is None:
        raise UnsupportedGGUFError(f"model_type {config.get('model_type')!r} has no GGUF export")
    if arch.gguf == "deepseek2":  # (its YaRN has a GGUF form)
        return arch, _deepseek_metadata(config, arch)
    kind = config_rope_type(config)
    if kind != "default" and not (arch.gguf in ROPE_FREQS_ARCHS and kind in ROPE_FREQS_TYPES):
        raise UnsupportedGGUFError(
            f"rope type {kind!r} has no {arch.gguf} GGUF form (llama.cpp's converter writes "
            f"llama3 as rope_freqs, which czyx exports for {', '.join(ROPE_FREQS_ARCHS)})"
        )
    if config.get("sliding_window") and (
        arch.czyx == "mixtral" or config.get("use_sliding_window")
    ):  # (PhiMoE's window is a GGUF field: phimoe.attention.sliding_window)
        raise UnsupportedGGUFError("llama.cpp runs these architectures without a sliding window")
    if arch.czyx == "phimoe" and float(config.get("router_jitter_noise", 0.01)) != PHIMOE_JITTER:
        raise UnsupportedGGUFError(
            f"router_jitter_noise={config.get('router_jitter_noise')}: GGUF has no field for "
            f"PhiMoE's sparsemixer threshold (only {PHIMOE_JITTER} round-trips)"
        )
    # (PhiMoE: sparsemixer; Llama 4: sigmoid gates, never renormalised)
    routes_by_topk = arch.czyx not in ("mixtral", "phimoe", "llama4_text")
    if routes_by_topk and bool(config.get("norm_topk_prob")) != arch.renormalize:
        raise UnsupportedGGUFError(
            f"norm_topk_prob={config.get('norm_topk_prob')}: llama.cpp's {arch.gguf} "
            f"{'always' if arch.renormalize else 'never'} renormalises the top-k weights"
        )
    if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step") or 1) != 1:
        raise UnsupportedGGUFError("dense layers between sparse ones have no GGUF form")
    if arch.czyx == "jamba":
        return arch, _jamba_metadata(config)
    heads_kv = config.get("num_key_value_heads") or config["num_attention_heads"]
    if arch.czyx == "olmoe" and int(heads_kv) != int(config["num_attention_heads"]):
        # its k_norm spans n_embd: llama.cpp refuses the file (as OLMoE itself has no GQA)
        raise UnsupportedGGUFError("llama.cpp's olmoe needs num_key_value_heads == heads")
    a = arch.gguf
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    rope = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta")
    meta: dict[str, Any] = {
        f"{a}.block_count": int(config["num_hidden_layers"]),
        f"{a}.context_length": int(config.get("max_position_embeddings") or 4096),
        f"{a}.embedding_length": hidden,
        f"{a}.attention.head_count": heads,
        f"{a}.attention.head_count_kv": int(config.get("num_key_value_heads") or heads),
        f"{a}.rope.freq_base": float(rope or 10000.0),
        f"{a}.attention.layer_norm_rms_epsilon": float(config.get("rms_norm_eps", 1e-6)),
        f"{a}.expert_used_count": int(config["num_experts_per_tok"]),
        f"{a}.attention.key_length": head_dim,
        f"{a}.attention.value_length": head_dim,
        f"{a}.rope.dimension_count": head_dim,
    }
    if arch.czyx == "mixtral":
        meta[f"{a}.expert_count"] = int(config["num_local_experts"])
        meta[f"{a}.feed_forward_length"] = int(config["intermediate_size"])
        meta[f"{a}.vocab_size"] = int(config["vocab_size"])
    elif arch.czyx == "llama4_text":
        _llama4_metadata(config, meta)
    elif arch.czyx == "phimoe":  # as Phi3MiniModel.set_gguf_parameters writes it
        meta[f"{a}.expert_count"] = int(config["num_local_experts"])
        meta[f"{a}.feed_forward_length"] = int(config["intermediate_size"])
        meta[f"{a}.attention.sliding_window"] = int(config.get("sliding_window") or 0)
        for k in ("key_length", "value_length"):
            del meta[f"{a}.attention.{k}"]
    elif arch.czyx == "olmoe":
        meta[f"{a}.expert_count"] = int(config.get("num_experts") or config["num_local_experts"])
        meta[f"{a}.feed_forward_length"] = int(config["intermediate_size"])
        if config.get("clip_qkv") is not None:
            meta[f"{a}.attention.clamp_kqv"] = float(config["clip_qkv"])
    else:
        meta[f"{a}.expert_count"] = int(config.get("num_experts") or config["num_local_experts"])
        meta[f"{a}.feed_forward_length"] = int(config.get("intermediate_size") or 0)
        meta[f"{a}.expert_feed_forward_length"] = int(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size"):
            meta[f"{a}.expert_shared_feed_forward_length"] = int(
                config["shared_expert_intermediate_size"]
            )
    if arch.czyx == "qwen3_next":
        _qwen3next_metadata(config, meta)
    return arch, meta


# llama.cpp's rope_freqs.weight: F32 factors, one per rotary frequency, each dividing
# it (ggml_rope_ext's freq_factors). LlamaModel.generate_extra_tensors (Llama4Model's too)
# writes them for a llama3 rope; a llama4 file with them mounts as rope type FREQ_FACTORS.
ROPE_FREQS = "rope_freqs.weight"
ROPE_FREQS_ARCHS = ("llama4",)
#: The rope types a GGUF expresses as rope_freqs: llama3 (computed on export), FREQ_FACTORS
#: (a GGUF's own, written back as they are).
ROPE_FREQS_TYPES = ("llama3", FREQ_FACTORS)


def config_rope_type(config: Mapping[str, Any]) -> str:
    """The rope type of ``config`` (``rope_parameters`` over ``rope_scaling``; ``default``)."""
    params = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    return str(params.get("rope_type", params.get("type", "default")))


def llama3_rope_freqs(config: Mapping[str, Any]) -> np.ndarray:
    """The ``rope_freqs`` factors of a llama3-rope ``config``, as the converter computes them.

    ``LlamaModel.generate_extra_tensors``: the default inverse frequencies of
    ``head_dim`` in float32, then per frequency, in float32: 1 where its wavelength is
    below ``original / high_freq_factor``, ``factor`` above ``original /
    low_freq_factor``, ``1 / ((1 - smooth) / factor + smooth)`` between (llama.cpp
    divides each frequency by its factor: transformers' llama3 inverse frequencies, to
    float32 rounding). ``original`` is the one transformers runs (its
    ``original_max_position_embeddings``, top level first, then the rope parameters); the
    converter reads only the top-level key, else 8192 (the value Llama 4's configs hold in
    ``rope_scaling``). Where they differ (another value only in the rope parameters), this
    writes the factors the model runs, not the converter's.

    Returns
    -------
    numpy.ndarray
        ``float32 [head_dim // 2]``.
    """
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    p = rope_params(config, head_dim)
    if p.rope_type != "llama3":
        raise UnsupportedGGUFError(f"rope type {p.rope_type!r} has no llama3 rope_freqs")
    f32 = np.float32
    exps = np.arange(0, head_dim, 2, dtype=f32) / f32(head_dim)
    freqs = f32(1.0) / np.power(f32(p.theta), exps, dtype=f32)
    old, low, high, factor = p.original_max, p.low_freq_factor, p.high_freq_factor, p.factor
    assert old is not None and low is not None and high is not None and factor is not None
    # (a Python number over a tensor is torch's reciprocal times the number)
    wavelen = (f32(1.0) / freqs) * f32(2 * np.pi)
    smooth = ((f32(1.0) / wavelen) * f32(old) - f32(low)) / f32(high - low)
    with np.errstate(divide="ignore"):  # (only outside the band, where it is not taken)
        mid = f32(1.0) / ((f32(1.0) - smooth) / f32(factor) + smooth)
    ff = np.where(wavelen > f32(old / low), f32(factor), mid)
    return np.where(wavelen < f32(old / high), f32(1.0), ff).astype(f32)


def _qwen3next_metadata(config: Mapping[str, Any], meta: dict[str, Any]) -> None:
    """The ``qwen3next.*`` keys ``Qwen3NextModel.set_gguf_parameters`` adds; refuses what
    llama.cpp lays out otherwise (attention layers not every ``interval``-th, a partial
    rope width that is not whole)."""
    a, n = "qwen3next", int(config["num_hidden_layers"])
    if config.get("attention_bias"):
        raise UnsupportedGGUFError("attention_bias=true: llama.cpp's qwen3next has no q/k/v bias")
    types = list(config.get("layer_types") or [])
    every = int(config.get("full_attention_interval") or 4)
    if types:  # transformers saves the list; the interval is its first full layer's place
        every = types.index("full_attention") + 1 if "full_attention" in types else n + 1
    if types and types != [_QWEN3NEXT_TYPES[(i + 1) % every == 0] for i in range(n)]:
        raise UnsupportedGGUFError(
            f"layer_types {types}: llama.cpp's qwen3next has only full_attention_interval"
        )
    head_dim = int(meta[f"{a}.attention.key_length"])
    params = config.get("rope_parameters") or {}
    partial = float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25)))
    if head_dim * partial != int(head_dim * partial):
        raise UnsupportedGGUFError(f"partial_rotary_factor {partial} of head_dim {head_dim}")
    v_heads = int(config["linear_num_value_heads"])
    meta[f"{a}.ssm.conv_kernel"] = int(config["linear_conv_kernel_dim"])
    meta[f"{a}.ssm.state_size"] = int(config["linear_key_head_dim"])
    meta[f"{a}.ssm.group_count"] = int(config["linear_num_key_heads"])
    meta[f"{a}.ssm.time_step_rank"] = v_heads
    meta[f"{a}.ssm.inner_size"] = int(config["linear_value_head_dim"]) * v_heads
    meta[f"{a}.full_attention_interval"] = every
    meta[f"{a}.rope.dimension_count"] = int(head_dim * partial)


def _jamba_metadata(config: Mapping[str, Any]) -> dict[str, Any]:
    """``jamba.*`` metadata of a Jamba config (``JambaModel.set_gguf_parameters``): the KV
    head count per layer (0 on Mamba layers) says which layers attend."""
    a, n = "jamba", int(config["num_hidden_layers"])
    if config.get("mamba_proj_bias"):
        raise UnsupportedGGUFError("mamba_proj_bias=true: llama.cpp's jamba has no ssm_in bias")
    period, offset, e_period, e_offset = (
        int(config[k]) if config.get(k) is not None else default
        for k, default in (
            ("attn_layer_period", 8),
            ("attn_layer_offset", 4),
            ("expert_layer_period", 2),
            ("expert_layer_offset", 1),
        )
    )  # (transformers' defaults)
    if offset >= period or e_offset >= e_period:
        # the converter counts layers from the offset on, transformers by i % period
        raise UnsupportedGGUFError(
            f"jamba layer offsets ({offset}, {e_offset}) not below their periods "
            f"({period}, {e_period}): llama.cpp would place those layers otherwise"
        )
    hidden, kv = int(config["hidden_size"]), int(config["num_key_value_heads"])
    dt_rank = config.get("mamba_dt_rank")
    dt_rank = -(hidden // -16) if dt_rank in (None, "auto") else int(dt_rank)  # ceil(H / 16)
    return {
        f"{a}.block_count": n,
        f"{a}.context_length": int(config.get("max_position_embeddings") or 4096),
        f"{a}.embedding_length": hidden,
        f"{a}.feed_forward_length": int(config["intermediate_size"]),
        f"{a}.attention.head_count": int(config["num_attention_heads"]),
        f"{a}.attention.head_count_kv": [kv if i % period == offset else 0 for i in range(n)],
        f"{a}.ssm.conv_kernel": int(config.get("mamba_d_conv") or 4),
        f"{a}.ssm.inner_size": int(config.get("mamba_expand") or 2) * hidden,
        f"{a}.ssm.state_size": int(config.get("mamba_d_state") or 16),
        f"{a}.ssm.time_step_rank": dt_rank,
        f"{a}.attention.layer_norm_rms_epsilon": float(config.get("rms_norm_eps", 1e-6)),
        f"{a}.expert_count": int(config["num_experts"]),
        f"{a}.expert_used_count": int(config["num_experts_per_tok"]),
    }


# ----------------------------------------------------------------- tokenizer

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp) by tokenizer.ggml.pre; a tuple is
# applied in turn, each to the pieces of the one before (a Sequence of Splits in HF).
_GPT2_RX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
PRE_REGEX: dict[str, str | tuple[str, ...]] = {
    "gpt-2": _GPT2_RX,
    "olmo": _GPT2_RX,
    "qwen2": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
    "llama-bpe": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
        r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
    # DeepSeek-V3 / R1 (HF tokenizer.json and llama.cpp alike): digits in threes, runs of
    # CJK ideographs and kana, then a GPT-4-like split
    "deepseek-v3": (
        "\\p{N}{1,3}",
        "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?"
        "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
    ),
    # Kimi-K2 (tiktoken, its tokenization_kimi.py pat_str): llama-vocab.cpp names it by a
    # "\p{Han}+" trigger and runs a hand-written splitter of this very pattern (unicode.cpp,
    # Han excluded from the letter classes); Oniguruma's class intersection (&&) is that
    # exclusion, so the tiktoken pattern itself is the pre-tokenizer
    "kimi-k2": "|".join(
        (
            r"[\p{Han}]+",
            r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
            r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
            r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
            r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
            r"\p{N}{1,3}",
            r" ?[^\s\p{L}\p{N}]+[\r\n]*",
            r"\s*[\r\n]+",
            r"\s+(?!\S)",
            r"\s+",
        )
    ),
}
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 3, 4, 5, 6
METASPACE = "\u2581"  # sentencepiece's space


def _spm_tokenizer_json(meta: Mapping[str, Any]) -> str:
    """``tokenizer.json`` of a sentencepiece-BPE (``llama``) GGUF vocabulary.

    llama.cpp merges the adjacent pair whose concatenation is a piece with the
    highest score, falling back to ``<0xXX>`` byte tokens; as a ``tokenizers``
    BPE that is every split of every piece into two pieces, ranked by the
    merged piece's score (transformers' ``generate_merges``), with byte
    fallback, spaces as ``U+2581`` and one more prepended when ``add_space_prefix``.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    tokens = list(meta["tokenizer.ggml.tokens"])
    scores = list(meta.get("tokenizer.ggml.scores") or [])
    types = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
    if len(scores) != len(tokens) or len(types) != len(tokens):
        raise GGUFError("tokenizer.ggml.scores/token_type do not match the tokens")
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFError("tokenizer.ggml.tokens has duplicate tokens")
    pieces = {t for t, k in zip(tokens, types, strict=True) if k in (TOKEN_NORMAL, 2)}
    merges = []
    for piece, score, kind in zip(tokens, scores, types, strict=True):
        if kind != TOKEN_NORMAL:
            continue
        local = [
            (piece[:k], piece[k:], float(score))
            for k in range(1, len(piece))
            if piece[:k] in pieces and piece[k:] in pieces
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges += local
    merges.sort(key=lambda m: m[2], reverse=True)
    unk = int(meta.get("tokenizer.ggml.unknown_token_id", 0))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(a, b) for a, b, _ in merges],
            unk_token=tokens[unk],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    # llama.cpp prepends one space to the text unconditionally (even before a leading space)
    space = [normalizers.Replace(" ", METASPACE)]
    tok.normalizer = normalizers.Sequence(
        ([normalizers.Prepend(METASPACE)] if prefix else []) + space
    )
    steps = [decoders.Replace(METASPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    special = [tokens[i] for i, t in enumerate(types) if t == TOKEN_CONTROL]
    user = [tokens[i] for i, t in enumerate(types) if t == TOKEN_USER_DEFINED]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return tok.to_str()


def tokenizer_json_from_gguf(meta: Mapping[str, Any]) -> str | None:
    """``tokenizer.json`` text of a GGUF byte-level BPE vocabulary; ``None`` if none.

    Raises
    ------
    UnsupportedGGUFError
        A vocabulary other than ``gpt2`` BPE, or a pre-tokenizer not in :data:`PRE_REGEX`.
    """
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        return None
    if model == "llama":
        return _spm_tokenizer_json(meta)
    if model != "gpt2":
        raise UnsupportedGGUFError(
            f"tokenizer.ggml.model {model!r}: only byte-level BPE ('gpt2') and sentencepiece "
            "BPE ('llama') vocabularies are rebuilt as tokenizer.json"
        )
    pre = str(meta.get("tokenizer.ggml.pre", "gpt-2"))
    if pre == "default":
        pre = "gpt-2"
    if pre not in PRE_REGEX:
        raise UnsupportedGGUFError(
            f"tokenizer.ggml.pre {pre!r} (known: {', '.join(sorted(PRE_REGEX))})"
        )
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFError("tokenizer.ggml.tokens has duplicate tokens")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in _regexes(pre)]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    special = [tokens[i] for i, t in enumerate(types) if t == TOKEN_CONTROL]
    user = [tokens[i] for i, t in enumerate(types) if t == TOKEN_USER_DEFINED]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    if tok.get_vocab_size() != len(tokens):
        raise GGUFError("the rebuilt tokenizer does not keep every GGUF token id")
    return tok.to_str()


def gguf_tokenizer_fields(tokenizer_json: str, n_vocab: int) -> dict[str, Any]:
    """GGUF ``tokenizer.ggml.*`` fields of a byte-level BPE ``tokenizer.json``.

    Ids without a token are padded as ``[PADn]`` (UNUSED), as llama.cpp's converter does.

    Raises
    ------
    UnsupportedGGUFError
        Not a byte-level BPE tokenizer.
    """
    data = json.loads(tokenizer_json)
    model = data.get("model") or {}
    if model.get("type") == "BPE" and model.get("byte_fallback"):
        return _spm_fields(data, model, n_vocab)
    pre = _pre_name(data.get("pre_tokenizer") or {})
    if model.get("type") != "BPE" or pre is None:
        raise UnsupportedGGUFError(
            "only byte-level BPE tokenizers with a llama.cpp pre-tokenizer are written to GGUF"
        )
    vocab: dict[str, int] = dict(model["vocab"])
    added = {a["content"]: a for a in data.get("added_tokens") or []}
    for a in added.values():
        vocab[a["content"]] = int(a["id"])
    by_id = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(n_vocab):
        t = by_id.get(i)
        if t is None:
            tokens.append(f"[PAD{i}]")
            types.append(TOKEN_UNUSED)
        elif t in added:
            tokens.append(t)
            types.append(TOKEN_CONTROL if added[t].get("special") else TOKEN_USER_DEFINED)
        else:
            tokens.append(t)
            types.append(TOKEN_NORMAL)
    if len(vocab) > n_vocab:
        raise GGUFError(f"tokenizer has {len(vocab)} tokens, the model {n_vocab}")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
    }


def _pre_name(pre: Mapping[str, Any]) -> str | None:
    """llama.cpp's name of a ``tokenizer.json`` byte-level pre-tokenizer, if it has one."""
    if pre.get("type") == "ByteLevel":
        return "gpt-2" if pre.get("use_regex", True) else None
    if pre.get("type") != "Sequence":
        return None
    steps = pre.get("pretokenizers") or []
    if len(steps) < 2 or steps[-1].get("type") != "ByteLevel" or steps[-1].get("use_regex"):
        return None
    rxs = []
    for split in steps[:-1]:
        if split.get("type") != "Split" or split.get("behavior") != "Isolated":
            return None
        if split.get("invert"):
            return None
        rxs.append((split.get("pattern") or {}).get("Regex"))
    return next((name for name in PRE_REGEX if _regexes(name) == tuple(rxs)), None)


def _regexes(pre: str) -> tuple[str, ...]:
    rx = PRE_REGEX[pre]
    return (rx,) if isinstance(rx, str) else rx


def _spm_fields(data: Mapping[str, Any], model: Mapping[str, Any], n_vocab: int) -> dict:
    """GGUF ``llama`` vocabulary of a sentencepiece-style BPE ``tokenizer.json``.

    Scores: a piece made by a merge scores ``-rank`` of its first merge (the
    order llama.cpp's highest-score-first merging needs); other pieces 0.
    """
    norm = json.dumps(data.get("normalizer"), ensure_ascii=False)
    if METASPACE not in norm:
        raise UnsupportedGGUFError("a byte-fallback BPE tokenizer without metaspace normalizer")
    vocab: dict[str, int] = dict(model["vocab"])
    added = {a["content"]: a for a in data.get("added_tokens") or []}
    for a in added.values():
        vocab[a["content"]] = int(a["id"])
    if len(vocab) > n_vocab:
        raise GGUFError(f"tokenizer has {len(vocab)} tokens, the model {n_vocab}")
    rank: dict[str, int] = {}
    for i, m in enumerate(model.get("merges") or []):
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        rank.setdefault(a + b, i)
    by_id = {i: t for t, i in vocab.items()}
    unk = model.get("unk_token")
    tokens, scores, types = [], [], []
    for i in range(n_vocab):
        t = by_id.get(i)
        if t is None:
            tokens.append(f"[PAD{i}]")
            scores.append(-1e9)
            types.append(TOKEN_UNUSED)
            continue
        tokens.append(t)
        scores.append(-float(rank[t]) if t in rank else 0.0)
        if t in added and t != unk:
            types.append(TOKEN_CONTROL if added[t].get("special") else TOKEN_USER_DEFINED)
        elif t == unk:
            types.append(2)
        elif re.fullmatch(r"<0x[0-9A-F]{2}>", t):
            types.append(TOKEN_BYTE)
        else:
            types.append(TOKEN_NORMAL)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.add_space_prefix": "Prepend" in norm,
        "tokenizer.ggml.unknown_token_id": vocab.get(unk),
    }
