"""HunYuan-MoE-V1 (``hunyuan_v1_moe``): q/k norms after RoPE, a shared MLP on every layer.

Differences from the shared base: each head's query and key are
RMS-normalised (``query_layernorm``/``key_layernorm``, width ``head_dim``)
*after* the rotary embedding (its :meth:`position_qk`); with
``attention_bias`` q/k/v/o carry biases; every layer adds an ungated shared
MLP (``shared_mlp``, ``intermediate_size`` wide) to its routed experts, which
are chosen by softmax top-k, renormalised. Per-layer lists for
``num_experts``/``moe_topk`` and the NTK-alpha rope variant are refused.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from czyx.inference.errors import UnsupportedModelError
from czyx.inference.models.base import rms_norm
from czyx.inference.models.decoder import DecoderConfig, Layer, MoEDecoder, common_config
from czyx.store.consumer import ModelInfo


class HunYuanMoeV1Decoder(MoEDecoder):
    """``HunYuanMoEV1ForCausalLM`` in numpy."""

    arch = "hunyuan_v1_moe"
    required_roles = (*MoEDecoder.required_roles, "q_norm", "k_norm")
    optional_roles = (*MoEDecoder.optional_roles, "o_bias")
    sparse_roles = ("router", "shared_gate_proj", "shared_up_proj", "shared_down_proj")

    @classmethod
    def parse_config(cls, info: ModelInfo) -> DecoderConfig:
        """HunYuan config: one expert count and one top-k for every layer."""
        c = dict(info.config)
        for key in ("num_experts", "moe_topk"):
            if isinstance(c.get(key), list):
                raise UnsupportedModelError(f"config {key} per layer (a list) is not supported")
        c["num_experts_per_tok"] = c.get("moe_topk", c.get("num_experts_per_tok"))
        return common_config(dataclasses.replace(info, config=c), True, [None] * info.n_layers)

    def position_qk(
        self, i: int, lw: Layer, q: np.ndarray, k: np.ndarray, positions: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """RoPE, then each head's query and key RMS-normalised."""
        q, k = super().position_qk(i, lw, q, k, positions)
        eps = self.cfg.rms_eps
        return rms_norm(q, lw.q_norm, eps), rms_norm(k, lw.k_norm, eps)

    def routed_extra(self, lw: Layer, x: np.ndarray, routed: np.ndarray) -> np.ndarray:
        """Add the ungated shared MLP."""
        return self.add_ungated_shared(lw, x, routed)
