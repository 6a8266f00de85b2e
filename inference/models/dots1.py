"""dots.llm1 (``dots1``) and Solar-Open (``solar_open``): GLM-4.5's MoE under other attention.

Both keep GLM-4.5's MoE block as it is (DeepSeek-V3 routing: sigmoid scores,
``e_score_correction_bias``, group-limited selection, ``norm_topk_prob``,
``routed_scaling_factor``; ungated shared experts) and its tensor names.
dots1 keeps its first ``first_k_dense_replace`` layers dense too. The
attention differs:

* dots1 is Qwen3's: per-head q/k RMS norms before RoPE, q/k/v/o biases with
  ``attention_bias``, the whole head rotates, and ``layer_types``
  ``sliding_attention`` layers see the last ``sliding_window`` positions;
* Solar-Open is Llama's: no q/k norms, the whole head rotates, no sliding window,
  and every layer is MoE (no dense first layers).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from czyx.inference.errors import MissingTensorError, UnsupportedModelError
from czyx.inference.kernels.linear import mm_t
from czyx.inference.models.decoder import DecoderConfig, Layer, common_config
from czyx.inference.models.deepseek_v3 import sigmoid_group_topk
from czyx.inference.models.glm4_moe import Glm4MoeDecoder
from czyx.store.consumer import ModelInfo


def _glm_like(info: ModelInfo, windows: list[int | None]) -> DecoderConfig:
    c = dict(info.config)
    if c.get("n_routed_experts") is not None:
        c["num_experts"] = c["n_routed_experts"]
    renorm = bool(c.get("norm_topk_prob", True))
    return common_config(dataclasses.replace(info, config=c), renorm, windows)


class Dots1Decoder(Glm4MoeDecoder):
    """``Dots1ForCausalLM`` in numpy."""

    arch = "dots1"
    optional_roles = (*Glm4MoeDecoder.optional_roles, "o_bias")

    @classmethod
    def parse_config(cls, info: ModelInfo) -> DecoderConfig:
        """dots1 config: full-width rope, sliding layers as ``layer_types`` says."""
        c, n = info.config, info.n_layers
        window = c.get("sliding_window") or None
        types = c.get("layer_types") or [
            "sliding_attention"
            if window is not None and i >= int(c.get("max_window_layers") or 0)
            else "full_attention"
            for i in range(n)
        ]
        return _glm_like(info, [window if t == "sliding_attention" else None for t in types])


class SolarOpenDecoder(Glm4MoeDecoder):
    """``SolarOpenForCausalLM`` in numpy."""

    arch = "solar_open"

    @classmethod
    def parse_config(cls, info: ModelInfo) -> DecoderConfig:
        """Solar-Open config: full-width rope, every layer full attention."""
        return _glm_like(info, [None] * info.n_layers)


class HYV3Decoder(Dots1Decoder):
    """``HYV3ForCausalLM`` (Hunyuan-V3) in numpy: dots1's attention (per-head q/k norms,
    q/k/v/o biases with ``attention_bias``) and MoE block, every layer full attention,
    dense layers as ``mlp_layer_types`` lists them, one routing group, and its
    ``router_scaling_factor`` (not ``routed_scaling_factor``) on the renormalised weights."""

    arch = "hy_v3"

    @classmethod
    def parse_config(cls, info: ModelInfo) -> DecoderConfig:
        """Hunyuan-V3 config: the chosen sigmoids always renormalised."""
        if info.config.get("mlp_bias"):
            raise UnsupportedModelError("config mlp_bias=true (hy_v3) is not supported")
        return common_config(info, True, [None] * info.n_layers)

    def route(
        self, lw: Layer, x: np.ndarray, mask: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Sigmoid scores, top-k of scores plus the selection bias, renormalised, scaled."""
        if lw.router_bias is None:
            raise MissingTensorError(f"layer {lw.index} has no expert_bias")
        scale = float(self.consumer.info.config.get("router_scaling_factor") or 1.0)
        return sigmoid_group_topk(
            mm_t(x, lw.router), lw.router_bias, self.cfg.top_k, 1, 1, True, scale, mask
        )


class ExaoneMoeDecoder(Dots1Decoder):
    """``ExaoneMoeForCausalLM`` in numpy: EXAONE-4 attention on DeepSeek-V3 routing.

    Queries and keys are RMS-normalised per head, then rotated only on the
    ``sliding_attention`` layers when a ``sliding_window`` is set (the full
    layers are NoPE; without a window every layer rotates); the MoE block is
    DeepSeek-V3's (``n_group``, ``topk_group``, ``routed_scaling_factor``,
    shared experts), dense layers as ``mlp_layer_types`` lists them.
    """

    arch = "exaone_moe"

    @classmethod
    def parse_config(cls, info: ModelInfo) -> DecoderConfig:
        """EXAONE-MoE config: sliding layers from ``layer_types``."""
        c, n = info.config, info.n_layers
        window = c.get("sliding_window") or None
        types = c.get("layer_types") or ["full_attention"] * n
        windows = [window if t == "sliding_attention" else None for t in types]
        return _glm_like(info, windows)

    def position_qk(
        self, i: int, lw: Layer, q: np.ndarray, k: np.ndarray, positions: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """RoPE, but not on the full layers of a model with a sliding window (NoPE)."""
        if self.consumer.info.config.get("sliding_window") and not self.cfg.sliding_windows[i]:
            return q, k
        return super().position_qk(i, lw, q, k, positions)
