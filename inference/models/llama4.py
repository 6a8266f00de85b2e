"""Llama 4 text: chunked and NoPE attention layers, a sigmoid top-k router beside a shared
expert, dense and MoE layers interleaved.

Differences from the shared base, as transformers' ``Llama4ForCausalLM`` runs
a ``Llama4TextConfig``:

* rope: the complex form, rotating adjacent channel pairs ``(x0, x1), ...``
  (:class:`~czyx.inference.models.rope.Rotary` with ``interleaved``: the
  pairs are de-interleaved first, the same permutation for queries and keys,
  so every attention score is unchanged); layers whose ``no_rope_layers``
  entry is 0 (NoPE layers) do not rotate at all;
* attention: rope layers are ``chunked_attention`` (``layer_types``): a
  query sees only keys of its own ``attention_chunk_size`` block; NoPE
  layers attend to everything. With ``use_qk_norm`` the rope layers' queries
  and keys get a weightless L2 (RMS) norm after the rotation. With
  ``attn_temperature_tuning`` the NoPE layers' queries are scaled by
  ``log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1``;
* MoE layers (``moe_layers``, else every ``interleave_moe_layer_step``-th):
  the top-k router logits through a sigmoid are the weights, and each routed
  expert gets its token *scaled by its weight* (its output is added as it
  is: :attr:`MoEDecoder.weight_expert_input`), beside an ungated shared
  expert; the other layers are a dense SwiGLU of ``intermediate_size_mlp``;
* experts are stored stacked and transposed, gate and up as the halves of
  ``gate_up_proj [E, H, 2I]`` (mount rearranges them: ``gate_up_t`` in
  ``store.models.expert_transform``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from czyx.inference.errors import UnsupportedModelError
from czyx.inference.kernels.linear import mm_t
from czyx.inference.models.base import F32, attention, forbid_experts, sigmoid
from czyx.inference.models.decoder import DecoderConfig, Layer, MoEDecoder, common_config
from czyx.inference.models.rope import Rotary
from czyx.store.consumer import ModelInfo


def rope_layers(config: dict[str, Any], n: int) -> list[bool]:
    """Which layers rotate: ``no_rope_layers`` (1: rope), else transformers' default
    (every ``no_rope_layer_interval``-th layer is NoPE)."""
    flags = config.get("no_rope_layers")
    if flags is None:
        every = int(config.get("no_rope_layer_interval") or 4)
        return [(i + 1) % every != 0 for i in range(n)]
    if not isinstance(flags, list) or len(flags) != n:
        raise UnsupportedModelError(f"config no_rope_layers={flags!r:.60} does not list {n} layers")
    return [bool(f) for f in flags]


def top_k_sigmoid(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` largest logits per row (descending, ties to the lower index) and their
    sigmoids: Llama 4's router weights."""
    part = np.argpartition(-logits, k - 1, axis=-1)[:, :k] if k < logits.shape[-1] else None
    if part is None:
        part = np.broadcast_to(np.arange(logits.shape[-1]), logits.shape).copy()
    vals = np.take_along_axis(logits, part, axis=-1)
    order = np.lexsort((part, -vals), axis=-1)
    idx = np.take_along_axis(part, order, axis=-1)
    w = sigmoid(np.take_along_axis(vals, order, axis=-1).astype(F32))
    return idx.astype(np.int64), w.astype(F32)


class Llama4TextDecoder(MoEDecoder):
    """``Llama4ForCausalLM`` (a ``Llama4TextConfig``) in numpy."""

    arch = "llama4_text"
    weight_expert_input = True
    optional_roles = (*MoEDecoder.optional_roles, "o_bias")
    sparse_roles = ("router", "shared_gate_proj", "shared_up_proj", "shared_down_proj")

    @classmethod
    def parse_config(cls, info: ModelInfo) -> DecoderConfig:
        """Llama 4 text config (attention layer kinds are read in ``__init__``)."""
        n = int(info.config["num_hidden_layers"])
        return common_config(info, False, [None] * n)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        c = self.consumer.info.config
        n = self.cfg.n_layers
        self.use_rope = rope_layers(c, n)
        types = c.get("layer_types") or [
            "chunked_attention" if r else "full_attention" for r in self.use_rope
        ]
        if len(types) != n or not set(types) <= {"chunked_attention", "full_attention"}:
            raise UnsupportedModelError(f"config layer_types={types!r:.80} (llama4_text)")
        chunk = c.get("attention_chunk_size")
        if "chunked_attention" in types and not (isinstance(chunk, int) and chunk > 0):
            raise UnsupportedModelError(f"config attention_chunk_size={chunk!r} (llama4_text)")
        self.chunks = [chunk if t == "chunked_attention" else None for t in types]
        self.qk_norm = bool(c.get("use_qk_norm", True))
        self.temperature = bool(c.get("attn_temperature_tuning", True))
        self.floor_scale = F32(c.get("floor_scale", 8192))
        self.attn_scale = F32(c.get("attn_scale", 0.1))
        self.rotary = Rotary(self.cfg.rope, interleaved=True)

    def position_qk(
        self, i: int, lw: Layer, q: np.ndarray, k: np.ndarray, positions: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Rope layers rotate (then the L2 q/k norms); NoPE layers scale the queries by
        the attention temperature instead."""
        if self.use_rope[i]:
            q, k = super().position_qk(i, lw, q, k, positions)
            if self.qk_norm:  # weightless RMS norm over each head
                q, k = _l2(q, self.cfg.rms_eps), _l2(k, self.cfg.rms_eps)
        elif self.temperature:
            pos = positions.astype(F32) + F32(1.0)
            scale = np.log1p(np.floor(pos / self.floor_scale)) * self.attn_scale + F32(1.0)
            q = q * scale.astype(F32)[None, :, None]
        return q, k

    def attend(
        self, i: int, lw: Layer, q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: np.ndarray
    ) -> np.ndarray:
        """Chunked attention on the rope layers, full attention on the NoPE ones."""
        return attention(q, k, v, pos, None, self.chunks[i])

    def route(
        self, lw: Layer, x: np.ndarray, mask: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The top-k router logits (a portal's forbidden experts at ``-inf``), sigmoided."""
        return top_k_sigmoid(forbid_experts(mm_t(x, lw.router), mask), self.cfg.top_k)

    def routed_extra(self, lw: Layer, x: np.ndarray, routed: np.ndarray) -> np.ndarray:
        """The ungated shared expert beside the routed ones."""
        return self.add_ungated_shared(lw, x, routed)


def _l2(x: np.ndarray, eps: float) -> np.ndarray:
    return x * (F32(1.0) / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + F32(eps)))
