"""Qwen2-MoE: routed experts plus a shared expert behind a sigmoid gate.

Differences from the shared base: q/k/v projections carry biases; the
routed output is added to ``sigmoid(x @ shared_expert_gate) * shared_expert(x)``;
top-k renormalisation follows ``norm_topk_prob`` (default off); layers in
``mlp_only_layers`` or off the ``decoder_sparse_step`` are dense; sliding
windows follow ``layer_types`` when ``use_sliding_window`` is on.
"""

from __future__ import annotations

import numpy as np

from czyx.inference.models.decoder import (
    DecoderConfig,
    Layer,
    MoEDecoder,
    common_config,
)
from czyx.store.consumer import ModelInfo


def layer_windows(config: dict, n_layers: int) -> list[int | None]:
    """Per-layer sliding windows of the Qwen configs (``layer_types`` when present)."""
    window = config.get("sliding_window") or None
    if not config.get("use_sliding_window") or window is None:
        return [None] * n_layers
    types = config.get("layer_types")
    if types is None:
        # Older configs: the first max_window_layers layers slide on odd (1-based) layers.
        mwl = int(config.get("max_window_layers", n_layers))
        types = [
            "sliding_attention" if (i + 1) % 2 and i < mwl else "full_attention"
            for i in range(n_layers)
        ]
    return [window if t == "sliding_attention" else None for t in types]


class Qwen2MoeDecoder(MoEDecoder):
    """``Qwen2MoeForCausalLM`` in numpy."""

    arch = "qwen2_moe"
    sparse_roles = (
        "router",
        "shared_gate_proj",
        "shared_up_proj",
        "shared_down_proj",
        "shared_expert_gate",
    )

    @classmethod
    def parse_config(cls, info: ModelInfo) -> DecoderConfig:
        """Qwen2-MoE config: ``norm_topk_prob``, dense layers, per-layer windows."""
        c = info.config
        n = int(c["num_hidden_layers"])
        renorm = bool(c.get("norm_topk_prob"))
        return common_config(info, renorm, layer_windows(c, n))

    def routed_extra(self, lw: Layer, x: np.ndarray, routed: np.ndarray) -> np.ndarray:
        """Add the gated shared expert."""
        return self.add_gated_shared(lw, x, routed)
