"""PhiMoE (Phi-3.5-MoE): sparsemixer routing, LayerNorm, attention and lm_head biases.

Differences from the shared base, as transformers' ``PhimoeForCausalLM`` runs
at inference:

* norms: ``nn.LayerNorm`` with a bias (eps ``rms_norm_eps``) before attention,
  before the MoE and at the end, instead of RMSNorm (trunk roles
  ``input_norm_bias``, ``post_attn_norm_bias``, ``final_norm_bias``); the C
  decode kernels implement RMSNorm only, so every step runs in numpy;
* router: sparsemixer, always two experts. The first is the top logit; its
  weight is its softmax probability over the logits within a relative
  ``2 * router_jitter_noise`` of the top (others masked to ``-inf``). The
  second is the top logit with the first masked out, weighted the same way
  among the logits near *it* (the first stays masked). Training's Gumbel
  sampling and Heun's third-order multiplier do not act at inference;
* attention: q/k/v/o biases with ``attention_bias``; one ``sliding_window``
  for every layer when set; ``lm_head_bias`` adds a bias to the logits;
* rope: ``default``, or ``longrope`` as PhiMoE's own rotary module computes it:
  always the *short* factors, cos and sin scaled by ``long_mscale`` when a
  forward pass reaches past ``original_max_position_embeddings`` and by
  ``short_mscale`` otherwise (keys already cached keep their scale).
"""

from __future__ import annotations

import numpy as np

from czyx.inference.errors import UnsupportedModelError
from czyx.inference.kernels.linear import mm_t
from czyx.inference.models.base import F32, forbid_experts, softmax
from czyx.inference.models.decoder import DecoderConfig, Layer, MoEDecoder, common_config
from czyx.inference.models.rope import RopeConfig, Rotary
from czyx.store.consumer import ModelInfo


def layer_norm(
    x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, eps: float
) -> np.ndarray:
    """``nn.LayerNorm`` over the last axis: ``(x - mean) / sqrt(var + eps) * weight + bias``."""
    xc = x - np.mean(x, axis=-1, keepdims=True)
    var = np.mean(np.square(xc), axis=-1, keepdims=True)
    out = xc / np.sqrt(var + F32(eps))
    out *= weight
    if bias is not None:
        out += bias
    return out


def _masked_weight(
    scores: np.ndarray, top: np.ndarray, eps: float, gates: np.ndarray
) -> np.ndarray:
    """Softmax of ``gates`` with every logit farther than ``2 eps`` (relative) below ``top``
    masked out, as sparsemixer's threshold (``|scores|`` clamped at ``top`` as the scale)."""
    factor = np.maximum(np.abs(scores), top)
    with np.errstate(divide="ignore", invalid="ignore"):
        far = ((top - scores) / factor) > 2 * eps
    return softmax(np.where(far, F32(-np.inf), gates), axis=-1)


def sparsemixer(scores: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """transformers' ``sparsemixer`` at inference: two experts ``[T, 2]`` and their weights.

    ``scores [T, E]`` are the router logits (``-inf`` where a portal forbids an expert).
    """
    s = scores.astype(F32, copy=False)
    rows = np.arange(s.shape[0])
    first = np.argmax(s, axis=-1)
    top1 = s[rows, first][:, None]
    w1 = _masked_weight(s, top1, eps, s)[rows, first]
    rest = s.copy()
    rest[rows, first] = -np.inf
    second = np.argmax(rest, axis=-1)
    top2 = rest[rows, second][:, None]
    w2 = _masked_weight(s, top2, eps, rest)[rows, second]
    idx = np.stack([first, second], axis=1).astype(np.int64)
    return idx, np.stack([w1, w2], axis=1).astype(F32)


class PhimoeRotary(Rotary):
    """PhiMoE's longrope: short factors always, cos/sin scaled by the pass's mscale."""

    def __init__(self, rope: RopeConfig, short_mscale: float, long_mscale: float) -> None:
        super().__init__(rope)
        self.short_mscale, self.long_mscale = F32(short_mscale), F32(long_mscale)
        # PhiMoE ignores the longrope attention factor: its mscales replace it.
        self.attention_scaling = 1.0
        self._grow(max(self._cos.shape[0], 1))

    def apply(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Rotate ``x [heads, T, head_dim]`` at ``positions``, scaled by the pass's mscale."""
        need = int(positions.max()) + 1
        if need > self._cos.shape[0]:
            self._grow(max(need, 2 * self._cos.shape[0]))
        m = self.long_mscale if need > self.params.original_max else self.short_mscale
        cos = self._cos[positions] * m
        sin = self._sin[positions] * m
        d = self.rotary_dim
        half = d // 2
        x1, x2 = x[..., :half], x[..., half:d]
        out = np.empty(x.shape, F32)
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half:d] = x2 * cos + x1 * sin
        if d < x.shape[-1]:
            out[..., d:] = x[..., d:]
        return out


class PhimoeDecoder(MoEDecoder):
    """``PhimoeForCausalLM`` in numpy."""

    arch = "phimoe"
    required_roles = (*MoEDecoder.required_roles, "input_norm_bias", "post_attn_norm_bias")
    optional_roles = (*MoEDecoder.optional_roles, "o_bias")

    @classmethod
    def parse_config(cls, info: ModelInfo) -> DecoderConfig:
        """PhiMoE config: sparsemixer's two experts, one sliding window for all layers."""
        c = info.config
        k = int(c.get("num_experts_per_tok") or 2)
        if k != 2:
            raise UnsupportedModelError(
                f"phimoe routes by sparsemixer, which picks exactly 2 experts; the config "
                f"says num_experts_per_tok={k}"
            )
        n = int(c["num_hidden_layers"])
        cfg = common_config(info, False, [c.get("sliding_window") or None] * n)
        if cfg.rope.params is not None and cfg.rope.params.rope_type not in ("default", "longrope"):
            raise UnsupportedModelError(
                f"phimoe rope type {cfg.rope.params.rope_type!r} is not implemented "
                "(default and longrope are)"
            )
        return cfg

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        c = self.consumer.info.config
        self.jitter = float(c.get("router_jitter_noise") or 0.0)
        if self.rotary.params.rope_type == "longrope":
            p = {**(c.get("rope_scaling") or {}), **(c.get("rope_parameters") or {})}
            scales = [p.get("short_mscale"), p.get("long_mscale")]
            if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in scales):
                raise UnsupportedModelError(
                    f"phimoe longrope needs numeric short_mscale and long_mscale, got {scales}"
                )
            self.rotary = PhimoeRotary(self.cfg.rope, float(scales[0]), float(scales[1]))
        self.lm_head_bias = None
        if self.consumer.has_trunk("lm_head_bias"):
            self.lm_head_bias = self._trunk("lm_head_bias", None, (self.cfg.vocab_size,))

    def norm(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        """LayerNorm with its bias (eps ``rms_norm_eps``)."""
        return layer_norm(x, weight, bias, self.cfg.rms_eps)

    def route(
        self, lw: Layer, x: np.ndarray, mask: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Sparsemixer's two experts (a portal's forbidden experts never chosen)."""
        return sparsemixer(forbid_experts(mm_t(x, lw.router), mask), self.jitter)

    def finish_logits(self, logits: np.ndarray) -> np.ndarray:
        """The lm_head's bias (``lm_head_bias``), when the checkpoint has one."""
        return logits if self.lm_head_bias is None else logits + self.lm_head_bias
