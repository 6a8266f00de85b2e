"""OLMoE: RMS norms over the full query and key width, optional q/k/v clipping.

Differences from the shared base: ``q_norm`` spans all query heads
(``n_heads * head_dim``) and ``k_norm`` all key heads, applied to the
projections before they are split into heads; ``clip_qkv`` clamps q, k and v
after the norms; ``norm_topk_prob`` decides renormalisation; no sliding window.
"""

from __future__ import annotations

import numpy as np

from czyx.inference.models.decoder import DecoderConfig, Layer, common_config
from czyx.inference.models.qknorm import QKNormDecoder
from czyx.store.consumer import ModelInfo


class OlmoeDecoder(QKNormDecoder):
    """``OlmoeForCausalLM`` in numpy."""

    arch = "olmoe"
    qk_norm_per_head = False

    @classmethod
    def parse_config(cls, info: ModelInfo) -> DecoderConfig:
        """OLMoE config; ``attention_bias`` (an o_proj bias) is not supported."""
        c = info.config
        cls.reject_attention_bias(c)
        n = int(c["num_hidden_layers"])
        return common_config(info, bool(c.get("norm_topk_prob")), [None] * n)

    def post_qkv(
        self, lw: Layer, q: np.ndarray, k: np.ndarray, v: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Full-width RMS norms of q and k, then the optional clamp of q, k and v."""
        q, k = self.norm_qk(lw, q, k)
        clip = self.cfg.clip_qkv
        if clip is not None:
            q, k, v = (np.clip(a, -clip, clip) for a in (q, k, v))
        return q, k, v

    def c_post_qkv(self) -> tuple[int, float | None] | None:
        """Full-width q/k norms and the optional clamp, as the C attention call does them."""
        if type(self).post_qkv is not OlmoeDecoder.post_qkv:
            return None
        return (1, self.cfg.clip_qkv)


class MiniMaxM2Decoder(OlmoeDecoder):
    """``MiniMaxM2ForCausalLM`` in numpy: OLMoE's full-width q/k norms (no clamp), the
    rope of its config (a partial ``partial_rotary_factor`` as GLM-4.5's), and the
    sigmoid router of DeepSeek-V3 (``e_score_correction_bias`` biases the selection,
    the chosen sigmoids are renormalised; one group, no scaling, no shared expert)."""

    arch = "minimax_m2"
    sparse_roles = ("router", "router_bias")

    @classmethod
    def parse_config(cls, info: ModelInfo) -> DecoderConfig:
        """MiniMax-M2 config: renormalised top-k, full attention on every layer."""
        return common_config(info, True, [None] * int(info.config["num_hidden_layers"]))

    def route(
        self, lw: Layer, x: np.ndarray, mask: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Sigmoid scores, top-k of scores plus the selection bias, renormalised."""
        from czyx.inference.models.deepseek_v3 import sigmoid_group_route

        return sigmoid_group_route(self, lw, x, mask)
