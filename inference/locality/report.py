"""The whole locality experiment on a (learn, measure) pair of traces, as data and as text.

Scope: runs every analysis of this package with held-out evaluation
(orderings and hot sets learned on ``learn``, everything measured on
``measure``) and renders the result as Markdown tables. Used by ``czyx
locality`` and ``bench/locality.py``; no I/O beyond what the caller asks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from czyx.inference.locality import cooccur, ordering, replay, temporal, usage
from czyx.inference.locality.curves_shim import expert_slots
from czyx.inference.locality.layout_measure import measure_layout
from czyx.inference.trace import RoutingTrace


def default_budgets(trace: RoutingTrace) -> list[int]:
    """Cache budgets (slots) at 1/16, 1/8, 1/4, 1/2 and 3/4 of all experts, at least top_k."""
    total = trace.n_layers * trace.n_experts
    fracs = (1 / 16, 1 / 8, 1 / 4, 1 / 2, 3 / 4)
    return sorted({max(trace.top_k, round(total * f)) for f in fracs})


def layouts(learn: RoutingTrace, n_random: int = 5, seed: int = 0) -> dict[str, np.ndarray]:
    """Candidate layouts ``name -> slots [L, E]``, class orders learned on ``learn``.

    ``identity/*`` uses the router's own (arbitrary) indices; ``random/*`` is
    averaged by the caller over ``n_random`` seeded permutations (a check that
    the identity is not accidentally good or bad); ``learned/*`` is
    :func:`ordering.learn_class_order`; ``aligned/*`` is
    :func:`ordering.aligned_class_order`.
    """
    L, E = learn.n_layers, learn.n_experts
    learned = ordering.learn_class_order(learn)
    aligned = ordering.aligned_class_order(learn)
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for curve in ("layer-major", "morton", "hilbert"):
        out[f"identity/{curve}"] = expert_slots(curve, L, E)
        for r in range(n_random):
            perm = np.stack([rng.permutation(E) for _ in range(L)])
            out[f"random{r}/{curve}"] = expert_slots(curve, L, E, perm)
        out[f"learned/{curve}"] = expert_slots(curve, L, E, learned)
        out[f"aligned/{curve}"] = expert_slots(curve, L, E, aligned)
    return out


def analyze(
    learn: RoutingTrace,
    measure: RoutingTrace,
    budgets: Sequence[int] | None = None,
    *,
    policies: Sequence[str] = replay.POLICIES,
    layout_budget_policy: str = "lru",
) -> dict[str, Any]:
    """Run the experiment; returns a JSON-ready dict (see :func:`to_markdown`)."""
    budgets = list(budgets or default_budgets(measure))
    res: dict[str, Any] = {
        "learn_tokens": learn.n_tokens,
        "measure_tokens": measure.n_tokens,
        "n_layers": measure.n_layers,
        "n_experts": measure.n_experts,
        "top_k": measure.top_k,
        "budgets": budgets,
    }
    res["usage"] = [asdict(u) for u in usage.usage_stats(measure)]
    res["cooccur"] = [asdict(c) for c in cooccur.summarize(measure)]
    rec = cooccur.next_layer_recall(learn, measure, m=measure.top_k * 2)
    res["next_layer_recall"] = {
        "m": measure.top_k * 2,
        "model": rec[:, 0].tolist(),
        "usage_only": rec[:, 1].tolist(),
    }
    tr = temporal.temporal_reuse(measure)
    res["temporal"] = {
        "lags": list(tr.lags),
        "observed": tr.observed.mean(axis=1).tolist(),
        "shuffled": tr.shuffled.mean(axis=1).tolist(),
        "observed_per_layer": tr.observed.tolist(),
    }
    c_learn, c_meas = cooccur.within_layer(learn), cooccur.within_layer(measure)
    learned = ordering.learn_class_order(learn)
    order = ordering.invert(learned)
    res["ordering"] = {
        "method": "per layer: best of spectral (Fiedler) and greedy-chain, each + 2-opt",
        "adjacent_pair_share_learn": [
            ordering.path_weight(c_learn[i], order[i]) / max(c_learn[i].sum() / 2, 1)
            for i in range(learn.n_layers)
        ],
        "adjacent_pair_share_measure": [
            ordering.path_weight(c_meas[i], order[i]) / max(c_meas[i].sum() / 2, 1)
            for i in range(measure.n_layers)
        ],
        "adjacent_pair_share_identity": [
            ordering.path_weight(c_meas[i], np.arange(measure.n_experts))
            / max(c_meas[i].sum() / 2, 1)
            for i in range(measure.n_layers)
        ],
        "class_of": learned.tolist(),
    }
    hit_rates: dict[str, list[float]] = {}
    masks: dict[int, np.ndarray] = {}
    for p in policies:
        hit_rates[p] = []
        for b in budgets:
            h = replay.replay(measure, p, b, learn=learn)
            hit_rates[p].append(float(h.mean()))
            if p == layout_budget_policy:
                masks[b] = h
    res["hit_rates"] = hit_rates
    lay = layouts(learn)
    rows: dict[str, dict[str, Any]] = {}
    for name, slots in lay.items():
        kind, curve = name.split("/")
        key = ("random" if kind.startswith("random") else kind) + "/" + curve
        row: dict[str, Any] = {}
        for window in (1, 2, measure.n_layers):
            m = measure_layout(measure, slots, window=window)
            row[f"run_w{window}"] = m.mean_run_length
            row[f"seeks_w{window}"] = m.seeks_per_token
            for b in budgets:
                mb = measure_layout(measure, slots, hits=masks.get(b), window=window)
                row[f"seeks_w{window}_b{b}"] = mb.seeks_per_token
                row[f"run_w{window}_b{b}"] = mb.mean_run_length
                row[f"experts_w{window}_b{b}"] = mb.experts_per_token
        g1 = measure_layout(measure, slots, window=1, max_gap=1)
        row["seeks_w1_gap1"] = g1.seeks_per_token
        row["slots_w1_gap1"] = g1.slots_read_per_token
        acc = rows.setdefault(key, {"_n": 0})
        acc["_n"] += 1
        for k2, v in row.items():
            acc[k2] = acc.get(k2, 0.0) + v
    for acc in rows.values():
        n = acc.pop("_n")
        for k2 in acc:
            acc[k2] /= n
    res["layouts"] = rows
    res["layout_budget_policy"] = layout_budget_policy
    return res


def _f(x: float, nd: int = 3) -> str:
    return f"{x:.{nd}f}"


def to_markdown(res: dict[str, Any]) -> str:
    """Markdown tables of an :func:`analyze` result."""
    L, E, k = res["n_layers"], res["n_experts"], res["top_k"]
    out: list[str] = []
    out.append(
        f"Traces: learn {res['learn_tokens']:,} tokens, measure {res['measure_tokens']:,} tokens; "
        f"{L} MoE layers x {E} experts, top-{k}.\n"
    )
    out.append("### Expert usage per layer (measure trace)\n")
    out.append("| layer | entropy (bits) | max | top-1 share | top-1/8 share | experts for 50% |")
    out.append("| --- | --- | --- | --- | --- | --- |")
    for u in res["usage"]:
        out.append(
            f"| {u['layer']} | {_f(u['entropy_bits'])} | {_f(u['max_entropy_bits'])} | "
            f"{_f(u['top1_share'])} | {_f(u['top_eighth_share'])} | {u['experts_for_half']} |"
        )
    out.append("\n### Co-occurrence\n")
    nl = res["next_layer_recall"]
    out.append(
        f"Pair share: share of within-layer pair mass in the {E} heaviest pairs, observed vs "
        "independent routing with the same usage. MI: mutual information between layer l and "
        f"l+1 selections vs a token-shuffled floor. Recall@{nl['m']}: share of layer l+1's "
        "selections inside a guess of that many experts from layer l's (transitions learned "
        "on the learn trace) vs the most-used-only guess.\n"
    )
    out.append(
        "| layer | pair share | independent | MI next (bits) | shuffled | "
        f"recall@{nl['m']} | usage-only |"
    )
    out.append("| --- | --- | --- | --- | --- | --- | --- |")
    for c in res["cooccur"]:
        i = c["layer"]
        has = i < L - 1
        out.append(
            f"| {i} | {_f(c['top_pair_share'])} | {_f(c['top_pair_share_independent'])} | "
            + (
                f"{_f(c['mi_next_bits'])} | {_f(c['mi_next_shuffled_bits'])} | "
                f"{_f(nl['model'][i])} | {_f(nl['usage_only'][i])} |"
                if has
                else "- | - | - | - |"
            )
        )
    t = res["temporal"]
    out.append("\n### Temporal reuse (share of token t's experts also chosen by token t-lag)\n")
    out.append("| lag | observed | shuffled (same usage) | ratio |")
    out.append("| --- | --- | --- | --- |")
    for g, o, s in zip(t["lags"], t["observed"], t["shuffled"]):
        out.append(f"| {g} | {_f(o)} | {_f(s)} | {_f(o / s if s else float('nan'), 2)} |")
    o = res["ordering"]
    out.append(
        "\n### Class ordering\n\nMethod: " + o["method"] + ". Share of a layer's within-layer "
        "co-routed pairs that land on adjacent class values:\n"
    )
    out.append("| layer | identity (measure) | learned (learn) | learned (measure, held out) |")
    out.append("| --- | --- | --- | --- |")
    for i in range(L):
        out.append(
            f"| {i} | {_f(o['adjacent_pair_share_identity'][i])} | "
            f"{_f(o['adjacent_pair_share_learn'][i])} | {_f(o['adjacent_pair_share_measure'][i])} |"
        )
    out.append("\n### Cache hit rate by policy and budget (measure trace)\n")
    bud = res["budgets"]
    total = L * E
    out.append("| policy | " + " | ".join(f"{b} slots ({b / total:.0%})" for b in bud) + " |")
    out.append("| --- |" + " --- |" * len(bud))
    for p, rates in res["hit_rates"].items():
        out.append(f"| {p} | " + " | ".join(_f(r) for r in rates) + " |")
    out.append(
        "\n### Layouts: mean contiguous run length and seeks per token\n\n"
        "w1 = per-layer fetch groups (what the engine issues), w2 = with one layer of "
        f"look-ahead, w{L} = all layers at once (upper bound, not realisable). Seeks at a "
        f"budget use the misses of {res['layout_budget_policy'].upper()} at that budget. "
        "`random` is the mean of 5 seeded permutations.\n"
    )
    mid = bud[len(bud) // 2]
    out.append(
        f"| layout | run w1 | run w2 | run w{L} | seeks/token w1 | seeks w1 @ {mid} slots | "
        f"seeks w2 @ {mid} | seeks w1, gap 1 | slots read w1, gap 1 |"
    )
    out.append("| --- |" + " --- |" * 8)
    for name, r in res["layouts"].items():
        out.append(
            f"| {name} | {_f(r['run_w1'])} | {_f(r['run_w2'])} | {_f(r[f'run_w{L}'])} | "
            f"{_f(r['seeks_w1'], 2)} | {_f(r[f'seeks_w1_b{mid}'], 2)} | "
            f"{_f(r[f'seeks_w2_b{mid}'], 2)} | {_f(r['seeks_w1_gap1'], 2)} | "
            f"{_f(r['slots_w1_gap1'], 2)} |"
        )
    return "\n".join(out) + "\n"
