"""Qwen3-Next: gated-DeltaNet linear attention beside gated full attention, routed MoE.

Differences from the shared base:

* ``layer_types`` (or every ``full_attention_interval``-th layer, default 4)
  picks each layer's token mixer: ``linear_attention`` layers are gated
  DeltaNet (:mod:`inference.models.deltanet`: a causal convolution, the gated
  delta rule over a recurrent state, a gated RMS norm, ``out_proj`` stored as
  the ``o_proj`` role); ``full_attention`` layers are attention whose
  ``q_proj`` also yields a per-head output gate (``out * sigmoid(gate)``
  before ``o_proj``), with per-head q/k RMS norms and partial rotary
  (``partial_rotary_factor``, default 0.25).
* Every RMS norm but the DeltaNet's gated one scales by ``1 + weight``
  (zero-centred weights); the loaded weights are stored as ``1 + w`` (the
  same float32 product transformers computes). A version read from llama.cpp's
  GGUF already holds ``1 + w`` (``NORMS_HOLD_ONE_PLUS``) and its ``A`` as
  ``lin_neg_a`` (``-exp(A_log)``): both are used as the file has them, since
  neither inverse is exact in float32 (see :meth:`Qwen3NextDecoder._a_log`).
* The MoE block adds a shared expert behind a sigmoid gate (as Qwen2-MoE);
  ``norm_topk_prob`` (default true) renormalises the top-k.
* The cache is a :class:`~inference.models.deltanet.HybridCache`: KV for the
  attention layers only, and a constant-size state per linear layer, so a
  decoded token costs O(1) in the linear layers whatever the length reached.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from czyx.inference.cache import ExpertCache
from czyx.inference.errors import UnsupportedModelError
from czyx.inference.kernels.linear import Weight, mm_t
from czyx.inference.models.base import F32, KVCache, attention, rms_norm, sigmoid
from czyx.inference.models.decoder import (
    DecoderConfig,
    Layer,
    MoEDecoder,
    common_config,
)
from czyx.inference.models.deltanet import (
    DeltaNetDims,
    HybridCache,
    gated_rms_norm,
    gdn,
    run_recurrent,
    split_projections,
)
from czyx.inference.models.hybrid import HybridDecoder
from czyx.store.consumer import ModelConsumer, ModelInfo
from czyx.store.models.archs import LINEAR_ATTN_ROLES, NORMS_HOLD_ONE_PLUS, ONE_PLUS_ROLES

LINEAR, FULL = "linear_attention", "full_attention"


def layer_types(config: dict[str, Any], n_layers: int) -> tuple[str, ...]:
    """Each layer's mixer: ``layer_types``, else every ``full_attention_interval``-th is full.

    Raises
    ------
    UnsupportedModelError
        A type other than linear and full attention, or a list of the wrong length.
    """
    types = config.get("layer_types")
    if types is None:
        every = int(config.get("full_attention_interval") or 4)
        types = [LINEAR if (i + 1) % every else FULL for i in range(n_layers)]
    if len(types) != n_layers:
        raise UnsupportedModelError(f"layer_types lists {len(types)} layers, not {n_layers}")
    odd = sorted({t for t in types if t not in (LINEAR, FULL)})
    if odd:
        raise UnsupportedModelError(f"layer types {odd} (Qwen3-Next has {LINEAR} and {FULL})")
    return tuple(types)


class Qwen3NextDecoder(HybridDecoder):
    """``Qwen3NextForCausalLM`` in numpy, its DeltaNet recurrence in C (``czk_gdn``)."""

    arch = "qwen3_next"
    required_roles = ("input_norm", "post_attn_norm", "o_proj")
    optional_roles = ()
    attention_roles: ClassVar[tuple[str, ...]] = ("q_proj", "k_proj", "v_proj", "q_norm", "k_norm")
    sparse_roles = (
        "router",
        "shared_gate_proj",
        "shared_up_proj",
        "shared_down_proj",
        "shared_expert_gate",
    )
    window_roles = MoEDecoder.window_roles | frozenset(("lin_qkvz", "lin_ba"))

    def __init__(
        self, consumer: ModelConsumer, experts: ExpertCache, trunk_window: int | None = None
    ) -> None:
        c = consumer.info.config
        self.layer_types = layer_types(c, int(consumer.info.n_layers))
        self.dims = DeltaNetDims.from_config(c)
        full = [i for i, t in enumerate(self.layer_types) if t == FULL]
        linear = [i for i, t in enumerate(self.layer_types) if t == LINEAR]
        self._place(full, linear)
        self._norms_held = bool(c.get(NORMS_HOLD_ONE_PLUS))
        self._a_logs: dict[int, np.ndarray] = {}  # layer -> log(-A) of a GGUF source's A
        super().__init__(consumer, experts, trunk_window)

    @classmethod
    def parse_config(cls, info: ModelInfo) -> DecoderConfig:
        """Qwen3-Next config: no attention biases, ``norm_topk_prob`` (default true)."""
        c = info.config
        if c.get("attention_bias"):
            raise UnsupportedModelError("config attention_bias=true (qwen3_next) is not supported")
        n = int(c["num_hidden_layers"])
        layer_types(c, n)
        return common_config(info, bool(c.get("norm_topk_prob", True)), [None] * n)

    # ------------------------------------------------------------------ loading

    def _trunk(self, role: str, layer: int | None, shape: tuple[int, ...] | None) -> Weight:
        t = super()._trunk(role, layer, shape)
        if role in ONE_PLUS_ROLES and isinstance(t, np.ndarray) and not self._norms_held:
            t = F32(1.0) + t  # transformers: normed * (1.0 + weight), in float32
        return t

    def _mixer_roles(self, i: int) -> tuple[str, ...]:
        if self.layer_types[i] != LINEAR:
            return self.attention_roles
        if self.consumer.has_trunk("lin_neg_a", i):  # a GGUF source: A, not A_log
            return tuple("lin_neg_a" if r == "lin_a_log" else r for r in LINEAR_ATTN_ROLES)
        return LINEAR_ATTN_ROLES

    def _a_log(self, i: int, lw: Layer) -> np.ndarray:
        """Layer ``i``'s ``A_log``, or for a GGUF source ``log(-A)`` of its ``A``.

        The DeltaNet kernel takes ``A_log`` (it computes ``-exp(A_log)`` itself), so a
        file's ``A = -exp(A_log)`` goes in as ``log(-A)``: exact to about an ulp of A, not
        bit for bit (a kernel taking A would make it llama.cpp's own arithmetic).
        """
        if lw.lin_a_log is not None:
            return lw.lin_a_log
        a_log = self._a_logs.get(i)
        if a_log is None:
            neg_a = np.asarray(lw.lin_neg_a, F32)
            if not (neg_a < 0).all():  # (NaN included): no A_log gives it
                raise UnsupportedModelError(f"layer {i}: ssm_a holds a value not below 0")
            a_log = self._a_logs[i] = np.log(-neg_a).astype(F32)
        return a_log

    # ------------------------------------------------------------------ mixers

    def _attention(
        self, i: int, lw: Layer, x: np.ndarray, kv: KVCache, start: int, positions: np.ndarray
    ) -> np.ndarray:
        if self.observer is not None:
            self.observer(f"L{i}.attn_in", x)
        if self.layer_types[i] == LINEAR:
            return self._linear_attention(i, lw, x, kv, start)
        return self._gated_attention(i, lw, x, kv, start, positions)

    def _gated_attention(
        self, i: int, lw: Layer, x: np.ndarray, kv: KVCache, start: int, positions: np.ndarray
    ) -> np.ndarray:
        """Full attention with per-head q/k norms, partial rotary and a sigmoid output gate."""
        cfg = self.cfg
        t, hd, eps = x.shape[0], cfg.head_dim, cfg.rms_eps
        qg = mm_t(x, lw.q_proj).reshape(t, cfg.n_heads, 2 * hd)  # per head: query, then gate
        gate = qg[:, :, hd:].reshape(t, cfg.n_heads * hd)
        q = rms_norm(qg[:, :, :hd], lw.q_norm, eps).transpose(1, 0, 2)
        k = rms_norm(mm_t(x, lw.k_proj).reshape(t, cfg.n_kv_heads, hd), lw.k_norm, eps)
        v = mm_t(x, lw.v_proj).reshape(t, cfg.n_kv_heads, hd).transpose(1, 0, 2)
        q = self.rotary.apply(q, positions)
        k = self.rotary.apply(k.transpose(1, 0, 2), positions)
        j = self.slot[i]
        kv.write(j, start, k, v)
        end = start + t
        out = attention(q, kv.k[j][:, :end], kv.v[j][:, :end], positions, None)
        out = out * sigmoid(gate)
        if self.observer is not None:
            self.observer(f"L{i}.o_in", out)
        return mm_t(out, lw.o_proj)

    def _linear_attention(
        self, i: int, lw: Layer, x: np.ndarray, kv: KVCache, start: int
    ) -> np.ndarray:
        """Gated DeltaNet over ``x [T, H]``, advancing layer ``i``'s conv and DeltaNet states."""
        if not isinstance(kv, HybridCache):
            raise UnsupportedModelError("a qwen3_next model runs on its own new_kv() cache")
        d, t = self.dims, x.shape[0]
        mixed, z, b, a = split_projections(mm_t(x, lw.lin_qkvz), mm_t(x, lw.lin_ba), d)
        j = self.slot[i]
        conv_w = lw.lin_conv.reshape(d.conv_dim, d.conv_kernel)
        pool = self.kernels().pool.ptr if self._czk else None  # the decode kernels' threads
        a_log = self._a_log(i, lw)
        core = run_recurrent(
            kv, j, start, t,
            lambda lo, hi: gdn(mixed[lo:hi], b[lo:hi], a[lo:hi], conv_w, a_log,
                               lw.lin_dt_bias, kv.conv[j], kv.state[j], d, pool),
        )  # fmt: skip
        y = gated_rms_norm(core, z, lw.lin_norm, self.cfg.rms_eps).reshape(t, d.value_dim)
        if self.observer is not None:
            self.observer(f"L{i}.o_in", y)
        return mm_t(y, lw.o_proj)

    # ------------------------------------------------------------------ MoE

    def routed_extra(self, lw: Layer, x: np.ndarray, routed: np.ndarray) -> np.ndarray:
        """Add the sigmoid-gated shared expert."""
        return self.add_gated_shared(lw, x, routed)
