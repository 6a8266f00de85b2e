"""Multi-head latent attention (DeepSeek-V2/V3): the decoder base of the DeepSeek family.

Differences from the shared base, all in attention: queries come from
``q_proj`` or from the low-rank ``q_a_proj -> q_a_norm -> q_b_proj``; keys and
values are compressed into one latent row per token, ``kv_a_proj(x) =
[c (kv_lora_rank) | k_rot (qk_rope_head_dim)]``, with ``c`` RMS-normalised by
``kv_a_norm`` and ``k_rot`` one rotary key shared by every head. The KV cache
holds only that latent row (``c`` and the rotated ``k_rot``), as transformers'
cache does, and every step expands it through ``kv_b_proj`` into per-head
no-rope keys ``[qk_nope_head_dim]`` and values ``[v_head_dim]``; a head's key is
``[k_nope | k_rot]``. Rotary channels are adjacent pairs (``rope_interleave``);
the softmax scale is ``qk_head_dim ** -0.5`` times YaRN's
``mscale(factor, mscale_all_dim) ** 2`` when the rope type scales.

Routing and the MLP (sigmoid or softmax group-limited top-k, shared experts,
the first ``first_k_dense_replace`` layers dense) are the subclasses'
(:mod:`inference.models.deepseek_v3`, :mod:`inference.models.deepseek_v2`).

The latent cache is presented to the rest of the engine (sessions save and
restore it) as a KV cache of one head whose key and value arrays are the two
halves of the latent row: ``head_dim = ceil((kv_lora_rank + qk_rope_head_dim) / 2)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from czyx.inference.cache import ExpertCache
from czyx.inference.errors import MissingTensorError, UnsupportedModelError
from czyx.inference.kernels.linear import mm_t
from czyx.inference.models.base import F32, KVCache, rms_norm
from czyx.inference.models.decoder import DecoderConfig, Layer, MoEDecoder, eos_ids
from czyx.inference.models.rope import Rotary, rope_config
from czyx.store.consumer import ModelConsumer, ModelInfo
from czyx.store.models.archs import arch_for_config

#: eps of the q/kv latent RMSNorms (transformers' DeepSeek-V2/V3 RMSNorm default).
LATENT_NORM_EPS = 1e-6


class MLACache(KVCache):
    """Per layer one latent array ``[1, capacity, 2 * head_dim]`` (``c | k_rot``, zero-padded).

    ``k`` and ``v`` are views of its two halves, so code written for a
    :class:`~czyx.inference.models.base.KVCache` (session save and restore,
    truncation) handles the latent cache unchanged.
    """

    def __init__(self, n_layers: int, width: int, capacity: int = 64) -> None:
        self.n_layers = n_layers
        self.n_kv_heads = 1
        self.width = width
        self.head_dim = (width + 1) // 2
        self.length = 0
        self.latent = [np.zeros((1, capacity, 2 * self.head_dim), F32) for _ in range(n_layers)]
        self._bind()

    def _bind(self) -> None:
        hd = self.head_dim
        self.k = [a[:, :, :hd] for a in self.latent]
        self.v = [a[:, :, hd:] for a in self.latent]

    def reserve(self, total: int) -> None:
        """Make room for ``total`` positions (doubling)."""
        cap = self.capacity
        if total <= cap:
            return
        new = max(total, 2 * cap)
        for i, old in enumerate(self.latent):
            grown = np.zeros((1, new, old.shape[2]), F32)
            grown[:, :cap] = old[:, :cap]
            self.latent[i] = grown
        self._bind()


@dataclass(frozen=True)
class MLADims:
    """The latent attention's widths, read from a DeepSeek config."""

    n_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_head: int

    @property
    def qk_head(self) -> int:
        """Query/key width per head (no-rope part, then rope part)."""
        return self.qk_nope + self.qk_rope

    @classmethod
    def from_config(cls, c: dict[str, Any]) -> MLADims:
        """Read the dims; missing ones raise :class:`UnsupportedModelError`."""
        try:
            return cls(
                n_heads=int(c["num_attention_heads"]),
                q_lora_rank=None if c.get("q_lora_rank") is None else int(c["q_lora_rank"]),
                kv_lora_rank=int(c["kv_lora_rank"]),
                qk_nope=int(c["qk_nope_head_dim"]),
                qk_rope=int(c["qk_rope_head_dim"]),
                v_head=int(c["v_head_dim"]),
            )
        except (KeyError, TypeError) as exc:
            raise UnsupportedModelError(f"MLA config field missing or invalid: {exc}") from None


def mla_config(info: ModelInfo, renormalize: bool) -> DecoderConfig:
    """The :class:`DecoderConfig` of a DeepSeek-family checkpoint (KV dims of the latent cache)."""
    c = info.config
    if c.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"config hidden_act={c['hidden_act']!r} (only silu)")
    if c.get("attention_bias"):
        raise UnsupportedModelError("config attention_bias=true is not supported for MLA")
    dims = MLADims.from_config(c)
    n_layers = int(c["num_hidden_layers"])
    n_experts = int(c.get("n_routed_experts") or 0)
    if n_experts != info.n_experts or n_layers != info.n_layers:
        raise UnsupportedModelError(
            f"config says {n_layers} layers x {n_experts} experts but the mount says "
            f"{info.n_layers} x {info.n_experts}"
        )
    sparse = set(arch_for_config(c).sparse_layers(c))
    width = dims.kv_lora_rank + dims.qk_rope
    return DecoderConfig(
        arch=info.arch,
        vocab_size=int(c["vocab_size"]),
        hidden_size=int(c["hidden_size"]),
        n_layers=n_layers,
        n_heads=dims.n_heads,
        n_kv_heads=1,
        head_dim=(width + 1) // 2,
        n_experts=n_experts,
        top_k=int(c["num_experts_per_tok"]),
        rms_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope=rope_config(c, dims.qk_rope),
        renormalize=renormalize,
        sparse_layers=tuple(i in sparse for i in range(n_layers)),
        sliding_windows=(None,) * n_layers,
        eos_token_ids=eos_ids(c),
    )


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class MLADecoder(MoEDecoder):
    """A :class:`MoEDecoder` with multi-head latent attention and shared experts."""

    required_roles = (
        "input_norm",
        "post_attn_norm",
        "kv_a_proj",
        "kv_a_norm",
        "kv_b_proj",
        "o_proj",
    )
    optional_roles = (
        "q_proj",
        "q_a_proj",
        "q_a_norm",
        "q_b_proj",
        "shared_gate_proj",
        "shared_up_proj",
        "shared_down_proj",
        "router_bias",
    )
    window_roles = MoEDecoder.window_roles | {"q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj"}
    #: Whether the rotary channels come in adjacent pairs (DeepSeek's layout).
    rope_interleaved: ClassVar[bool] = True

    def __init__(
        self, consumer: ModelConsumer, experts: ExpertCache, trunk_window: int | None = None
    ) -> None:
        self.mla = MLADims.from_config(consumer.info.config)
        super().__init__(consumer, experts, trunk_window)
        self.rotary = Rotary(self.cfg.rope, interleaved=self.interleaved(consumer.info.config))
        self.scale = self.softmax_scale()
        has = self.consumer.has_trunk
        for i in range(self.cfg.n_layers):
            low_rank = all(has(r, i) for r in ("q_a_proj", "q_a_norm", "q_b_proj"))
            if not (low_rank or has("q_proj", i)):
                raise MissingTensorError(
                    f"layer {i} has neither q_proj nor q_a_proj, q_a_norm and q_b_proj"
                )

    @classmethod
    def interleaved(cls, config: dict[str, Any]) -> bool:
        """Whether this checkpoint's rotary channels are adjacent pairs."""
        return cls.rope_interleaved

    def softmax_scale(self) -> float:
        """``qk_head_dim ** -0.5``, times YaRN's ``mscale_all_dim`` correction squared."""
        scale = self.mla.qk_head**-0.5
        p = self.cfg.rope.params
        if p is not None and p.rope_type != "default" and p.mscale_all_dim:
            m = _yarn_mscale(p.factor or 1.0, p.mscale_all_dim)
            scale = scale * m * m
        return scale

    def new_kv(self, capacity: int = 64) -> MLACache:
        """An empty latent cache for this model."""
        return MLACache(self.cfg.n_layers, self.mla.kv_lora_rank + self.mla.qk_rope, capacity)

    def routed_extra(self, lw: Layer, x: np.ndarray, routed: np.ndarray) -> np.ndarray:
        """Add the shared experts (ungated; absent when ``n_shared_experts`` is 0)."""
        return self.add_ungated_shared(lw, x, routed)

    def _attention(
        self, i: int, lw: Layer, x: np.ndarray, kv: KVCache, start: int, positions: np.ndarray
    ) -> np.ndarray:
        # The latent norms keep RMSNorm's default eps whatever rms_norm_eps says
        # (transformers builds q_a_layernorm / kv_a_layernorm without it).
        m, eps = self.mla, LATENT_NORM_EPS
        t = x.shape[0]
        if self.observer is not None:
            self.observer(f"L{i}.attn_in", x)
        if lw.q_proj is not None:
            q = mm_t(x, lw.q_proj)
        else:
            q_low = rms_norm(mm_t(x, lw.q_a_proj), lw.q_a_norm, eps)
            if self.observer is not None:
                self.observer(f"L{i}.q_b_in", q_low)
            q = mm_t(q_low, lw.q_b_proj)
        q = q.reshape(t, m.n_heads, m.qk_head).transpose(1, 0, 2)  # [nh, T, qk]
        q_rot = self.rotary.apply(q[..., m.qk_nope :], positions)
        ckv = mm_t(x, lw.kv_a_proj)  # [T, r + dr]
        r = m.kv_lora_rank
        c = rms_norm(ckv[:, :r], lw.kv_a_norm, eps)
        k_rot = self.rotary.apply(ckv[None, :, r:], positions)[0]
        end = start + t
        lat = kv.latent[i]  # type: ignore[attr-defined]
        lat[0, start:end, :r] = c
        lat[0, start:end, r : r + m.qk_rope] = k_rot
        # Expand the cached latents into per-head keys and values (as transformers).
        if self.observer is not None:
            self.observer(f"L{i}.kv_b_in", c)
        kvb = mm_t(lat[0, :end, :r], lw.kv_b_proj).reshape(end, m.n_heads, m.qk_nope + m.v_head)
        keys = np.empty((m.n_heads, end, m.qk_head), F32)
        keys[..., : m.qk_nope] = kvb[..., : m.qk_nope].transpose(1, 0, 2)
        keys[..., m.qk_nope :] = lat[None, 0, :end, r : r + m.qk_rope]
        values = kvb[..., m.qk_nope :].transpose(1, 0, 2)  # [nh, L, dv]
        query = np.concatenate([q[..., : m.qk_nope], q_rot], axis=-1)
        scores = query @ keys.transpose(0, 2, 1)
        scores *= F32(self.scale)
        masked = np.arange(end)[None, :] > positions[:, None]
        if masked.any():
            np.copyto(scores, F32(-np.inf), where=masked[None])
        scores -= np.max(scores, axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= np.sum(scores, axis=-1, keepdims=True)
        out = (scores @ values).transpose(1, 0, 2).reshape(t, m.n_heads * m.v_head)
        if self.observer is not None:
            self.observer(f"L{i}.o_in", out)
        return mm_t(out, lw.o_proj)
