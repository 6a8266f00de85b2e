"""Cache policies on hand-made request streams with known answers, and Belady's bound."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from czyx.inference.locality import replay
from czyx.inference.locality.errors import LocalityError

from .conftest import make_trace, random_trace


def ids(s: str) -> np.ndarray:
    return np.array([ord(c) - ord("a") for c in s], dtype=np.int64)


def test_lru_known_answers() -> None:
    assert replay.lru(ids("abab"), 2).tolist() == [False, False, True, True]
    assert replay.lru(ids("abcabc"), 2).sum() == 0  # the classic LRU worst case
    assert replay.lru(ids("abacab"), 2).tolist() == [0, 0, 1, 0, 1, 0]


def test_belady_known_answers() -> None:
    # abcabc with 2 slots: MIN keeps a and b, does not admit c: a, b hit
    assert replay.belady(ids("abcabc"), 2).sum() == 2
    # a b c b a with 2 slots: c is never used again, so MIN does not admit it
    assert replay.belady(ids("abcba"), 2).tolist() == [0, 0, 0, 1, 1]
    # a b c a with 2 slots: c is needed again, b is not: evict b
    assert replay.belady(ids("abcac"), 2).tolist() == [0, 0, 0, 1, 1]
    assert replay.belady(ids("aaaa"), 1).tolist() == [0, 1, 1, 1]


def test_next_use() -> None:
    assert replay.next_use(ids("abab")).tolist() == [2, 3, 4, 4]


def test_slru_protects_twice_used_items() -> None:
    # budget 2, protected 1: "a a" promotes a; b then c churn through probation; a survives
    h = replay.slru(ids("aabcda"), 2, protected_frac=0.5)
    assert h.tolist() == [0, 1, 0, 0, 0, 1]
    assert replay.lru(ids("aabcda"), 2).tolist() == [0, 1, 0, 0, 0, 0]


def test_hotness_keeps_the_frequent_item() -> None:
    # a is hot; a one-off b must not displace it when c arrives
    h = replay.hotness(ids("aaabca"), np.arange(6), 2, half_life=100.0)
    assert h.tolist() == [0, 1, 1, 0, 0, 1]
    # with an extremely short half-life old counts vanish: behaves like recency
    h2 = replay.hotness(ids("aaabca"), np.arange(6) * 1000, 2, half_life=1.0)
    assert h2.tolist() == [0, 1, 1, 0, 0, 0]


def test_pinned_never_evicts_the_hot_set() -> None:
    h = replay.pinned(ids("abcdbcda"), 2, pinned_ids=[0])
    assert h.tolist() == [0, 0, 0, 0, 0, 0, 0, 1]
    with pytest.raises(LocalityError, match="exceeds the budget"):
        replay.pinned(ids("ab"), 1, pinned_ids=[0, 1])


def test_request_stream_order_and_ids() -> None:
    tr = make_trace([[[1, 0], [2, 3]], [[0, 1], [3, 2]]], n_experts=4)
    got, tok = replay.request_stream(tr)
    assert got.tolist() == [1, 0, 6, 7, 0, 1, 7, 6]
    assert tok.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


def test_replay_checks_budget_and_policy() -> None:
    tr = random_trace(10, 2, 8, 2, seed=0)
    with pytest.raises(LocalityError, match="below top_k"):
        replay.replay(tr, "lru", 1)
    with pytest.raises(LocalityError, match="unknown policy"):
        replay.replay(tr, "fifo", 4)


@settings(max_examples=30, deadline=None)
@given(
    st.integers(1, 60),
    st.integers(1, 3),
    st.integers(2, 12),
    st.integers(0, 10_000),
    st.integers(0, 20),
)
def test_belady_bounds_every_policy(t: int, n_layers: int, e: int, seed: int, extra: int) -> None:
    tr = random_trace(t, n_layers, e, 2, seed)
    learn = random_trace(t, n_layers, e, 2, seed + 1)
    budget = 2 + extra % (n_layers * e)
    best = replay.replay(tr, "belady", budget).sum()
    for p in replay.POLICIES:
        h = replay.replay(tr, p, budget, learn=learn)
        assert h.sum() <= best, p
        assert len(h) == t * n_layers * 2
    # a cache holding everything misses only the first touch of each expert
    full = replay.replay(tr, "lru", n_layers * e)
    first = len(np.unique(replay.request_stream(tr)[0]))
    assert (~full).sum() == first == (~replay.replay(tr, "belady", n_layers * e)).sum()
