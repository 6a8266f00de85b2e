"""Per-architecture tables: Hugging Face tensor names -> trunk roles and expert parts.

Scope: naming only. Each supported architecture (Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE, DeepSeek-V2/V3) gets an :class:`ArchSpec` that

* classifies every tensor name of its checkpoints as a trunk tensor
  ``(role, layer)`` (roles are the architecture-neutral names of
  :mod:`store.consumer`, plus the MLA roles below), a per-expert tensor
  ``(layer, expert, gate|up|down)``, or a fused stacked expert tensor
  ``(layer, gate_up|down)``;
* reads the numbers mount needs from ``config.json`` (layers, routed
  experts, hidden and expert intermediate size, which layers are sparse).

Both expert layouts are recognised. Per-expert: Mixtral's
``block_sparse_moe.experts.N.w1/w3/w2`` and the ``mlp.experts.N.gate_proj /
up_proj / down_proj`` of the others. Fused: ``experts.gate_up_proj [E, 2I, H]``
(gate rows first, then up rows) and ``experts.down_proj [E, H, I]``, the
in-memory layout of transformers 5.x (its ``save_pretrained`` converts back to
per-expert tensors, but fused files load in transformers as they are).
A name no table knows is not guessed at: :func:`classify` returns ``None`` and
the caller fails closed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from czyx.store.consumer import GLOBAL_ROLES, LAYER_ROLES, ArchFacts
from czyx.store.models.mount_errors import UnknownArchitectureError

# Roles of DeepSeek's multi-head latent attention and its routing bias (also
# GLM-4.5's e_score_correction_bias, and GPT-OSS's router bias). They are not in
# the consumer contract's role list; the engine's MLA decoder reads them by name.
MLA_ROLES = (
    "q_a_proj",  # [q_lora_rank, H]
    "q_a_norm",  # [q_lora_rank]
    "q_b_proj",  # [n_heads * qk_head_dim, q_lora_rank]
    "kv_a_proj",  # [kv_lora_rank + qk_rope_head_dim, H]
    "kv_a_norm",  # [kv_lora_rank]
    "kv_b_proj",  # [n_heads * (qk_nope + v_head_dim), kv_lora_rank]
    "router_bias",  # [E] DeepSeek-V3 e_score_correction_bias
)
# Roles of the other newer architectures, appended so every earlier role keeps
# its class byte (mounted trunks stay readable). Global ones are appended here too
# (and listed in NEWER_GLOBAL_ROLES): a role added later never moves their bytes.
NEWER_ROLES = (
    "o_bias",  # [H] o_proj bias (Qwen3-MoE attention_bias, GPT-OSS)
    "sinks",  # [n_heads] GPT-OSS attention sink logits
    "expert_gate_up_bias",  # [E, 2I] GPT-OSS routed experts' gate/up biases (gate, then up)
    "expert_down_bias",  # [E, H] GPT-OSS routed experts' down biases
    "mtp",  # a multi-token-prediction layer's tensor: kept verbatim (a draft head, not the model)
    "input_norm_bias",  # [H] PhiMoE's LayerNorm biases
    "post_attn_norm_bias",  # [H]
    "final_norm_bias",  # [H] (global) PhiMoE's final LayerNorm bias
    "lm_head_bias",  # [V] (global) PhiMoE's lm_head bias
    "shared_gate_up_proj",  # [2I, H] GraniteMoeShared's shared MLP input (gate rows, then up)
    # Qwen3-Next's gated-DeltaNet linear-attention layers (their out_proj is the o_proj role).
    "lin_qkvz",  # [2 * key_dim + 2 * value_dim, H] in_proj_qkvz (per key-head groups)
    "lin_ba",  # [2 * n_v_heads, H] in_proj_ba (beta and decay inputs, per key-head groups)
    "lin_conv",  # [key_dim * 2 + value_dim, 1, kernel] depthwise causal conv1d
    "lin_dt_bias",  # [n_v_heads]
    "lin_a_log",  # [n_v_heads]
    "lin_norm",  # [value_head_dim] the gated RMS norm's weight
    # Jamba's Mamba layers (their out_proj is the o_proj role); I = mamba_expand * H.
    "mamba_in_proj",  # [2 * I, H] (x, then the gate z)
    "mamba_conv",  # [I, 1, d_conv] depthwise causal conv1d
    "mamba_conv_bias",  # [I]
    "mamba_x_proj",  # [dt_rank + 2 * d_state, I]
    "mamba_dt_proj",  # [I, dt_rank]
    "mamba_dt_bias",  # [I]
    "mamba_a_log",  # [I, d_state]
    "mamba_d",  # [I]
    "mamba_dt_norm",  # [dt_rank]
    "mamba_b_norm",  # [d_state]
    "mamba_c_norm",  # [d_state]
    # llama.cpp's ssm_a of a GGUF source, A = -exp(A_log) as the file holds it (held
    # instead of A_log: the decoders use A directly, and an export writes it back as is).
    "lin_neg_a",  # [n_v_heads]
    "mamba_neg_a",  # [I, d_state]
    # (global) a GGUF's rope_freqs: llama.cpp's per-frequency rope factors (rope type
    # store.models.rope.FREQ_FACTORS), held as the file has them; no transformers tensor
    "rope_freqs",  # [rotary_dim // 2]
)
#: The roles only a linear-attention (gated DeltaNet) layer has.
LINEAR_ATTN_ROLES = ("lin_qkvz", "lin_ba", "lin_conv", "lin_dt_bias", "lin_a_log", "lin_norm")
#: Qwen3-Next's roles whose RMS norm scales by ``1 + weight`` (all but the DeltaNet's own).
ONE_PLUS_ROLES = frozenset({"input_norm", "post_attn_norm", "final_norm", "q_norm", "k_norm"})
#: A config key set (true) on a Qwen3-Next version read from GGUF: its :data:`ONE_PLUS_ROLES`
#: weights are stored as llama.cpp's file holds them, ``1 + w`` (``(1 + w) - 1`` is not exact
#: in float32 below 0.5, so they are kept as they are: the decoder adds no 1, an export
#: writes them back byte for byte).
NORMS_HOLD_ONE_PLUS = "czyx_norms_hold_one_plus"
#: The roles only a Mamba (selective state space) layer has.
MAMBA_ROLES = (
    "mamba_in_proj",
    "mamba_conv",
    "mamba_conv_bias",
    "mamba_x_proj",
    "mamba_dt_proj",
    "mamba_dt_bias",
    "mamba_a_log",
    "mamba_d",
    "mamba_dt_norm",
    "mamba_b_norm",
    "mamba_c_norm",
)
#: The global roles among NEWER_ROLES (layer None).
NEWER_GLOBAL_ROLES = ("final_norm_bias", "lm_head_bias", "rope_freqs")
#: Per-layer roles beyond the consumer contract's (the engine's Layer has a slot each).
EXTRA_ROLES = MLA_ROLES + tuple(r for r in NEWER_ROLES if r not in NEWER_GLOBAL_ROLES)
#: The role of kept multi-token-prediction tensors (layer = their index in name order).
MTP_ROLE = "mtp"
ALL_GLOBAL_ROLES = GLOBAL_ROLES + NEWER_GLOBAL_ROLES
ALL_LAYER_ROLES = LAYER_ROLES + EXTRA_ROLES
#: Every role in class-byte order: each list appended to, never reordered.
ALL_ROLES = GLOBAL_ROLES + LAYER_ROLES + MLA_ROLES + NEWER_ROLES
# A role's index is its class byte in the trunk space (see store.mount).
ROLE_INDEX = {role: i for i, role in enumerate(ALL_ROLES)}
# The checkpoint's tokenizer.json, when it has one, is a trunk record too, at a
# class no tensor role uses.
TOKENIZER_ROLE = "tokenizer"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CLASS = 0xF0
assert len(ALL_ROLES) <= TOKENIZER_CLASS
#: Other text files of a checkpoint kept the same way, so export writes them back and
#: the server finds the chat template: file name -> (role, class byte). Recorded in the
#: trunk manifest under "side_files" (so only checkpoints that have them change content).
#: transformers 5 saves a tokenizer's chat template to chat_template.jinja (and leaves it
#: out of tokenizer_config.json); loading, it prefers that file to the config's template.
SIDE_FILES = {
    "chat_template.jinja": ("chat_template", 0xF3),
    "generation_config.json": ("generation_config", 0xF1),
    "tokenizer_config.json": ("tokenizer_config", 0xF2),
}
#: Trunk roles that are files, not tensors: never run, never a tensor on export.
FILE_ROLES = frozenset({TOKENIZER_ROLE, *(role for role, _ in SIDE_FILES.values())})
#: Largest side file read at mount (a bound before allocating; real ones are kilobytes).
SIDE_FILE_MAX = 16 << 20

EXPERT_PARTS = ("gate", "up", "down")
FUSED_PARTS = ("gate_up", "down")


@dataclass(frozen=True)
class TensorKind:
    """What one checkpoint tensor is.

    ``kind`` is ``"trunk"`` (``role``, ``layer``; layer is None for global
    roles), ``"expert"`` (``layer``, ``expert``, ``part`` in gate/up/down) or
    ``"fused"`` (``layer``, ``part`` in gate_up/down; all experts of a layer).
    """

    kind: str
    layer: int | None = None
    role: str | None = None
    expert: int | None = None
    part: str | None = None


_L = r"model\.layers\.(\d+)\."
_LAYER_PREFIX = re.compile(_L)

# Trunk fragments shared by the tables: (regex after the layer prefix, role).
_GLOBAL = (
    (r"model\.embed_tokens\.weight", "embed"),
    (r"model\.(?:norm|final_layernorm)\.weight", "final_norm"),  # Jamba: final_layernorm
    (r"lm_head\.weight", "lm_head"),
)
_NORMS = (
    (r"input_layernorm\.weight", "input_norm"),
    (r"post_attention_layernorm\.weight", "post_attn_norm"),
)
_ATTN = (
    (r"self_attn\.q_proj\.weight", "q_proj"),
    (r"self_attn\.k_proj\.weight", "k_proj"),
    (r"self_attn\.v_proj\.weight", "v_proj"),
    (r"self_attn\.o_proj\.weight", "o_proj"),
)
_QKV_BIAS = (
    (r"self_attn\.q_proj\.bias", "q_bias"),
    (r"self_attn\.k_proj\.bias", "k_bias"),
    (r"self_attn\.v_proj\.bias", "v_bias"),
)
_O_BIAS = ((r"self_attn\.o_proj\.bias", "o_bias"),)
_GPT_OSS = (
    (r"self_attn\.sinks", "sinks"),
    (r"mlp\.router\.weight", "router"),
    (r"mlp\.router\.bias", "router_bias"),
    (r"mlp\.experts\.gate_up_proj_bias", "expert_gate_up_bias"),
    (r"mlp\.experts\.down_proj_bias", "expert_down_bias"),
)
# save_pretrained writes mlp.moe_statics.*; the in-memory module is mlp.gate.moe_statics.*
_ERNIE_BIAS = ((r"mlp\.(?:gate\.)?moe_statics\.e_score_correction_bias", "router_bias"),)
_HUNYUAN = (
    (r"self_attn\.query_layernorm\.weight", "q_norm"),
    (r"self_attn\.key_layernorm\.weight", "k_norm"),
    (r"mlp\.gate\.wg\.weight", "router"),
    (r"mlp\.shared_mlp\.gate_proj\.weight", "shared_gate_proj"),
    (r"mlp\.shared_mlp\.up_proj\.weight", "shared_up_proj"),
    (r"mlp\.shared_mlp\.down_proj\.weight", "shared_down_proj"),
)
_NO_PER_EXPERT = re.compile(r"(?!)")  # GPT-OSS has only stacked expert tensors
# PhiMoE: LayerNorms with biases, a biased lm_head; save_pretrained writes Mixtral's
# block_sparse_moe.gate / experts.N.w1|w3|w2 names, memory holds mlp.router / mlp.experts.
_PHIMOE = (
    (r"input_layernorm\.bias", "input_norm_bias"),
    (r"post_attention_layernorm\.bias", "post_attn_norm_bias"),
    (r"(?:block_sparse_moe|mlp)\.gate\.weight", "router"),
    (r"mlp\.router\.weight", "router"),
)
_PHIMOE_GLOBAL = ((r"model\.norm\.bias", "final_norm_bias"), (r"lm_head\.bias", "lm_head_bias"))
# Hunyuan-V3 MoE block: in memory (the state dict) and as save_pretrained writes it.
_HY_V3 = (
    (r"mlp\.(?:router\.)?gate\.weight", "router"),
    (r"mlp\.(?:e_score_correction_bias|expert_bias)", "router_bias"),
    (r"mlp\.shared_(?:experts|mlp)\.gate_proj\.weight", "shared_gate_proj"),
    (r"mlp\.shared_(?:experts|mlp)\.up_proj\.weight", "shared_up_proj"),
    (r"mlp\.shared_(?:experts|mlp)\.down_proj\.weight", "shared_down_proj"),
)
#: czyx's tensor name of a GGUF's ``rope_freqs.weight`` (role ``rope_freqs``): no
#: transformers checkpoint has it, a GGUF source is read as one that does.
ROPE_FREQS_NAME = "model.rope_freqs"
# Llama 4 text: everything MLP-side under feed_forward (its experts only stacked).
_LLAMA4 = (
    (r"feed_forward\.router\.weight", "router"),
    (r"feed_forward\.shared_expert\.gate_proj\.weight", "shared_gate_proj"),
    (r"feed_forward\.shared_expert\.up_proj\.weight", "shared_up_proj"),
    (r"feed_forward\.shared_expert\.down_proj\.weight", "shared_down_proj"),
    (r"feed_forward\.gate_proj\.weight", "mlp_gate_proj"),
    (r"feed_forward\.up_proj\.weight", "mlp_up_proj"),
    (r"feed_forward\.down_proj\.weight", "mlp_down_proj"),
)
_QK_NORM = (
    (r"self_attn\.q_norm\.weight", "q_norm"),
    (r"self_attn\.k_norm\.weight", "k_norm"),
)
_MLA = (
    (r"self_attn\.q_proj\.weight", "q_proj"),  # DeepSeek-V2-Lite: no q LoRA
    (r"self_attn\.q_a_proj\.weight", "q_a_proj"),
    (r"self_attn\.q_a_layernorm\.weight", "q_a_norm"),
    (r"self_attn\.q_b_proj\.weight", "q_b_proj"),
    (r"self_attn\.kv_a_proj_with_mqa\.weight", "kv_a_proj"),
    (r"self_attn\.kv_a_layernorm\.weight", "kv_a_norm"),
    (r"self_attn\.kv_b_proj\.weight", "kv_b_proj"),
    (r"self_attn\.o_proj\.weight", "o_proj"),
)
_ROUTER = ((r"mlp\.gate\.weight", "router"),)
_GATED_DELTANET = (
    (r"linear_attn\.in_proj_qkvz\.weight", "lin_qkvz"),
    (r"linear_attn\.in_proj_ba\.weight", "lin_ba"),
    (r"linear_attn\.conv1d\.weight", "lin_conv"),
    (r"linear_attn\.dt_bias", "lin_dt_bias"),
    (r"linear_attn\.A_log", "lin_a_log"),
    (r"linear_attn\.ssm_a", "lin_neg_a"),  # (a GGUF source's -exp(A_log))
    (r"linear_attn\.norm\.weight", "lin_norm"),
    (r"linear_attn\.out_proj\.weight", "o_proj"),
)
_JAMBA = (
    (r"input_layernorm\.weight", "input_norm"),
    (r"pre_ff_layernorm\.weight", "post_attn_norm"),
    (r"mamba\.in_proj\.weight", "mamba_in_proj"),
    (r"mamba\.conv1d\.weight", "mamba_conv"),
    (r"mamba\.conv1d\.bias", "mamba_conv_bias"),
    (r"mamba\.x_proj\.weight", "mamba_x_proj"),
    (r"mamba\.dt_proj\.weight", "mamba_dt_proj"),
    (r"mamba\.dt_proj\.bias", "mamba_dt_bias"),
    (r"mamba\.A_log", "mamba_a_log"),
    (r"mamba\.ssm_a", "mamba_neg_a"),  # (a GGUF source's -exp(A_log))
    (r"mamba\.D", "mamba_d"),
    (r"mamba\.dt_layernorm\.weight", "mamba_dt_norm"),
    (r"mamba\.b_layernorm\.weight", "mamba_b_norm"),
    (r"mamba\.c_layernorm\.weight", "mamba_c_norm"),
    (r"mamba\.out_proj\.weight", "o_proj"),
    (r"feed_forward\.router\.weight", "router"),
    (r"feed_forward\.gate_proj\.weight", "mlp_gate_proj"),
    (r"feed_forward\.up_proj\.weight", "mlp_up_proj"),
    (r"feed_forward\.down_proj\.weight", "mlp_down_proj"),
)
_MIXTRAL_ROUTER = ((r"(?:block_sparse_moe|mlp)\.gate\.weight", "router"),)
_QWEN2_SHARED = (
    (r"mlp\.shared_expert\.gate_proj\.weight", "shared_gate_proj"),
    (r"mlp\.shared_expert\.up_proj\.weight", "shared_up_proj"),
    (r"mlp\.shared_expert\.down_proj\.weight", "shared_down_proj"),
    (r"mlp\.shared_expert_gate\.weight", "shared_expert_gate"),
)
_DEEPSEEK_SHARED = (
    (r"mlp\.shared_experts\.gate_proj\.weight", "shared_gate_proj"),
    (r"mlp\.shared_experts\.up_proj\.weight", "shared_up_proj"),
    (r"mlp\.shared_experts\.down_proj\.weight", "shared_down_proj"),
    (r"mlp\.gate\.e_score_correction_bias", "router_bias"),
)
_DENSE_MLP = (
    (r"mlp\.gate_proj\.weight", "mlp_gate_proj"),
    (r"mlp\.up_proj\.weight", "mlp_up_proj"),
    (r"mlp\.down_proj\.weight", "mlp_down_proj"),
)

# Expert name patterns: groups (layer, expert, part-token).
_EXPERT_MIXTRAL = re.compile(_L + r"(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w3|w2)\.weight")
_EXPERT_PROJ = re.compile(_L + r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_EXPERT_JAMBA = re.compile(
    _L + r"feed_forward\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight"
)
_FUSED = re.compile(
    _L + r"(?:block_sparse_moe|mlp|feed_forward)\.experts\.(gate_up_proj|down_proj)(?:\.weight)?"
)
# GraniteMoE's saved names for its stacked experts (gate then up rows, as the contract).
_FUSED_GRANITE = re.compile(_L + r"block_sparse_moe\.(input_linear|output_linear)\.weight")
_GRANITE_PART = {"input_linear": "gate_up", "output_linear": "down"}
_PART = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up"}
_PART["down_proj"] = "down"


@dataclass(frozen=True)
class ArchSpec:
    """The naming table and config accessors of one architecture family.

    Parameters
    ----------
    name
        The czyx architecture name (``ModelInfo.arch``).
    model_types
        ``config.json`` ``model_type`` values that select this spec.
    layer_trunk
        ``(regex, role)`` pairs matched after ``model.layers.N.``.
    expert_pattern
        Regex of per-expert tensor names (groups: layer, expert, part token).
    n_experts_keys, expert_inter_keys
        ``config.json`` keys tried in order for the routed expert count and
        the expert intermediate size.
    expert_transform
        ``None``: fused experts are ``gate_up [E, 2I, H]`` / ``down [E, H, I]``.
        Otherwise the name of a :mod:`store.models.expert_transform` layout
        (GPT-OSS: transposed, gate and up interleaved).
    """

    name: str
    model_types: tuple[str, ...]
    layer_trunk: tuple[tuple[str, str], ...]
    expert_pattern: re.Pattern[str]
    n_experts_keys: tuple[str, ...]
    expert_inter_keys: tuple[str, ...]
    expert_transform: str | None = None
    global_trunk: tuple[tuple[str, str], ...] = ()
    fused_pattern: re.Pattern[str] | None = None

    def __post_init__(self) -> None:
        # One compiled alternation per table: classification is a single match
        # instead of a loop over patterns (mount classifies every tensor once).
        globals_ = "|".join(f"(?P<g{i}>{rx})" for i, (rx, _) in enumerate(self.globals))
        layers = "|".join(f"(?P<l{i}>{rx})" for i, (rx, _) in enumerate(self.layer_trunk))
        object.__setattr__(self, "_global_rx", re.compile(globals_))
        object.__setattr__(self, "_layer_rx", re.compile(_L + f"(?:{layers})"))

    @property
    def globals(self) -> tuple[tuple[str, str], ...]:
        """``(regex, role)`` of the global tensors: the shared ones plus the family's own."""
        return _GLOBAL + self.global_trunk

    def classify(self, name: str) -> TensorKind | None:
        """Classify one tensor name; ``None`` if this table does not know it."""
        m = self._global_rx.fullmatch(name)  # type: ignore[attr-defined]
        if m:
            return TensorKind("trunk", None, self.globals[int(m.lastgroup[1:])][1])
        m = self._layer_rx.fullmatch(name)  # type: ignore[attr-defined]
        if m:
            return TensorKind("trunk", int(m.group(1)), self.layer_trunk[int(m.lastgroup[1:])][1])
        m = self.expert_pattern.fullmatch(name)
        if m:
            return TensorKind("expert", int(m.group(1)), expert=int(m.group(2)), part=_PART[m[3]])
        m = (self.fused_pattern or _FUSED).fullmatch(name)
        if m:
            return TensorKind("fused", int(m.group(1)), part=m.group(2).removesuffix("_proj"))
        granite = self.name in ("granitemoe", "granitemoeshared")
        m = _FUSED_GRANITE.fullmatch(name) if granite else None
        if m:
            return TensorKind("fused", int(m.group(1)), part=_GRANITE_PART[m.group(2)])
        return None

    def n_layers(self, config: Mapping[str, Any]) -> int:
        """Number of decoder layers."""
        return int(_require(config, ("num_hidden_layers",), self.name))

    def n_experts(self, config: Mapping[str, Any]) -> int:
        """Number of routed experts per sparse layer."""
        return int(_require(config, self.n_experts_keys, self.name))

    def hidden_size(self, config: Mapping[str, Any]) -> int:
        """Model width H."""
        return int(_require(config, ("hidden_size",), self.name))

    def expert_intermediate(self, config: Mapping[str, Any]) -> int:
        """Intermediate size I of one routed expert."""
        return int(_require(config, self.expert_inter_keys, self.name))

    def mtp_layer(self, name: str, config: Mapping[str, Any]) -> int | None:
        """The layer of ``name`` if it belongs to a multi-token-prediction layer, else None.

        DeepSeek-V3 and GLM-4.5 checkpoints append ``num_nextn_predict_layers``
        layers after the last decoder layer (``model.layers.<num_hidden_layers>.*``:
        a full decoder layer plus ``enorm``, ``hnorm``, ``eh_proj`` and a
        ``shared_head``). transformers ignores them; mount keeps them verbatim.
        """
        if self.name == "qwen3_next" and name.startswith("mtp."):
            return 0  # Qwen3-Next keeps its MTP module apart (mtp.*), also ignored by transformers
        extra = int(config.get("num_nextn_predict_layers") or 0)
        m = _LAYER_PREFIX.match(name) if extra > 0 else None
        if m is None:
            return None
        layer, n = int(m.group(1)), self.n_layers(config)
        return layer if n <= layer < n + extra else None

    def rope_head_dim(self, config: Mapping[str, Any]) -> int:
        """Width of the head part that carries the rotary channels.

        DeepSeek's multi-head latent attention rotates only ``qk_rope_head_dim``
        channels per head; every other family rotates (a fraction of) ``head_dim``.
        """
        if self.name in ("deepseek_v2", "deepseek_v3"):
            return int(_require(config, ("qk_rope_head_dim",), self.name))
        hidden = self.hidden_size(config)
        heads = int(_require(config, ("num_attention_heads",), self.name))
        return int(config.get("head_dim") or hidden // heads)

    def sparse_layers(self, config: Mapping[str, Any]) -> tuple[int, ...]:
        """Layers whose MLP is a routed mixture (the others are dense)."""
        n = self.n_layers(config)
        if self.name in ("qwen2_moe", "qwen3_moe", "qwen3_next"):
            step = int(config.get("decoder_sparse_step") or 1)
            dense = set(config.get("mlp_only_layers") or ())
            return tuple(l for l in range(n) if l not in dense and (l + 1) % step == 0)
        if self.name == "ernie4_5_moe":
            step = int(config.get("moe_layer_interval") or 1)
            first = int(config.get("moe_layer_start_index") or 0)
            last = config.get("moe_layer_end_index")
            last = n - 1 if last is None or int(last) < 0 else int(last)
            return tuple(l for l in range(n) if (l + 1) % step == 0 and first <= l <= last)
        if self.name == "jamba":
            period = int(config.get("expert_layer_period") or 2)
            offset = config.get("expert_layer_offset")
            offset = 1 if offset is None else int(offset)  # transformers' default
            return tuple(l for l in range(n) if l % period == offset)
        if self.name in ("glm4_moe", "dots1"):
            first = int(config.get("first_k_dense_replace") or 0)
            return tuple(range(first, n))
        listed = ("deepseek_v2", "deepseek_v3", "hy_v3", "exaone_moe")
        if self.name in listed and config.get("mlp_layer_types"):
            return _listed_sparse(config["mlp_layer_types"], n, self.name)
        if self.name in ("deepseek_v2", "deepseek_v3"):
            first = int(config.get("first_k_dense_replace") or 0)
            freq = int(config.get("moe_layer_freq") or 1)
            return tuple(l for l in range(n) if l >= first and l % freq == 0)
        if self.name == "llama4_text":
            return llama4_moe_layers(config, n)
        return tuple(range(n))


def _listed_sparse(types: Any, n: int, arch: str) -> tuple[int, ...]:
    """The sparse layers of an ``mlp_layer_types`` list (GLM-4.5-Lite: "dense"/"sparse")."""
    if not isinstance(types, list) or len(types) != n or not set(types) <= {"dense", "sparse"}:
        raise UnknownArchitectureError(f"config.json of {arch}: mlp_layer_types={types!r:.60}")
    return tuple(i for i, t in enumerate(types) if t == "sparse")


def llama4_moe_layers(config: Mapping[str, Any], n: int) -> tuple[int, ...]:
    """Llama 4's MoE layers: ``moe_layers`` as the config lists them, else every
    ``interleave_moe_layer_step``-th layer (transformers' ``Llama4TextConfig``)."""
    listed = config.get("moe_layers")
    if listed is None:
        step = int(config.get("interleave_moe_layer_step") or 1)
        return tuple(range(step - 1, n, step))
    if not isinstance(listed, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) and 0 <= x < n for x in listed
    ):
        raise UnknownArchitectureError(f"config.json of llama4_text: moe_layers={listed!r:.60}")
    return tuple(sorted(set(listed)))


def arch_facts(arch: str, config: Mapping[str, Any]) -> ArchFacts:
    """The normalised :class:`~czyx.store.consumer.ArchFacts` of ``config`` for family ``arch``.

    Raises
    ------
    UnknownArchitectureError
        ``arch`` is not in :data:`ARCHS`, or the config lacks a required key.
    """
    spec = ARCHS.get(arch)
    if spec is None:
        raise UnknownArchitectureError(f"architecture {arch!r} is not one of {sorted(ARCHS)}")
    return ArchFacts(
        n_layers=spec.n_layers(config),
        n_experts=spec.n_experts(config),
        hidden_size=spec.hidden_size(config),
        expert_intermediate=spec.expert_intermediate(config),
        sparse_layers=spec.sparse_layers(config),
    )


def _require(config: Mapping[str, Any], keys: tuple[str, ...], arch: str) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    raise UnknownArchitectureError(f"config.json of {arch}: missing {' or '.join(keys)}")


_QWEN_EXPERT_KEYS = ("num_experts", "num_local_experts")

ARCHS: dict[str, ArchSpec] = {
    spec.name: spec
    for spec in (
        ArchSpec(
            "mixtral",
            ("mixtral",),
            _NORMS + _ATTN + _MIXTRAL_ROUTER,
            _EXPERT_MIXTRAL,
            ("num_local_experts",),
            ("intermediate_size",),
        ),
        ArchSpec(
            "qwen2_moe",
            ("qwen2_moe",),
            _NORMS + _ATTN + _QKV_BIAS + _ROUTER + _QWEN2_SHARED + _DENSE_MLP,
            _EXPERT_PROJ,
            _QWEN_EXPERT_KEYS,
            ("moe_intermediate_size",),
        ),
        ArchSpec(
            "qwen3_moe",
            ("qwen3_moe",),
            _NORMS + _ATTN + _QKV_BIAS + _O_BIAS + _QK_NORM + _ROUTER + _DENSE_MLP,
            _EXPERT_PROJ,
            _QWEN_EXPERT_KEYS,
            ("moe_intermediate_size",),
        ),
        ArchSpec(
            "qwen3_next",
            ("qwen3_next",),
            _NORMS + _ATTN + _QK_NORM + _GATED_DELTANET + _ROUTER + _QWEN2_SHARED + _DENSE_MLP,
            _EXPERT_PROJ,
            ("num_experts",),
            ("moe_intermediate_size",),
        ),
        ArchSpec(
            "jamba",
            ("jamba",),
            _ATTN + _JAMBA,
            _EXPERT_JAMBA,
            ("num_experts",),
            ("intermediate_size",),
        ),
        ArchSpec(
            "olmoe",
            ("olmoe",),
            _NORMS + _ATTN + _QK_NORM + _ROUTER,
            _EXPERT_PROJ,
            ("num_experts", "num_local_experts"),
            ("intermediate_size",),
        ),
        ArchSpec(
            "deepseek_v2",
            ("deepseek_v2",),
            _NORMS + _MLA + _ROUTER + _DEEPSEEK_SHARED + _DENSE_MLP,
            _EXPERT_PROJ,
            ("n_routed_experts",),
            ("moe_intermediate_size",),
        ),
        ArchSpec(
            "deepseek_v3",
            # Sarvam-MLA is DeepseekV3ForCausalLM; GLM-4.5-Lite the same layers with the
            # dense ones listed in mlp_layer_types.
            ("deepseek_v3", "sarvam_mla", "glm4_moe_lite"),
            _NORMS + _MLA + _ROUTER + _DEEPSEEK_SHARED + _DENSE_MLP,
            _EXPERT_PROJ,
            ("n_routed_experts",),
            ("moe_intermediate_size",),
        ),
        ArchSpec(
            "gpt_oss",
            ("gpt_oss",),
            _NORMS + _ATTN + _QKV_BIAS + _O_BIAS + _GPT_OSS,
            _NO_PER_EXPERT,
            ("num_local_experts",),
            ("intermediate_size",),
            "gate_up_t_interleaved",
        ),
        ArchSpec(
            "ernie4_5_moe",
            ("ernie4_5_moe",),
            _NORMS
            + _ATTN
            + _QKV_BIAS
            + _O_BIAS
            + _ROUTER
            + _ERNIE_BIAS
            + _DEEPSEEK_SHARED[:3]
            + _DENSE_MLP,
            _EXPERT_PROJ,
            ("moe_num_experts", "num_experts"),
            ("moe_intermediate_size",),
        ),
        ArchSpec(
            "granitemoe",
            ("granitemoe",),
            _NORMS + _ATTN + ((r"block_sparse_moe\.router(?:\.layer)?\.weight", "router"),),
            _NO_PER_EXPERT,
            ("num_local_experts",),
            ("intermediate_size",),
        ),
        # MiniMax-M2: OLMo-2-style full-width q/k norms, Mixtral's expert names, a
        # sigmoid router with DeepSeek-V3's selection bias (one group, renormalised).
        ArchSpec(
            "minimax_m2",
            ("minimax_m2",),
            _NORMS
            + _ATTN
            + _QK_NORM
            + _MIXTRAL_ROUTER
            + ((r"(?:block_sparse_moe|mlp)\.e_score_correction_bias", "router_bias"),),
            _EXPERT_MIXTRAL,
            ("num_local_experts",),
            ("intermediate_size",),
        ),
        # Hunyuan-V3 (hy_v3): dots1's attention (per-head q/k norms) on DeepSeek-V3-style
        # sigmoid routing with shared experts; save_pretrained renames the MoE tensors.
        ArchSpec(
            "hy_v3",
            ("hy_v3",),
            _NORMS + _ATTN + _QKV_BIAS + _O_BIAS + _QK_NORM + _DENSE_MLP + _HY_V3,
            _EXPERT_PROJ,
            ("num_experts", "num_local_experts"),
            ("moe_intermediate_size",),
        ),
        # EXAONE-MoE: EXAONE-4 attention (per-head q/k norms, NoPE full layers beside
        # sliding rope layers) on DeepSeek-V3 routing with shared experts.
        ArchSpec(
            "exaone_moe",
            ("exaone_moe",),
            _NORMS + _ATTN + _QK_NORM + _DENSE_MLP + _HY_V3 + _DEEPSEEK_SHARED[3:],
            _EXPERT_PROJ,
            ("num_experts", "num_local_experts"),
            ("moe_intermediate_size",),
        ),
        ArchSpec(
            "granitemoeshared",
            ("granitemoeshared",),
            _NORMS
            + _ATTN
            + (
                (r"block_sparse_moe\.router(?:\.layer)?\.weight", "router"),
                (r"shared_mlp\.input_linear\.weight", "shared_gate_up_proj"),
                (r"shared_mlp\.output_linear\.weight", "shared_down_proj"),
            ),
            _NO_PER_EXPERT,
            ("num_local_experts",),
            ("intermediate_size",),
        ),
        ArchSpec(
            "hunyuan_v1_moe",
            ("hunyuan_v1_moe",),
            _NORMS + _ATTN + _QKV_BIAS + _O_BIAS + _HUNYUAN,
            _EXPERT_PROJ,
            ("num_experts",),
            ("intermediate_size",),
        ),
        ArchSpec(
            "phimoe",
            ("phimoe",),
            _NORMS + _PHIMOE + _ATTN + _QKV_BIAS + _O_BIAS,
            _EXPERT_MIXTRAL,
            ("num_local_experts",),
            ("intermediate_size",),
            global_trunk=_PHIMOE_GLOBAL,
        ),
        ArchSpec(
            "llama4_text",
            ("llama4_text",),
            _NORMS + _ATTN + _QKV_BIAS + _O_BIAS + _LLAMA4,
            _EXPERT_JAMBA,  # (HF saves only stacks; a GGUF's experts read as these names)
            ("num_local_experts",),
            ("intermediate_size",),
            "gate_up_t",
            global_trunk=((re.escape(ROPE_FREQS_NAME), "rope_freqs"),),
            fused_pattern=re.compile(_L + r"feed_forward\.experts\.(gate_up_proj|down_proj)"),
        ),
        ArchSpec(
            "glm4_moe",
            ("glm4_moe",),
            _NORMS + _ATTN + _QKV_BIAS + _QK_NORM + _ROUTER + _DEEPSEEK_SHARED + _DENSE_MLP,
            _EXPERT_PROJ,
            ("n_routed_experts",),
            ("moe_intermediate_size",),
        ),
        # dots.llm1: Qwen3 attention (per-head q/k norms, sliding layers) on GLM-4.5's
        # (DeepSeek-V3's) MoE; Solar-Open: Llama attention on it, every layer MoE.
        ArchSpec(
            "dots1",
            ("dots1",),
            _NORMS
            + _ATTN
            + _QKV_BIAS
            + _O_BIAS
            + _QK_NORM
            + _ROUTER
            + _DEEPSEEK_SHARED
            + _DENSE_MLP,
            _EXPERT_PROJ,
            ("n_routed_experts",),
            ("moe_intermediate_size",),
        ),
        ArchSpec(
            "solar_open",
            ("solar_open",),
            _NORMS + _ATTN + _QKV_BIAS + _ROUTER + _DEEPSEEK_SHARED + _DENSE_MLP,
            _EXPERT_PROJ,
            ("n_routed_experts",),
            ("moe_intermediate_size",),
        ),
    )
}
_BY_MODEL_TYPE = {mt: spec for spec in ARCHS.values() for mt in spec.model_types}

#: MoE model types transformers has and czyx does not run, each with what it lacks: mount
#: refuses them with this reason (one line). tests/store/models/test_moe_coverage.py checks
#: that every MoE causal-LM model type of the installed transformers is either run
#: (:data:`ARCHS`) or listed here.
REFUSED_MOE: dict[str, str] = {
    # hybrid layers (linear attention, state-space or convolution mixers beside attention)
    "qwen3_5_moe": "mapping of Qwen3.5's tensor layout (its gated-DeltaNet hybrid runs as "
    "qwen3_next) and a vision tower",
    "qwen3_5_moe_text": "mapping of Qwen3.5's tensor layout (its gated-DeltaNet hybrid runs as "
    "qwen3_next)",
    "qwen4_exp": "gated-DeltaNet layers, a sparse-attention indexer, n-gram and per-layer "
    "embeddings (and a vision tower)",
    "qwen4_exp_text": "gated-DeltaNet layers, a sparse-attention indexer, n-gram and per-layer "
    "embeddings",
    "granitemoehybrid": "Mamba-2 state-space layers beside attention",
    "nemotron_h": "Mamba-2 state-space layers beside attention and MLP layers",
    "kimi_linear": "Kimi delta-attention (linear attention) layers beside MLA",
    "bailing_hybrid": "delta-attention (linear attention) layers beside attention",
    "lara_mini": "gated-DeltaNet linear-attention layers beside attention",
    "minimax": "lightning (linear) attention layers beside softmax attention",
    "lfm2_moe": "short-convolution mixer layers beside attention",
    "inkling_text": "short-convolution mixer layers",
    "inkling2_text": "short and dynamic short-convolution mixer layers",
    "inkling2_loop_text": "looped (weight-shared, repeated) layers and short-convolution mixers",
    # sparse attention (a learned indexer picks the keys) and other attention forms
    "deepseek_v32": "DeepSeek sparse attention (a lightning indexer selecting the keys)",
    "deepseek_v4": "hyper-connections, compressed sparse attention and hash routing",
    "glm_moe_dsa": "DeepSeek sparse attention (an indexer selecting the keys) on MLA",
    "axk2": "DeepSeek sparse attention (an indexer selecting the keys) and gated norms",
    "kolibri1_1": "sparse attention (an indexer selecting the keys)",
    "hy_v4": "hyper-connections and sparse attention (an indexer selecting the keys)",
    "dots3_note": "sparse attention (an indexer selecting the keys) and audio/vision towers",
    "dots3_note_text": "sparse attention (an indexer selecting the keys)",
    "minimax_m3_vl_text": "sparse attention (an indexer selecting the keys)",
    "jetmoe": "mixture-of-attention-heads (routed attention experts) and a biased "
    "parallel-expert MLP",
    "dbrx": "fused Wqkv attention with clip_qkv, LayerNorms without bias, and ffn.experts "
    "mlp.w1/v1/w2 tensors (no name table)",
    "doge": "dynamic-mask attention and cross-domain MoE (product-key expert embeddings)",
    "zaya": "compressed convolutional attention (CCA), an MLP router and residual scaling",
    "longcat_flash": "zero-computation experts, two attention blocks a layer and a "
    "shortcut-connected MoE",
    "flex_olmo": "OLMo-2 post-norm layers (norms after attention and MLP, none before)",
    "afmoe": "gated attention output (gate_proj), norms before and after the MLP, and "
    "its token-choice router",
    "beam": "gated attention output, norms before and after the MLP and residual re-use",
    "ergo": "fused qkv attention, per-expert norms, residual gates and sandwich norms",
    "laguna": "gated attention output (g_proj) and its router",
    "flint": "attention sinks on Qwen3-MoE attention",
    "mimo_v2_flash": "attention sinks and its sliding/full layer mix on GLM-4.5 routing",
    "granitemoe_swa": "attention sinks and sliding-window layers on GraniteMoE",
    "gemma4": "Gemma-4's MoE beside a dense MLP, per-layer embeddings and a vision tower",
    "gemma4_text": "Gemma-4's MoE beside a dense MLP and per-layer embeddings",
    "gemma4_assistant": "Gemma-4's MoE beside a dense MLP and per-layer embeddings",
    "cohere2_moe": "parallel attention and MoE from one norm, sliding/NoPE layer mix, "
    "logit scaling",
    "mellum": "Laguna-style decoder layers on Qwen3-MoE attention",
    "kolibri1": "EXAONE-4 attention and post-attention/post-MLP sandwich norms",
    "minicpm5_moe": "gated queries (q_gate_proj) and MiniCPM's embedding and depth scaling",
    "axk1": "RMSNorm on the MoE block's output (post_mlp_layernorm) on DeepSeek-V3 layers",
    "param2moe": "fused query_key_value and Bailing tensor names (renamed by transformers at load)",
    "sarvam_moe": "fused query_key_value and Bailing tensor names (renamed by transformers "
    "at load)",
    "aria_text": "Aria's grouped-GEMM experts (fc1/fc2) with shared experts",
    "llama4": "Llama-4 vision tower or multimodal wrapper (mount its llama4_text model)",
}


def arch_for_config(config: Mapping[str, Any]) -> ArchSpec:
    """The :class:`ArchSpec` selected by ``config["model_type"]``.

    Raises
    ------
    UnknownArchitectureError
        If ``model_type`` is absent or not one of the supported families.
    """
    model_type = config.get("model_type")
    spec = _BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    if spec is None and isinstance(model_type, str) and model_type in REFUSED_MOE:
        raise UnknownArchitectureError(
            f"config.json: model_type {model_type!r} is not supported: czyx has no "
            f"{REFUSED_MOE[model_type]}"
        )
    if spec is None:
        known = ", ".join(sorted(_BY_MODEL_TYPE))
        raise UnknownArchitectureError(
            f"config.json: model_type {model_type!r} is not a supported MoE architecture "
            f"(known: {known})"
        )
    return spec


def role_key_class(role: str) -> int:
    """The trunk-space class byte of ``role``; ``ValueError`` for an unknown role."""
    try:
        return ROLE_INDEX[role]
    except KeyError:
        raise ValueError(f"trunk role {role!r} is not one of {', '.join(ALL_ROLES)}") from None
