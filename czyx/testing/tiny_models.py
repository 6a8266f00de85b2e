"""Tiny MoE checkpoints built with transformers, for tests (shared with the engine tests).

``make_tiny_checkpoint(arch, path)`` builds a randomly initialised model of
one of the supported architectures with a tiny config and writes it as a
Hugging Face checkpoint directory. Nothing is downloaded.

``fused=None`` or ``False`` writes what ``save_pretrained`` writes
(transformers 5.x converts its fused in-memory experts back to per-expert
tensors on save); ``fused=True`` writes the in-memory state dict as it is,
with stacked ``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj
[E, H, I]``, which transformers also loads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ARCHES = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe",
    "ernie4_5_moe",
    "hunyuan_v1_moe",
    "qwen3_next",
    "jamba",
    "phimoe",
)
# Model types that are another architecture's transformers class under their own
# config class (mounted as that architecture), and small variants of one.
ALIASES = (
    "sarvam_mla",
    "glm4_moe_lite",
    "dots1",
    "solar_open",
    "granitemoeshared",
    "minimax_m2",
    "hy_v3",
    "exaone_moe",
)
# The architectures the numpy engine runs. GPT-OSS is not in ARCHES: its experts
# exist only stacked and transposed (store.models.expert_transform; Llama 4's too), and the
# store tests over ARCHES check the per-expert and contract-layout fused forms.
ENGINE_ARCHES = (*ARCHES, "gpt_oss", "granitemoe", "llama4_text", *ALIASES)

_COMMON: dict[str, Any] = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 96,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
_DEEPSEEK: dict[str, Any] = {
    "num_key_value_heads": 4,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4,
    "v_head_dim": 8,
    "n_group": 2,
    "topk_group": 1,
}
CONFIGS: dict[str, dict[str, Any]] = {
    "mixtral": {"intermediate_size": 24, "num_local_experts": 4},
    "qwen2_moe": {
        "intermediate_size": 48,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 40,
        "num_experts": 8,
    },
    "qwen3_moe": {
        "intermediate_size": 48,
        "moe_intermediate_size": 16,
        "head_dim": 8,
        "num_experts": 8,
    },
    "olmoe": {"intermediate_size": 16, "num_experts": 8, "eos_token_id": 1, "pad_token_id": 0},
    "deepseek_v2": _DEEPSEEK,
    "deepseek_v3": _DEEPSEEK,
    "glm4_moe": {
        "intermediate_size": 48,
        "moe_intermediate_size": 16,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 2,
        "topk_group": 1,
        "head_dim": 16,
        "use_qk_norm": True,
        "attention_bias": True,
    },
    "ernie4_5_moe": {
        "intermediate_size": 48,
        "moe_intermediate_size": 16,
        "num_experts": 8,
        "moe_num_shared_experts": 1,
        "moe_layer_start_index": 1,
        "eos_token_id": None,
        "bos_token_id": None,
        "pad_token_id": None,
    },
    "granitemoe": {
        "intermediate_size": 16,
        "num_local_experts": 8,
        "embedding_multiplier": 2.0,
        "attention_multiplier": 0.3,
        "residual_multiplier": 0.7,
        "logits_scaling": 1.5,
        "eos_token_id": None,
        "bos_token_id": None,
    },
    "sarvam_mla": _DEEPSEEK,
    "glm4_moe_lite": {k: v for k, v in _DEEPSEEK.items() if k != "first_k_dense_replace"},
    "dots1": {},  # filled below from glm4_moe's
    "solar_open": {},
    "hunyuan_v1_moe": {
        "intermediate_size": 16,
        "num_experts": 8,
        "moe_topk": 2,
        "head_dim": 8,
        "attention_bias": True,
        "eos_token_id": None,
        "bos_token_id": None,
        "pad_token_id": None,
    },
    # Hybrid: three gated-DeltaNet layers, then one gated-attention layer (rotary on a
    # quarter of each 16-wide head).
    "qwen3_next": {
        "num_hidden_layers": 4,
        "intermediate_size": 48,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 24,
        "num_experts": 8,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4,
        "eos_token_id": None,
        "bos_token_id": None,
        "pad_token_id": None,
    },
    # Hybrid: Mamba layers 0, 1, 3 and attention layer 2; experts in layers 1 and 3.
    "jamba": {
        "num_hidden_layers": 4,
        "intermediate_size": 24,
        "num_experts": 8,
        "attn_layer_period": 4,
        "attn_layer_offset": 2,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "mamba_d_state": 8,
        "mamba_dt_rank": 4,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "eos_token_id": None,
        "bos_token_id": None,
        "pad_token_id": None,
    },
    "phimoe": {
        "intermediate_size": 16,
        "num_local_experts": 8,
        "attention_bias": True,
        "lm_head_bias": True,
        "router_jitter_noise": 0.3,
        "eos_token_id": None,
        "bos_token_id": None,
    },
    # Two MoE layers between dense ones, a NoPE layer (the last), chunks of 4 positions
    # and a temperature floor of 4 so that every feature acts within a few tokens.
    "llama4_text": {
        "num_hidden_layers": 4,
        "head_dim": 8,
        "intermediate_size": 16,
        "intermediate_size_mlp": 24,
        "num_local_experts": 8,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 2,
        "attention_chunk_size": 4,
        "floor_scale": 4,
        "attn_scale": 0.5,
        "eos_token_id": None,
        "bos_token_id": None,
        "pad_token_id": None,
    },
    # transformers' default rope here is YaRN (factor 32 over 4096 positions).
    "gpt_oss": {
        "intermediate_size": 16,
        "num_local_experts": 8,
        "head_dim": 8,
        "sliding_window": 5,
    },
}
_GLM_LIKE = {k: v for k, v in CONFIGS["glm4_moe"].items() if k != "use_qk_norm"}
CONFIGS["dots1"] = {**_GLM_LIKE, "sliding_window": 5, "layer_types": None, "max_window_layers": 1}
CONFIGS["solar_open"] = _GLM_LIKE
CONFIGS["minimax_m2"] = {
    "intermediate_size": 16,
    "num_local_experts": 8,
    "head_dim": 8,
    "eos_token_id": None,
    "bos_token_id": None,
}
CONFIGS["hy_v3"] = {
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_experts": 8,
    "head_dim": 8,
    "attention_bias": True,
    "mlp_layer_types": ["dense", "sparse"],
}
# Sliding (rope) and full (NoPE) layers alternate; windows of 4 positions.
CONFIGS["exaone_moe"] = {
    "num_hidden_layers": 4,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_experts": 8,
    "head_dim": 8,
    "sliding_window": 4,
    "sliding_window_pattern": 2,
    "n_group": 2,
    "topk_group": 1,
    "eos_token_id": None,
    "bos_token_id": None,
    "pad_token_id": None,
}
CONFIGS["granitemoeshared"] = {**CONFIGS["granitemoe"], "shared_intermediate_size": 24}
_CLASSES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM"),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM"),
    "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM"),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM"),
    "hy_v3": ("HYV3Config", "HYV3ForCausalLM"),
    "exaone_moe": ("ExaoneMoeConfig", "ExaoneMoeForCausalLM"),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "jamba": ("JambaConfig", "JambaForCausalLM"),
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM"),
    "sarvam_mla": ("SarvamMLAConfig", "DeepseekV3ForCausalLM"),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM"),
    "dots1": ("Dots1Config", "Dots1ForCausalLM"),
    "solar_open": ("SolarOpenConfig", "SolarOpenForCausalLM"),
    "llama4_text": ("Llama4TextConfig", "Llama4ForCausalLM"),
}


def model_class(arch: str) -> Any:
    """The transformers ``*ForCausalLM`` class of ``arch``."""
    import transformers

    return getattr(transformers, _CLASSES[arch][1])


def build_tiny_model(arch: str, seed: int = 0, dtype: str = "float32", **overrides: Any) -> Any:
    """A randomly initialised tiny model of ``arch`` (eval mode)."""
    import torch
    import transformers

    cfg_cls = getattr(transformers, _CLASSES[arch][0])
    config = cfg_cls(**{**_COMMON, **CONFIGS[arch], **overrides})
    torch.manual_seed(seed)
    model = model_class(arch)(config)
    # Default init leaves norms at exactly 1 and biases at 0; perturb every
    # parameter so a mix-up of any two tensors changes the logits.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.to(getattr(torch, dtype)).eval()


def make_tiny_checkpoint(
    arch: str,
    path: str | os.PathLike[str],
    seed: int = 0,
    fused: bool | None = None,
    *,
    dtype: str = "float32",
    max_shard_size: str | None = None,
    **overrides: Any,
) -> Path:
    """Write a tiny ``arch`` checkpoint directory at ``path`` and return the path.

    Parameters
    ----------
    arch
        One of :data:`ARCHES`.
    seed
        Torch seed of the random weights (same seed, same bytes).
    fused
        ``True`` writes stacked expert tensors; ``None``/``False`` per-expert.
    dtype
        ``"float32"``, ``"bfloat16"`` or ``"float16"``.
    max_shard_size
        If given (e.g. ``"20KB"``), shard with an index (per-expert layout only).
    overrides
        Config fields to change (e.g. ``num_hidden_layers=3``).
    """
    from safetensors.torch import save_file

    path = Path(path)
    model = build_tiny_model(arch, seed, dtype, **overrides)
    if fused:
        path.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(path)
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(path, **kwargs)
    return path


def load_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``config.json`` of a checkpoint directory."""
    return json.loads((Path(path) / "config.json").read_text())


def reference_logits(path: str | os.PathLike[str], arch: str, tokens: list[int]) -> Any:
    """Logits of transformers' implementation loaded from ``path`` (float32 torch tensor)."""
    import torch

    model = model_class(arch).from_pretrained(path).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def per_expert_tensors(prefix: str, part: str, stacked: Any) -> dict[str, Any]:
    """A layer's stacked experts as ``save_pretrained`` writes them, one tensor per expert.

    ``stacked`` is transformers 5.x's in-memory ``gate_up_proj [E, 2I, H]`` or
    ``down_proj [E, H, I]`` (``part``); the names are ``{prefix}{e}.gate_proj.weight``,
    ``...up_proj...`` and ``...down_proj...`` (``prefix``: ``model.layers.<L>.mlp.experts.``).
    """
    out = {}
    for e in range(stacked.shape[0]):
        if part == "gate_up_proj":
            gate, up = stacked[e].chunk(2, dim=0)
            out[f"{prefix}{e}.gate_proj.weight"] = gate
            out[f"{prefix}{e}.up_proj.weight"] = up
        else:
            out[f"{prefix}{e}.down_proj.weight"] = stacked[e]
    return out


def mtp_layer_tensors(main: Any, block: Any, echo: bool = False) -> dict[str, Any]:
    """A multi-token-prediction layer for ``main`` (a tiny DeepSeek-V3 / GLM-4.5) as the
    published checkpoints append it, under ``model.layers.<num_hidden_layers>.``:
    ``block``'s layer 0 as its decoder block (stacked experts split per expert) and
    random ``enorm``/``hnorm``/``eh_proj``/``embed_tokens``/``shared_head``.

    ``echo``: weights that make the head repeat the main model's own prediction (the
    block's attention and MLP outputs zeroed, ``eh_proj = [0 | I]``, the main model's
    final norm and head): its draft is the pending token, accepted wherever the text
    repeats a token. Random weights give no meaningful acceptance.
    """
    import torch

    n = main.config.num_hidden_layers
    h = main.config.hidden_size
    out: dict[str, Any] = {}
    for name, t in block.state_dict().items():
        if not name.startswith("model.layers.0."):
            continue
        rest = name.removeprefix("model.layers.0.")
        if echo and (rest.endswith("o_proj.weight") or "down_proj" in rest):
            t = torch.zeros_like(t)
        if rest.startswith("mlp.experts."):
            out.update(per_expert_tensors(f"model.layers.{n}.mlp.experts.", rest.split(".")[-1], t))
            continue
        out[f"model.layers.{n}.{rest}"] = t
    g = torch.Generator().manual_seed(11)
    sd = main.state_dict()
    v = main.config.vocab_size
    own = {
        "enorm.weight": 1 + 0.2 * torch.randn(h, generator=g),
        "hnorm.weight": 1 + 0.2 * torch.randn(h, generator=g),
        "eh_proj.weight": 0.2 * torch.randn((h, 2 * h), generator=g),
        "embed_tokens.weight": torch.randn((v, h), generator=g),
        "shared_head.norm.weight": 1 + 0.2 * torch.randn(h, generator=g),
        "shared_head.head.weight": 0.2 * torch.randn((v, h), generator=g),
    }
    if echo:
        own["hnorm.weight"] = torch.ones(h)
        own["eh_proj.weight"] = torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1)
        own["embed_tokens.weight"] = sd["model.embed_tokens.weight"]
        own["shared_head.norm.weight"] = sd["model.norm.weight"]
        own["shared_head.head.weight"] = sd["lm_head.weight"]
    for name, t in own.items():
        out[f"model.layers.{n}.{name}"] = t
    return {k: t.detach().clone().contiguous() for k, t in out.items()}
