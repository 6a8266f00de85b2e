"""Usage, co-occurrence and temporal reuse on hand-made traces."""

from __future__ import annotations

import numpy as np
import pytest

from czyx.inference.locality import cooccur, temporal, usage

from .conftest import make_trace, random_trace


def test_usage_counts_and_entropy() -> None:
    tr = make_trace([[[0, 1], [2, 3]], [[0, 2], [2, 1]]], n_experts=4)
    assert usage.usage_counts(tr).tolist() == [[2, 1, 1, 0], [0, 1, 2, 1]]
    st = usage.usage_stats(tr)
    assert st[0].entropy_bits == pytest.approx(1.5)
    assert st[0].top1_share == pytest.approx(0.5)
    assert st[0].experts_for_half == 1
    assert st[1].experts_for_half == 1
    assert usage.entropy_bits(np.ones((1, 8)))[0] == pytest.approx(3.0)


def test_within_and_adjacent_counts() -> None:
    tr = make_trace([[[0, 1], [2, 3]], [[1, 0], [2, 1]]], n_experts=4)
    c = cooccur.within_layer(tr)
    assert c[0, 0, 1] == c[0, 1, 0] == 2
    assert c[1, 2, 3] == 1 and c[1, 1, 2] == 1 and c[1].sum() == 4
    assert np.all(np.diagonal(c, axis1=1, axis2=2) == 0)
    a = cooccur.adjacent_layers(tr)
    assert a.shape == (1, 4, 4)
    assert a[0, 0, 2] == 2 and a[0, 1, 3] == 1 and a[0, 0, 1] == 1 and a[0].sum() == 8


def test_mutual_information() -> None:
    assert cooccur.mutual_information_bits(np.eye(4) * 10) == pytest.approx(2.0)
    assert cooccur.mutual_information_bits(np.ones((4, 4))) == pytest.approx(0.0)


def test_next_layer_recall_on_a_deterministic_chain() -> None:
    # layer 1's experts are a function of layer 0's: recall@2 is perfect
    rng = np.random.default_rng(0)
    e0 = np.argsort(rng.random((200, 8)), axis=1)[:, :2]
    e1 = (e0 + 3) % 8
    tr = make_trace(np.stack([e0, e1], axis=1).tolist(), n_experts=8)
    rec = cooccur.next_layer_recall(tr, tr, m=2)
    assert rec[0, 0] == pytest.approx(1.0)
    assert rec[0, 1] < 0.6  # usage alone cannot know
    s = cooccur.summarize(tr)
    assert s[0].mi_next_bits > s[0].mi_next_shuffled_bits + 0.5


def test_temporal_reuse_repeating_vs_random() -> None:
    rep = make_trace([[[0, 1]]] * 6 + [[[2, 3]]] * 6, n_experts=8)
    assert temporal.overlap_at_lag(rep.experts, rep.segments, 1)[0] == pytest.approx(10 / 11)
    tr = temporal.temporal_reuse(rep, lags=(1,), draws=5)
    assert tr.ratio()[0] > 1.5
    rnd = random_trace(400, 2, 8, 2, seed=1)
    rr = temporal.temporal_reuse(rnd, lags=(1, 2), draws=5)
    assert np.all(np.abs(rr.ratio() - 1.0) < 0.25)
    seg = make_trace([[[0, 1]], [[0, 1]]], n_experts=4, segments=[0, 1])
    assert np.isnan(temporal.overlap_at_lag(seg.experts, seg.segments, 1)[0])
    with pytest.raises(ValueError, match="lag"):
        temporal.overlap_at_lag(seg.experts, seg.segments, 0)
