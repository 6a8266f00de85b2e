"""Class orderings: permutations, planted structure recovered, the mount hand-off."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from czyx.inference.locality import ordering
from czyx.inference.locality.errors import LocalityError

from .conftest import make_trace, random_trace


def planted(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A weight matrix whose heavy edges form a hidden path ``secret``."""
    rng = np.random.default_rng(seed)
    secret = rng.permutation(n)
    w = rng.random((n, n)) * 0.1
    w = w + w.T
    for a, b in itertools.pairwise(secret):
        w[a, b] = w[b, a] = 10.0
    np.fill_diagonal(w, 0)
    return w, secret


@pytest.mark.parametrize("n", [5, 16, 40])
def test_planted_path_is_recovered(n: int) -> None:
    w, secret = planted(n, seed=n)
    order, _ = ordering.best_order(w)
    assert ordering.path_weight(w, order) >= ordering.path_weight(w, secret) - 1e-9
    assert sorted(order.tolist()) == list(range(n))


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 30), st.integers(0, 10_000))
def test_two_opt_never_loses_and_orders_are_permutations(n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    w = rng.random((n, n))
    w = w + w.T
    for start in (ordering.spectral_order(w), ordering.greedy_chain(w), rng.permutation(n)):
        assert sorted(start.tolist()) == list(range(n))
        better = ordering.two_opt(w, start)
        assert sorted(better.tolist()) == list(range(n))
        assert ordering.path_weight(w, better) >= ordering.path_weight(w, start) - 1e-9


def test_invert() -> None:
    o = np.array([[2, 0, 1], [0, 1, 2]])
    inv = ordering.invert(o)
    assert inv.tolist() == [[1, 2, 0], [0, 1, 2]]
    assert np.array_equal(np.take_along_axis(inv, o, axis=1), np.tile(np.arange(3), (2, 1)))


def test_learned_order_puts_co_routed_pairs_adjacent() -> None:
    # experts always routed in pairs {0,5}, {3,7}, {1,6}, {2,4}: a learned order makes
    # every pair adjacent; the identity order makes none adjacent
    pairs = [(0, 5), (3, 7), (1, 6), (2, 4)]
    tr = make_trace([[list(pairs[i % 4])] for i in range(40)], n_experts=8)
    class_of = ordering.learn_class_order(tr)
    ordering.check_class_order(class_of, 1, 8, "test")
    for a, b in pairs:
        assert abs(int(class_of[0, a]) - int(class_of[0, b])) == 1


def test_aligned_order_follows_the_previous_layer() -> None:
    # layer 1 expert (e + 3) % 8 always follows layer 0 expert e: it gets e's class
    rng = np.random.default_rng(0)
    e0 = np.argsort(rng.random((300, 8)), axis=1)[:, :2]
    tr = make_trace(np.stack([e0, (e0 + 3) % 8], axis=1).tolist(), n_experts=8)
    c = ordering.aligned_class_order(tr)
    ordering.check_class_order(c, 2, 8, "test")
    assert np.array_equal(c[1][(np.arange(8) + 3) % 8], c[0])


def test_class_order_from_trace_npz_and_npy(tmp_path) -> None:
    tr = random_trace(50, 3, 16, 2, seed=3)
    p = tr.save(tmp_path / "t.npz")
    c = ordering.class_order_from_trace(p)
    assert c.shape == (3, 16) and c.dtype == np.int64
    ordering.check_class_order(c, 3, 16, "x")
    np.save(tmp_path / "o.npy", c)
    assert np.array_equal(ordering.class_order_from_trace(tmp_path / "o.npy"), c)
    np.save(tmp_path / "bad.npy", np.zeros((3, 16), np.int64))
    with pytest.raises(LocalityError, match="not a permutation"):
        ordering.class_order_from_trace(tmp_path / "bad.npy")
