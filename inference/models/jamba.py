"""Jamba: Mamba (selective state space) layers beside attention layers, MoE every other layer.

Differences from the shared base:

* Each ``attn_layer_period``-th layer (from ``attn_layer_offset``) is attention,
  without rotary embeddings (Jamba's attention has no positions: the Mamba
  layers order the tokens); every other layer is a Mamba mixer
  (:mod:`inference.models.mamba`; its ``out_proj`` is the ``o_proj`` role).
* Each ``expert_layer_period``-th layer (from ``expert_layer_offset``) routes
  to experts (softmax top-k, not renormalised); the others are dense SwiGLU.
* The cache is a :class:`~inference.models.deltanet.HybridCache`: KV for the
  attention layers, a conv and a scan state per Mamba layer (O(1) per token).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from czyx.inference.cache import ExpertCache
from czyx.inference.errors import UnsupportedModelError
from czyx.inference.kernels.linear import mm_t
from czyx.inference.models.base import KVCache, attention, rms_norm
from czyx.inference.models.decoder import DecoderConfig, Layer, MoEDecoder, common_config
from czyx.inference.models.deltanet import HybridCache, run_recurrent
from czyx.inference.models.hybrid import HybridDecoder
from czyx.inference.models.mamba import MambaDims, conv_silu, neg_a_of, scan
from czyx.store.consumer import ModelConsumer, ModelInfo
from czyx.store.models.archs import MAMBA_ROLES

ATTENTION, MAMBA = "attention", "mamba"


def block_types(config: dict[str, Any], n_layers: int) -> tuple[str, ...]:
    """Each layer's mixer, as ``JambaConfig.layers_block_type`` computes it."""
    period = int(config.get("attn_layer_period") or 8)
    offset = config.get("attn_layer_offset")
    offset = 4 if offset is None else int(offset)
    return tuple(ATTENTION if i % period == offset else MAMBA for i in range(n_layers))


class JambaDecoder(HybridDecoder):
    """``JambaForCausalLM`` in numpy, its Mamba convolution and scan in C."""

    arch = "jamba"
    required_roles = ("input_norm", "post_attn_norm", "o_proj")
    optional_roles = ()
    window_roles = MoEDecoder.window_roles | frozenset(("mamba_in_proj", "mamba_x_proj"))

    def __init__(
        self, consumer: ModelConsumer, experts: ExpertCache, trunk_window: int | None = None
    ) -> None:
        c = consumer.info.config
        self.block_types = block_types(c, int(consumer.info.n_layers))
        self.dims = MambaDims.from_config(c)
        attn = [i for i, t in enumerate(self.block_types) if t == ATTENTION]
        mamba = [i for i, t in enumerate(self.block_types) if t == MAMBA]
        self._place(attn, mamba)
        self._neg_a: dict[int, np.ndarray] = {}  # layer -> -exp(A_log), made on first use
        super().__init__(consumer, experts, trunk_window)

    @classmethod
    def parse_config(cls, info: ModelInfo) -> DecoderConfig:
        """Jamba config: no projection biases in the Mamba layers, top-k not renormalised."""
        c = info.config
        if c.get("mamba_proj_bias"):
            raise UnsupportedModelError("config mamba_proj_bias=true (jamba) is not supported")
        n = int(c["num_hidden_layers"])
        return common_config(info, False, [None] * n)

    def _mixer_roles(self, i: int) -> tuple[str, ...]:
        if self.block_types[i] == MAMBA:
            has_bias = self.consumer.has_trunk("mamba_conv_bias", i)
            # a GGUF source holds llama.cpp's A = -exp(A_log) (mamba_neg_a): used as it is
            neg_a = self.consumer.has_trunk("mamba_neg_a", i)
            swap = {"mamba_a_log": "mamba_neg_a"} if neg_a else {}
            return tuple(swap.get(r, r) for r in MAMBA_ROLES if r != "mamba_conv_bias" or has_bias)
        return ("q_proj", "k_proj", "v_proj")

    def _attention(
        self, i: int, lw: Layer, x: np.ndarray, kv: KVCache, start: int, positions: np.ndarray
    ) -> np.ndarray:
        if self.observer is not None:
            self.observer(f"L{i}.attn_in", x)
        if self.block_types[i] == MAMBA:
            return self._mamba(i, lw, x, kv, start)
        cfg = self.cfg
        t, hd = x.shape[0], cfg.head_dim
        q = mm_t(x, lw.q_proj).reshape(t, cfg.n_heads, hd).transpose(1, 0, 2)
        k = mm_t(x, lw.k_proj).reshape(t, cfg.n_kv_heads, hd).transpose(1, 0, 2)
        v = mm_t(x, lw.v_proj).reshape(t, cfg.n_kv_heads, hd).transpose(1, 0, 2)
        j = self.slot[i]
        kv.write(j, start, k, v)  # no rotary embedding: Jamba's attention has no positions
        end = start + t
        out = attention(np.ascontiguousarray(q), kv.k[j][:, :end], kv.v[j][:, :end], positions,
                        None)  # fmt: skip
        if self.observer is not None:
            self.observer(f"L{i}.o_in", out)
        return mm_t(out, lw.o_proj)

    def _mamba(self, i: int, lw: Layer, x: np.ndarray, kv: KVCache, start: int) -> np.ndarray:
        """The Mamba mixer over ``x [T, H]``, advancing layer ``i``'s conv and scan states."""
        if not isinstance(kv, HybridCache):
            raise UnsupportedModelError("a jamba model runs on its own new_kv() cache")
        d, eps = self.dims, self.cfg.rms_eps
        inner, r, n = d.inner, d.dt_rank, d.d_state
        xz = mm_t(x, lw.mamba_in_proj)
        j = self.slot[i]
        conv_w = lw.mamba_conv.reshape(inner, d.d_conv)
        # The convolution needs no later token: it runs over the whole chunk first, its
        # states after each token kept (while tracking) for the snapshots below.
        conv_after: list[np.ndarray] = []

        def conv_step(lo: int, hi: int) -> np.ndarray:
            out = conv_silu(xz[lo:hi, :inner], conv_w, lw.mamba_conv_bias, kv.conv[j])
            if kv.tracking:
                conv_after.append(kv.conv[j].copy())
            return out

        t = x.shape[0]
        xc = conv_step(0, t) if not kv.tracking else np.concatenate(
            [conv_step(s, s + 1) for s in range(t)]
        )  # fmt: skip
        if self.observer is not None:  # calibration: the inputs of the inner matrices
            self.observer(f"L{i}.mamba.x_in", xc)
        proj = mm_t(xc, lw.mamba_x_proj)
        dt_in = rms_norm(proj[:, :r], lw.mamba_dt_norm, eps)
        if self.observer is not None:
            self.observer(f"L{i}.mamba.dt_in", dt_in)
        dt = mm_t(dt_in, lw.mamba_dt_proj)
        b = rms_norm(proj[:, r : r + n], lw.mamba_b_norm, eps)
        c = rms_norm(proj[:, r + n :], lw.mamba_c_norm, eps)
        z = xz[:, inner:]
        # Tracking rewinds the conv state per token (below): keep the final one to restore.
        final_conv = kv.conv[j].copy() if kv.tracking else None
        neg_a = self._neg_a.get(i)
        if neg_a is None:  # -exp(A_log): the layer's constant, computed once
            held = lw.mamba_neg_a  # (a GGUF source's own A: llama.cpp's very numbers)
            neg_a = neg_a_of(lw.mamba_a_log) if held is None else np.ascontiguousarray(held)
            self._neg_a[i] = neg_a
        pool = self.kernels().pool.ptr if self._czk else None  # the decode kernels' threads

        def scan_step(lo: int, hi: int) -> np.ndarray:
            if kv.tracking:  # the snapshot after token lo pairs its conv and scan states
                kv.conv[j][...] = conv_after[lo]
            return scan(xc[lo:hi], dt[lo:hi], lw.mamba_dt_bias, neg_a, b[lo:hi],
                        c[lo:hi], lw.mamba_d, z[lo:hi], kv.state[j], pool)  # fmt: skip

        y = run_recurrent(kv, j, start, t, scan_step)
        if final_conv is not None:
            kv.conv[j][...] = final_conv
        if self.observer is not None:
            self.observer(f"L{i}.o_in", y)
        return mm_t(y, lw.o_proj)
