"""Qwen3-MoE: RMS norms on each query and key head before RoPE.

Differences from the shared base: ``q_norm``/``k_norm`` of width ``head_dim``
apply per head (unlike OLMoE's full-width norms); with ``attention_bias`` the
q/k/v/o projections carry biases; ``norm_topk_prob`` decides renormalisation; dense layers
as in Qwen2-MoE; with ``use_sliding_window`` every layer slides (unless the
config lists ``layer_types``).
"""

from __future__ import annotations

import numpy as np

from czyx.inference.models.decoder import DecoderConfig, Layer, common_config
from czyx.inference.models.qknorm import QKNormDecoder
from czyx.inference.models.qwen2_moe import layer_windows
from czyx.store.consumer import ModelInfo


class Qwen3MoeDecoder(QKNormDecoder):
    """``Qwen3MoeForCausalLM`` in numpy."""

    arch = "qwen3_moe"
    qk_norm_per_head = True
    optional_roles = (*QKNormDecoder.optional_roles, "o_bias")

    @classmethod
    def parse_config(cls, info: ModelInfo) -> DecoderConfig:
        """Qwen3-MoE config (``attention_bias`` biases are optional trunk roles)."""
        c = info.config
        n = int(c["num_hidden_layers"])
        renorm = bool(c.get("norm_topk_prob"))
        # Unlike Qwen2-MoE, transformers' Qwen3-MoE has no per-layer types: with
        # use_sliding_window every layer slides (max_window_layers is ignored).
        window = (c.get("sliding_window") or None) if c.get("use_sliding_window") else None
        if c.get("layer_types"):
            return common_config(info, renorm, layer_windows(c, n))
        return common_config(info, renorm, [window] * n)

    def post_qkv(
        self, lw: Layer, q: np.ndarray, k: np.ndarray, v: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-head RMS norm of q and k (weights of width ``head_dim``)."""
        q, k = self.norm_qk(lw, q, k)
        return q, k, v

    def c_post_qkv(self) -> tuple[int, float | None] | None:
        """Per-head q/k norms, as the C attention call does them (its mode 2)."""
        if type(self).post_qkv is not Qwen3MoeDecoder.post_qkv:
            return None
        return (2, None)
