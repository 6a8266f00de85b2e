"""GraniteMoE (``granitemoe``): Mixtral-like experts with four scalar multipliers.

Differences from the shared base: token embeddings are multiplied by
``embedding_multiplier``; attention scores are scaled by
``attention_multiplier`` instead of ``head_dim ** -0.5``; each attention and
MLP output is multiplied by ``residual_multiplier`` before its residual add;
the logits are divided by ``logits_scaling``; the router takes the top-k
logits and a softmax over those k. Experts are stacked only
(``input_linear``/``output_linear`` on disk, gate rows then up rows).
"""

from __future__ import annotations

import numpy as np

from czyx.inference.errors import UnsupportedModelError
from czyx.inference.kernels.linear import mm_t
from czyx.inference.models.base import F32, KVCache, forbid_experts, refuse_forbidden, silu
from czyx.inference.models.decoder import DecoderConfig, Layer, MoEDecoder, common_config
from czyx.store.consumer import ModelInfo


def softmax_of_top_k(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` largest logits per row (descending, ties to the lower index) and their softmax."""
    part = np.argpartition(-logits, k - 1, axis=-1)[:, :k]
    vals = np.take_along_axis(logits, part, axis=-1)
    order = np.lexsort((part, -vals), axis=-1)
    idx = np.take_along_axis(part, order, axis=-1)
    top = np.take_along_axis(vals, order, axis=-1)
    e = np.exp(top - top[:, :1])
    return idx.astype(np.int64), (e / e.sum(axis=-1, keepdims=True)).astype(F32)


class GraniteMoeDecoder(MoEDecoder):
    """``GraniteMoeForCausalLM`` in numpy."""

    arch = "granitemoe"

    @classmethod
    def parse_config(cls, info: ModelInfo) -> DecoderConfig:
        """GraniteMoE config (``attention_bias`` is not supported)."""
        if info.config.get("attention_bias"):
            raise UnsupportedModelError("config attention_bias=true (granitemoe) is not supported")
        return common_config(info, True, [None] * info.n_layers)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        c = self.consumer.info.config
        emb = float(c.get("embedding_multiplier", 1.0))
        if emb != 1.0:
            if not isinstance(self.embed, np.ndarray):
                raise UnsupportedModelError("a quantized embedding with embedding_multiplier")
            self.embed = self.embed * F32(emb)  # a copy: a tied lm_head keeps the original
        self.q_scale = F32(float(c.get("attention_multiplier", 1.0)) * self.cfg.head_dim**0.5)
        self.residual = F32(c.get("residual_multiplier", 1.0))
        self.logits_scaling = F32(c.get("logits_scaling", 1.0))

    def post_qkv(
        self, lw: Layer, q: np.ndarray, k: np.ndarray, v: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Fold ``attention_multiplier`` into q (the base scales scores by ``head_dim**-0.5``)."""
        return q * self.q_scale, k, v

    def _attention(
        self, i: int, lw: Layer, x: np.ndarray, kv: KVCache, start: int, positions: np.ndarray
    ) -> np.ndarray:
        return super()._attention(i, lw, x, kv, start, positions) * self.residual

    def mlp_out(self, y: np.ndarray) -> np.ndarray:
        """``residual_multiplier`` times the MLP output."""
        return y * self.residual

    def route(
        self, lw: Layer, x: np.ndarray, mask: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Softmax over the top-k router logits (``mask``: a scoped portal's experts)."""
        idx, w = softmax_of_top_k(forbid_experts(mm_t(x, lw.router), mask), self.cfg.top_k)
        refuse_forbidden(idx, mask)
        return idx, w

    def finish_logits(self, logits: np.ndarray) -> np.ndarray:
        """Logits divided by ``logits_scaling``."""
        return logits / self.logits_scaling


class GraniteMoeSharedDecoder(GraniteMoeDecoder):
    """``GraniteMoeSharedForCausalLM`` in numpy: GraniteMoE plus an ungated shared MLP.

    The shared MLP's ``input_linear [2I, H]`` (trunk role ``shared_gate_up_proj``:
    gate rows, then up rows) and ``output_linear`` (``shared_down_proj``) run on the
    same input as the routed experts; their sum is scaled by ``residual_multiplier``.
    ``shared_intermediate_size`` 0 means no shared MLP.
    """

    arch = "granitemoeshared"
    optional_roles = (*GraniteMoeDecoder.optional_roles, "shared_gate_up_proj", "shared_down_proj")
    window_roles = GraniteMoeDecoder.window_roles | {"shared_gate_up_proj"}

    def routed_extra(self, lw: Layer, x: np.ndarray, routed: np.ndarray) -> np.ndarray:
        """``routed`` plus the shared MLP (none: ``routed``)."""
        if lw.shared_gate_up_proj is None:
            return routed
        gu = mm_t(x, lw.shared_gate_up_proj)
        inter = gu.shape[1] // 2
        act = silu(gu[:, :inter]) * gu[:, inter:]
        if self.observer is not None:
            self.observer(f"L{lw.index}.shared.down_in", act)
        return routed + mm_t(act, lw.shared_down_proj)
