"""DeepSeek-V3 (and R1, Kimi-K2, ...): latent attention, sigmoid group-limited routing.

Differences from the MLA base (:mod:`inference.models.mla`): the router
scores experts with a sigmoid; selection adds ``e_score_correction_bias``
(trunk role ``router_bias``) to the scores, keeps the ``topk_group`` groups
(of ``n_group``) whose two best biased scores sum highest, and takes the
top-k inside them; the weights are the unbiased scores of the chosen
experts, renormalised when ``norm_topk_prob`` (plus 1e-20, as transformers)
and multiplied by ``routed_scaling_factor``. ``rope_interleave`` (default
true) says the rotary channels are adjacent pairs. The multi-token-prediction
layer of a published checkpoint is kept by mount; ``--speculate mtp`` runs it as a
draft head (:mod:`czyx.inference.mtp`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from czyx.inference.errors import MissingTensorError
from czyx.inference.kernels.linear import mm_t
from czyx.inference.models.base import F32, forbid_experts, refuse_forbidden, sigmoid
from czyx.inference.models.decoder import DecoderConfig, Layer, MoEDecoder
from czyx.inference.models.mla import MLADecoder, mla_config
from czyx.store.consumer import ModelInfo


def top_k_desc(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices ``[T, k]`` of the ``k`` largest of each row, descending, ties to the lower index."""
    n = scores.shape[-1]
    part = (
        np.argpartition(-scores, k - 1, axis=-1)[:, :k]
        if k < n
        else np.tile(np.arange(n), (scores.shape[0], 1))
    )
    vals = np.take_along_axis(scores, part, axis=-1)
    order = np.lexsort((part, -vals), axis=-1)
    return np.take_along_axis(part, order, axis=-1)


def sigmoid_group_topk(
    logits: np.ndarray,
    bias: np.ndarray,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    scaling: float,
    mask: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-V3 / GLM-4.5 routing of router ``logits [T, E]``: ``(indices, weights)``.

    Sigmoid scores; selection on ``scores + bias`` within the ``topk_group``
    best groups (a group's score: the sum of its two best biased scores);
    weights are the unbiased scores, renormalised if asked, times ``scaling``.
    ``mask`` (``bool [E]``, a scoped portal's permitted experts) removes forbidden
    experts from the selection before groups are scored; a token that cannot fill
    its top-k from permitted experts is refused, never routed outside the grant.
    """
    scores = sigmoid(logits.astype(F32, copy=False))
    choice = forbid_experts(scores + bias, mask)
    t, e = choice.shape
    if n_group > 1 and topk_group < n_group:
        grouped = choice.reshape(t, n_group, e // n_group)
        best2 = np.sort(grouped, axis=-1)[..., -2:]
        group_scores = best2[..., 1] + best2[..., 0]
        keep = np.zeros((t, n_group), bool)
        np.put_along_axis(keep, top_k_desc(group_scores, topk_group), True, axis=-1)
        choice = np.where(np.repeat(keep, e // n_group, axis=-1), choice, F32(-np.inf))
    idx = top_k_desc(choice, top_k)
    refuse_forbidden(idx, mask)
    w = np.take_along_axis(scores, idx, axis=-1)
    if renormalize:
        w = w / (np.sum(w, axis=-1, keepdims=True) + F32(1e-20))
    w = w * F32(scaling)
    return idx.astype(np.int64, copy=False), w.astype(F32, copy=False)


def sigmoid_group_route(
    model: MoEDecoder, lw: Layer, x: np.ndarray, mask: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`sigmoid_group_topk` of ``x`` with ``model``'s router and config fields.

    The ``route`` of DeepSeek-V3 and GLM-4.5 (same routing, same config keys:
    ``n_group``, ``topk_group``, ``routed_scaling_factor``); a layer without its
    ``e_score_correction_bias`` is refused.
    """
    c = model.consumer.info.config
    if lw.router_bias is None:
        raise MissingTensorError(f"layer {lw.index} has no e_score_correction_bias")
    return sigmoid_group_topk(
        mm_t(x, lw.router),
        lw.router_bias,
        model.cfg.top_k,
        int(c.get("n_group") or 1),
        int(c.get("topk_group") or 1),
        model.cfg.renormalize,
        float(c.get("routed_scaling_factor") or 1.0),
        mask,
    )


class DeepseekV3Decoder(MLADecoder):
    """``DeepseekV3ForCausalLM`` in numpy."""

    arch = "deepseek_v3"

    @classmethod
    def parse_config(cls, info: ModelInfo) -> DecoderConfig:
        """DeepSeek-V3 config: ``norm_topk_prob`` (default true) and the latent dims."""
        return mla_config(info, bool(info.config.get("norm_topk_prob", True)))

    @classmethod
    def interleaved(cls, config: dict[str, Any]) -> bool:
        """``rope_interleave`` (transformers' default: true)."""
        return bool(config.get("rope_interleave", True))

    def route(
        self, lw: Layer, x: np.ndarray, mask: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Sigmoid, group-limited top-k with the selection bias (module docstring)."""
        return sigmoid_group_route(self, lw, x, mask)
