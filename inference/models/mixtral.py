"""Mixtral: the plain sparse MoE decoder.

Differences from the shared base: the router always renormalises its top-k
probabilities (no ``norm_topk_prob`` switch), experts are counted by
``num_local_experts``, attention has no biases, and a ``sliding_window``
(when set) applies to every layer. ``router_jitter_noise`` and the router
auxiliary loss (``output_router_logits``, ``router_aux_loss_coef``) act only
in training in transformers 5.x, so inference ignores them.
"""

from __future__ import annotations

from czyx.inference.models.decoder import DecoderConfig, MoEDecoder, common_config
from czyx.store.consumer import ModelInfo


class MixtralDecoder(MoEDecoder):
    """``MixtralForCausalLM`` in numpy."""

    arch = "mixtral"

    @classmethod
    def parse_config(cls, info: ModelInfo) -> DecoderConfig:
        """Mixtral config: renormalised top-k, one sliding window for all layers."""
        n = int(info.config["num_hidden_layers"])
        window = info.config.get("sliding_window") or None
        return common_config(info, True, [window] * n)
