"""HunYuan-MoE-V1 (``hunyuan_v1_moe``): q/k norms after RoPE, a shared MLP on every layer.

Differences from the shared base: each head's query and key are
RMS-normalised (``query_layernorm``/``key_layernorm``, width ``head_dim``)
*after* the rotary embedding, so this file runs its own attention step; with
``attention_bias`` q/k/v/o carry biases; every layer adds an ungated shared
MLP (``shared_mlp``, ``intermediate_size`` wide) to its routed experts, which
are chosen by softmax top-k, renormalised. Per-layer lists for
``num_experts``/``moe_topk`` and the NTK-alpha rope variant are refused.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from czyx.inference.errors import UnsupportedModelError
from czyx.inference.kernels.linear import mm_t
from czyx.inference.models.base import KVCache, attention, rms_norm, swiglu
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

    def _attention(
        self, i: int, lw: Layer, x: np.ndarray, kv: KVCache, start: int, positions: np.ndarray
    ) -> np.ndarray:
        cfg = self.cfg
        t, hd, eps = x.shape[0], cfg.head_dim, cfg.rms_eps
        if self.observer is not None:
            self.observer(f"L{i}.attn_in", x)
        q, k, v = (
            _biased(mm_t(x, w), b)
            for w, b in ((lw.q_proj, lw.q_bias), (lw.k_proj, lw.k_bias), (lw.v_proj, lw.v_bias))
        )
        q = self.rotary.apply(q.reshape(t, cfg.n_heads, hd).transpose(1, 0, 2), positions)
        k = self.rotary.apply(k.reshape(t, cfg.n_kv_heads, hd).transpose(1, 0, 2), positions)
        q, k = rms_norm(q, lw.q_norm, eps), rms_norm(k, lw.k_norm, eps)
        kv.write(i, start, k, v.reshape(t, cfg.n_kv_heads, hd).transpose(1, 0, 2))
        end = start + t
        out = attention(q, kv.k[i][:, :end], kv.v[i][:, :end], positions, None)
        if self.observer is not None:
            self.observer(f"L{i}.o_in", out)
        return _biased(mm_t(out, lw.o_proj), lw.o_bias)

    def routed_extra(self, lw: Layer, x: np.ndarray, routed: np.ndarray) -> np.ndarray:
        """Add the shared MLP."""
        observe = None
        if self.observer is not None:
            observe = self._observe(f"L{lw.index}.shared.down_in")
        return routed + swiglu(
            x, lw.shared_gate_proj, lw.shared_up_proj, lw.shared_down_proj, observe
        )


def _biased(y: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    return y if bias is None else y + bias
