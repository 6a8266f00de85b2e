"""GPT-OSS: attention sinks, alternating sliding/full attention, clamped SwiGLU experts with biases.

Differences from the shared base:

* attention: q/k/v/o projections carry biases; each head has a learned sink
  logit (trunk role ``sinks``) that joins the softmax denominator and is
  then dropped (transformers' ``eager_attention_forward``: scores and sink
  share one max subtraction); layers alternate as ``layer_types`` says,
  ``sliding_attention`` ones seeing the last ``sliding_window`` positions;
* router: ``x @ router.T + router_bias``, the top-k logits, softmax over them;
* experts: ``gate_up`` (stored by mount in the contract's gate | up layout,
  see ``store.models.expert_transform``) plus its bias, then
  ``gate = min(gate, limit)``, ``up = clip(up, -limit, limit)``,
  ``(up + 1) * gate * sigmoid(alpha * gate)``, then ``down`` plus its bias;
  the per-expert biases are small trunk tensors (``expert_gate_up_bias``
  ``[E, 2I]`` with gate and up interleaved as in the checkpoint,
  ``expert_down_bias`` ``[E, H]``).

The routed loop is this file's own (the base's calls a plain SwiGLU); it
keeps the base's contract: one fetch per distinct expert per layer,
residents first, contributions summed in top-k order.
"""

from __future__ import annotations

import numpy as np

from czyx.inference.kernels.linear import mm_t
from czyx.inference.models.base import F32, sigmoid
from czyx.inference.models.decoder import DecoderConfig, Layer, MoEDecoder, common_config
from czyx.inference.models.granitemoe import softmax_of_top_k
from czyx.store.consumer import ModelInfo


class GptOssDecoder(MoEDecoder):
    """``GptOssForCausalLM`` in numpy."""

    arch = "gpt_oss"
    required_roles = (*MoEDecoder.required_roles, "sinks")
    optional_roles = (*MoEDecoder.optional_roles, "o_bias")
    sparse_roles = ("router", "router_bias", "expert_gate_up_bias", "expert_down_bias")

    @classmethod
    def parse_config(cls, info: ModelInfo) -> DecoderConfig:
        """GPT-OSS config: per-layer sliding windows from ``layer_types``."""
        c = info.config
        n = int(c["num_hidden_layers"])
        types = c.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)
        ]
        window = c.get("sliding_window") or None
        windows = [window if t == "sliding_attention" else None for t in types]
        return common_config(info, True, windows)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        c = self.consumer.info.config
        self.alpha = F32(c.get("swiglu_alpha", 1.702))
        self.limit = F32(c.get("swiglu_limit", 7.0))
        # Checkpoint biases interleave gate and up; the stored matrices do not.
        self.gu_bias: dict[int, np.ndarray] = {}
        for lw in self.layers:
            if self.cfg.sparse_layers[lw.index]:
                b = np.asarray(lw.expert_gate_up_bias, F32)
                self.gu_bias[lw.index] = np.concatenate([b[:, 0::2], b[:, 1::2]], axis=1)

    def attend(
        self, i: int, lw: Layer, q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: np.ndarray
    ) -> np.ndarray:
        """The base's attention with the layer's sink logits in each head's softmax."""
        return sink_attention(q, k, v, pos, self.cfg.sliding_windows[i], lw.sinks)

    def route(self, lw: Layer, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Top-k of the biased router logits, softmax over those k."""
        return softmax_of_top_k(mm_t(x, lw.router) + lw.router_bias, self.cfg.top_k)

    def _expert(self, i: int, e: int, x: np.ndarray, gate_up, down) -> np.ndarray:
        inter = self.gu_bias[i].shape[1] // 2
        gu = mm_t(x, gate_up) + self.gu_bias[i][e]
        gate = np.minimum(gu[:, :inter], self.limit)
        up = np.clip(gu[:, inter:], -self.limit, self.limit)
        act = (up + F32(1.0)) * (gate * sigmoid(gate * self.alpha))
        if self.observer is not None:
            self.observer(f"L{i}.E{e}.down_in", act)
        layer = self.layers[i]
        return mm_t(act, down) + layer.expert_down_bias[e]

    def _routed(self, i: int, lw: Layer, x: np.ndarray) -> np.ndarray:
        if self.route_hook is not None:
            self.route_hook(i, x)
        cfg = self.cfg
        idx, w = self.route(lw, x)
        self.count_routes(i, idx, w)
        t = x.shape[0]
        contrib = np.zeros((t, cfg.top_k, cfg.hidden_size), F32)
        cache = self.experts
        uniq = np.unique(idx)
        order = uniq[np.argsort(cache.table[i, uniq] < 0, kind="stable")]  # residents first
        for c0 in range(0, len(order), cache.max_acquire):
            group = order[c0 : c0 + cache.max_acquire]
            slots = cache.acquire(i, group)
            try:
                for j, s in enumerate(slots.tolist()):
                    e = int(group[j])
                    rows, ks = np.nonzero(idx == e)
                    if self.observer is not None:
                        self.observer(f"L{i}.E{e}.in", x[rows])
                    y = self._expert(i, e, x[rows], *cache.weights(s))
                    contrib[rows, ks] = y * w[rows, ks, None]
            finally:
                cache.release()
        return contrib.sum(axis=1)


def sink_attention(
    q: np.ndarray,
    k_all: np.ndarray,
    v_all: np.ndarray,
    q_positions: np.ndarray,
    sliding_window: int | None,
    sinks: np.ndarray,
) -> np.ndarray:
    """Grouped-query causal attention whose softmax has one extra sink logit per head.

    Shapes as :func:`czyx.inference.models.base.attention`; ``sinks [n_heads]``.
    """
    n_heads, t, hd = q.shape
    n_kv, length, _ = k_all.shape
    groups = n_heads // n_kv
    qg = q.reshape(n_kv, groups * t, hd)
    scores = (qg @ k_all.transpose(0, 2, 1)).reshape(n_kv, groups, t, length)
    scores *= F32(hd**-0.5)
    keys = np.arange(length)
    masked = keys[None, :] > q_positions[:, None]
    if sliding_window:
        masked |= (q_positions[:, None] - keys[None, :]) >= sliding_window
    np.copyto(scores, F32(-np.inf), where=masked[None, None])
    sink = np.asarray(sinks, F32).reshape(n_kv, groups, 1, 1)
    top = np.maximum(np.max(scores, axis=-1, keepdims=True), sink)
    scores -= top
    np.exp(scores, out=scores)
    denom = np.sum(scores, axis=-1, keepdims=True) + np.exp(sink - top)
    scores /= denom
    out = (scores.reshape(n_kv, groups * t, length) @ v_all).reshape(n_heads, t, hd)
    return out.transpose(1, 0, 2).reshape(t, n_heads * hd)
