"""Expert usage per layer: counts, entropy and the share of the most used experts.

Scope: order-0 statistics of a trace. A layer whose usage entropy is near
``log2(E)`` routes uniformly; a hot set only pays off when the top share is
well above ``h / E``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from czyx.inference.trace import RoutingTrace


@dataclass(frozen=True)
class LayerUsage:
    """Usage statistics of one MoE layer.

    Attributes
    ----------
    layer : int
        Trace layer index.
    entropy_bits : float
        Entropy of the selection histogram, bits.
    max_entropy_bits : float
        ``log2(E)``: the uniform value.
    top1_share, top_eighth_share : float
        Share of all selections taken by the most used expert, and by the most
        used ``ceil(E / 8)`` experts.
    experts_for_half : int
        Fewest experts that together take at least half the selections.
    """

    layer: int
    entropy_bits: float
    max_entropy_bits: float
    top1_share: float
    top_eighth_share: float
    experts_for_half: int


def usage_counts(trace: RoutingTrace) -> np.ndarray:
    """Selections per (layer, expert) as an int64 ``[L, E]`` array."""
    L, E = trace.n_layers, trace.n_experts
    flat = trace.experts.astype(np.int64) + (np.arange(L, dtype=np.int64) * E)[None, :, None]
    return np.bincount(flat.ravel(), minlength=L * E).reshape(L, E)


def entropy_bits(counts: np.ndarray) -> np.ndarray:
    """Entropy in bits of each row of a count matrix (zero rows give 0)."""
    counts = np.atleast_2d(np.asarray(counts, dtype=np.float64))
    tot = counts.sum(axis=1, keepdims=True)
    p = np.divide(counts, tot, out=np.zeros_like(counts), where=tot > 0)
    logp = np.log2(p, out=np.zeros_like(p), where=p > 0)
    return -(p * logp).sum(axis=1)


def usage_stats(trace: RoutingTrace) -> list[LayerUsage]:
    """Per-layer :class:`LayerUsage` of a trace."""
    counts = usage_counts(trace)
    E = trace.n_experts
    ent = entropy_bits(counts)
    h = -(-E // 8)
    out = []
    for layer, row in enumerate(counts):
        srt = np.sort(row)[::-1].astype(np.float64)
        tot = srt.sum() or 1.0
        cum = np.cumsum(srt) / tot
        out.append(
            LayerUsage(
                layer=layer,
                entropy_bits=float(ent[layer]),
                max_entropy_bits=float(np.log2(E)),
                top1_share=float(srt[0] / tot),
                top_eighth_share=float(cum[h - 1]),
                experts_for_half=int(np.searchsorted(cum, 0.5) + 1),
            )
        )
    return out
