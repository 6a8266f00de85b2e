"""ERNIE-4.5-MoE (``ernie4_5_moe``): softmax routing with a selection bias, shared experts.

Differences from the shared base: the router's softmax probabilities plus
``moe_statics.e_score_correction_bias`` (trunk role ``router_bias``) choose the
top-k, whose weights are the unbiased probabilities divided by their sum
(clamped below at ``moe_norm_min``); ``moe_num_shared_experts`` ungated shared
experts are added; routed layers are every ``moe_layer_interval``-th from
``moe_layer_start_index`` to ``moe_layer_end_index`` (the others dense);
rotary channels come in adjacent pairs; ``use_bias`` adds q/k/v/o biases
(its MLP biases have no trunk role, so mount refuses such checkpoints).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from czyx.inference.errors import MissingTensorError
from czyx.inference.kernels.linear import mm_t
from czyx.inference.models.base import F32, KVCache, forbid_experts, refuse_forbidden, softmax
from czyx.inference.models.decoder import DecoderConfig, Layer, MoEDecoder, common_config
from czyx.inference.models.deepseek_v3 import top_k_desc
from czyx.inference.models.rope import Rotary
from czyx.store.consumer import ModelInfo
from czyx.store.models.archs import arch_for_config


class Ernie45MoeDecoder(MoEDecoder):
    """``Ernie4_5_MoeForCausalLM`` in numpy."""

    arch = "ernie4_5_moe"
    optional_roles = (
        *MoEDecoder.optional_roles,
        "o_bias",
        "shared_gate_proj",
        "shared_up_proj",
        "shared_down_proj",
    )
    sparse_roles = ("router", "router_bias")

    @classmethod
    def parse_config(cls, info: ModelInfo) -> DecoderConfig:
        """ERNIE config: ``moe_num_experts``/``moe_k`` and the routed layer range."""
        c = dict(info.config)
        c["num_experts"] = c.get("moe_num_experts", c.get("num_experts"))
        c["num_experts_per_tok"] = c.get("moe_k", c.get("num_experts_per_tok"))
        sparse = set(arch_for_config(c).sparse_layers(c))
        c["mlp_only_layers"] = [i for i in range(info.n_layers) if i not in sparse]
        return common_config(dataclasses.replace(info, config=c), True, [None] * info.n_layers)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rotary = Rotary(self.cfg.rope, interleaved=True)
        self.norm_min = F32(self.consumer.info.config.get("moe_norm_min", 1e-12))

    def _attention(
        self, i: int, lw: Layer, x: np.ndarray, kv: KVCache, start: int, positions: np.ndarray
    ) -> np.ndarray:
        # The base's (its o_bias included), overridden only to keep this model off the C
        # attention call, which rotates halves: ERNIE's rotary is interleaved.
        return super()._attention(i, lw, x, kv, start, positions)

    def route(
        self, lw: Layer, x: np.ndarray, mask: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-k of the biased probabilities; weights renormalised (floor ``moe_norm_min``)."""
        if lw.router_bias is None:
            raise MissingTensorError(f"layer {lw.index} has no e_score_correction_bias")
        probs = softmax(mm_t(x, lw.router).astype(F32, copy=False), axis=-1)
        choice = forbid_experts(probs + lw.router_bias.reshape(-1), mask)
        idx = top_k_desc(choice, self.cfg.top_k)
        refuse_forbidden(idx, mask)
        w = np.take_along_axis(probs, idx, axis=-1)
        w = w / np.maximum(np.sum(w, axis=-1, keepdims=True), self.norm_min)
        return idx.astype(np.int64, copy=False), w.astype(F32, copy=False)

    def routed_extra(self, lw: Layer, x: np.ndarray, routed: np.ndarray) -> np.ndarray:
        """Add the ungated shared experts."""
        return self.add_ungated_shared(lw, x, routed)
