"""Co-occurrence of routed experts within a layer and across adjacent layers.

Scope: pair counts, their ratio to what independent routing with the same
usage would give (lift), mutual information between adjacent layers against a
shuffled baseline, and how well layer ``l``'s selection predicts layer
``l+1``'s (the look-ahead a prefetcher would exploit).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from czyx.inference.trace import RoutingTrace


def within_layer(trace: RoutingTrace) -> np.ndarray:
    """Symmetric pair counts ``[L, E, E]``: tokens that selected both i and j in one layer.

    The diagonal is zero; each unordered pair of a token's k selections adds one
    to ``C[l, i, j]`` and to ``C[l, j, i]``.
    """
    L, E, k = trace.n_layers, trace.n_experts, trace.top_k
    e = trace.experts.astype(np.int64)
    base = (np.arange(L, dtype=np.int64) * E * E)[None, :]
    flat = np.zeros(L * E * E, dtype=np.int64)
    for a in range(k):
        for b in range(a + 1, k):
            flat += np.bincount((base + e[:, :, a] * E + e[:, :, b]).ravel(), minlength=L * E * E)
    c = flat.reshape(L, E, E)
    return c + c.transpose(0, 2, 1)


def adjacent_layers(trace: RoutingTrace) -> np.ndarray:
    """Transition counts ``[L-1, E, E]``: ``A[l, i, j]`` tokens with i at layer l and j at l+1."""
    L, E, k = trace.n_layers, trace.n_experts, trace.top_k
    if L < 2:
        return np.zeros((0, E, E), dtype=np.int64)
    e = trace.experts.astype(np.int64)
    base = (np.arange(L - 1, dtype=np.int64) * E * E)[None, :]
    flat = np.zeros((L - 1) * E * E, dtype=np.int64)
    for a in range(k):
        for b in range(k):
            idx = base + e[:, :-1, a] * E + e[:, 1:, b]
            flat += np.bincount(idx.ravel(), minlength=(L - 1) * E * E)
    return flat.reshape(L - 1, E, E)


def expected_within(counts: np.ndarray) -> np.ndarray:
    """Pair counts expected if each layer's pairs were drawn independently with the same usage.

    Parameters
    ----------
    counts : np.ndarray
        Observed ``[L, E, E]`` symmetric pair counts.

    Returns
    -------
    np.ndarray
        ``[L, E, E]`` float expectation with the same off-diagonal total per
        layer, proportional to ``u_i u_j`` (``u`` the pair marginals).
    """
    out = np.zeros(counts.shape, dtype=np.float64)
    for layer, c in enumerate(counts.astype(np.float64)):
        u = c.sum(axis=1)
        outer = np.outer(u, u)
        np.fill_diagonal(outer, 0.0)
        s = outer.sum()
        if s > 0:
            out[layer] = outer * (c.sum() / s)
    return out


def mutual_information_bits(joint: np.ndarray) -> float:
    """Mutual information (bits) of a joint count matrix."""
    j = joint.astype(np.float64)
    tot = j.sum()
    if tot <= 0:
        return 0.0
    p = j / tot
    px = p.sum(axis=1, keepdims=True)
    py = p.sum(axis=0, keepdims=True)
    mask = p > 0
    return float((p[mask] * np.log2(p[mask] / (px @ py)[mask])).sum())


@dataclass(frozen=True)
class CooccurSummary:
    """Headline co-occurrence figures of one layer (or layer pair).

    Attributes
    ----------
    layer : int
        Layer ``l`` (the pair ``(l, l+1)`` for cross-layer figures).
    top_pair_share : float
        Share of within-layer pair mass in the ``E`` heaviest unordered pairs.
    top_pair_share_independent : float
        The same share under :func:`expected_within`.
    mi_next_bits : float
        Mutual information between layer l's and layer l+1's selections.
    mi_next_shuffled_bits : float
        The same with layer l+1's rows shuffled across tokens (usage kept):
        the finite-sample floor.
    """

    layer: int
    top_pair_share: float
    top_pair_share_independent: float
    mi_next_bits: float
    mi_next_shuffled_bits: float


def _top_pair_share(c: np.ndarray, n: int) -> float:
    iu = np.triu_indices(c.shape[0], 1)
    v = np.sort(c[iu])[::-1]
    tot = v.sum()
    return float(v[:n].sum() / tot) if tot > 0 else 0.0


def summarize(trace: RoutingTrace, seed: int = 0) -> list[CooccurSummary]:
    """Per-layer :class:`CooccurSummary` (cross-layer figures are 0 for the last layer)."""
    c = within_layer(trace)
    ex = expected_within(c)
    a = adjacent_layers(trace)
    rng = np.random.default_rng(seed)
    # an independent token shuffle per layer pair keeps both marginals and breaks the link
    a_shuf = np.zeros_like(a)
    for layer in range(trace.n_layers - 1):
        p = rng.permutation(trace.n_tokens)
        e0 = trace.experts[:, layer].astype(np.int64)
        e1 = trace.experts[p, layer + 1].astype(np.int64)
        for i in range(trace.top_k):
            for j in range(trace.top_k):
                a_shuf[layer] += np.bincount(
                    e0[:, i] * trace.n_experts + e1[:, j], minlength=trace.n_experts**2
                ).reshape(trace.n_experts, trace.n_experts)
    out = []
    for layer in range(trace.n_layers):
        has_next = layer < trace.n_layers - 1
        out.append(
            CooccurSummary(
                layer=layer,
                top_pair_share=_top_pair_share(c[layer], trace.n_experts),
                top_pair_share_independent=_top_pair_share(ex[layer], trace.n_experts),
                mi_next_bits=mutual_information_bits(a[layer]) if has_next else 0.0,
                mi_next_shuffled_bits=mutual_information_bits(a_shuf[layer]) if has_next else 0.0,
            )
        )
    return out


def next_layer_recall(learn: RoutingTrace, measure: RoutingTrace, m: int) -> np.ndarray:
    """How well layer l's selection predicts layer l+1's, learned on one trace, measured on another.

    The predictor scores each layer-(l+1) expert by the summed transition
    counts (:func:`adjacent_layers` of ``learn``) from the token's layer-l
    experts and guesses the top ``m``. Returns ``[L-1, 2]``: column 0 the
    recall (share of layer-(l+1) selections inside the guess), column 1 the
    recall of the usage-only guess (the ``m`` most used layer-(l+1) experts).
    """
    a = adjacent_layers(learn).astype(np.float64)
    usage = np.zeros((learn.n_layers, learn.n_experts))
    for layer in range(learn.n_layers):
        usage[layer] = np.bincount(learn.experts[:, layer].ravel(), minlength=learn.n_experts)
    out = np.zeros((max(measure.n_layers - 1, 0), 2))
    e = measure.experts.astype(np.int64)
    for layer in range(measure.n_layers - 1):
        score = a[layer][e[:, layer]].sum(axis=1)  # [T, E]
        guess = np.argsort(-score, axis=1, kind="stable")[:, :m]
        hit = (guess[:, :, None] == e[:, layer + 1][:, None, :]).any(axis=1)
        out[layer, 0] = hit.mean()
        top = np.argsort(-usage[layer + 1], kind="stable")[:m]
        out[layer, 1] = np.isin(e[:, layer + 1], top).mean()
    return out
