"""GLM-4.5 / GLM-4.6 (``glm4_moe``): DeepSeek-V3 routing on grouped-query attention.

Differences from the shared base: q/k/v projections carry biases
(``attention_bias``); with ``use_qk_norm`` q and k are RMS-normalised per head
before RoPE; only the leading ``partial_rotary_factor`` (default 0.5) of each
head rotates; routing is DeepSeek-V3's (sigmoid scores, selection biased by
``e_score_correction_bias`` within the ``topk_group`` best of ``n_group``
groups, ``norm_topk_prob``, ``routed_scaling_factor``); ``n_shared_experts``
ungated shared experts are added; the first ``first_k_dense_replace`` layers
are dense. The multi-token-prediction layer of a published checkpoint is kept
by mount; ``--speculate mtp`` runs it as a draft head (:mod:`czyx.inference.mtp`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from czyx.inference.models.decoder import DecoderConfig, Layer, MoEDecoder, common_config
from czyx.inference.models.deepseek_v3 import sigmoid_group_route
from czyx.inference.models.qknorm import QKNormDecoder
from czyx.store.consumer import ModelInfo


class Glm4MoeDecoder(QKNormDecoder):
    """``Glm4MoeForCausalLM`` in numpy."""

    arch = "glm4_moe"
    qk_norm_per_head = True
    required_roles = MoEDecoder.required_roles
    optional_roles = (
        *MoEDecoder.optional_roles,
        "q_norm",
        "k_norm",
        "shared_gate_proj",
        "shared_up_proj",
        "shared_down_proj",
        "router_bias",
    )

    @classmethod
    def parse_config(cls, info: ModelInfo) -> DecoderConfig:
        """GLM-4.5 config: experts are ``n_routed_experts``, dense layers come first."""
        c = dict(info.config)
        c["num_experts"] = c.get("n_routed_experts")
        c["mlp_only_layers"] = list(range(int(c.get("first_k_dense_replace") or 0)))
        c.setdefault("partial_rotary_factor", 0.5)  # transformers' default for GLM-4.5
        renorm = bool(c.get("norm_topk_prob", True))
        return common_config(dataclasses.replace(info, config=c), renorm, [None] * info.n_layers)

    def post_qkv(
        self, lw: Layer, q: np.ndarray, k: np.ndarray, v: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-head RMS norms of q and k when the checkpoint has them (``use_qk_norm``)."""
        if lw.q_norm is None:
            return q, k, v
        q, k = self.norm_qk(lw, q, k)
        return q, k, v

    def route(
        self, lw: Layer, x: np.ndarray, mask: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """DeepSeek-V3's sigmoid group-limited routing."""
        return sigmoid_group_route(self, lw, x, mask)

    def routed_extra(self, lw: Layer, x: np.ndarray, routed: np.ndarray) -> np.ndarray:
        """Add the ungated shared experts."""
        return self.add_ungated_shared(lw, x, routed)
