"""DeepSeek-V2 (and V2-Lite): latent attention, softmax routing, optionally group-limited.

Differences from the MLA base (:mod:`inference.models.mla`): the router is a
softmax; ``topk_method`` ``greedy`` takes the top-k of all experts,
``group_limited_greedy`` first keeps the ``topk_group`` groups (of
``n_group``) with the highest single score. The weights are the chosen
probabilities times ``routed_scaling_factor``, never renormalised
(transformers' DeepSeek-V2 ignores ``norm_topk_prob``). The rotary channels
are always adjacent pairs. V2-Lite has no query LoRA (``q_proj`` instead).
"""

from __future__ import annotations

import numpy as np

from czyx.inference.errors import UnsupportedModelError
from czyx.inference.kernels.linear import mm_t
from czyx.inference.models.base import F32, refuse_forbidden, softmax
from czyx.inference.models.decoder import DecoderConfig, Layer
from czyx.inference.models.deepseek_v3 import top_k_desc
from czyx.inference.models.mla import MLADecoder, mla_config
from czyx.store.consumer import ModelInfo

TOPK_METHODS = ("greedy", "group_limited_greedy")


class DeepseekV2Decoder(MLADecoder):
    """``DeepseekV2ForCausalLM`` in numpy."""

    arch = "deepseek_v2"

    @classmethod
    def parse_config(cls, info: ModelInfo) -> DecoderConfig:
        """DeepSeek-V2 config; an unknown ``topk_method`` is refused."""
        method = info.config.get("topk_method") or "greedy"
        if method not in TOPK_METHODS:
            raise UnsupportedModelError(
                f"config topk_method={method!r} (supported: {', '.join(TOPK_METHODS)})"
            )
        return mla_config(info, False)

    def route(
        self, lw: Layer, x: np.ndarray, mask: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Softmax top-k, group-limited by the best score of each group when asked."""
        c = self.consumer.info.config
        probs = softmax(mm_t(x, lw.router).astype(F32, copy=False), axis=-1)
        if mask is not None:  # a scoped portal: choose among permitted experts only
            probs = np.where(mask, probs, F32(-1.0))
        if (c.get("topk_method") or "greedy") == "group_limited_greedy":
            n_group, topk_group = int(c["n_group"]), int(c["topk_group"])
            t, e = probs.shape
            group_best = probs.reshape(t, n_group, e // n_group).max(axis=-1)
            keep = np.zeros((t, n_group), bool)
            np.put_along_axis(keep, top_k_desc(group_best, topk_group), True, axis=-1)
            probs = np.where(np.repeat(keep, e // n_group, axis=-1), probs, F32(0.0))
        idx = top_k_desc(probs, self.cfg.top_k)
        refuse_forbidden(idx, mask)
        w = np.take_along_axis(probs, idx, axis=-1) * F32(c.get("routed_scaling_factor") or 1.0)
        return idx.astype(np.int64, copy=False), w.astype(F32, copy=False)
