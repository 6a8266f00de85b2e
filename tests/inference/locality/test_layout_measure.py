"""Run lengths, seeks and slots read on hand-made layouts, and the curve slots."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from czyx.inference.locality.curves_shim import CURVES, expert_slots
from czyx.inference.locality.errors import LocalityError
from czyx.inference.locality.layout_measure import measure_layout

from .conftest import make_trace


def test_runs_and_seeks_by_hand() -> None:
    tr = make_trace([[[0, 1], [2, 3]], [[0, 2], [1, 3]]], n_experts=4)
    slots = expert_slots("layer-major", 2, 4)
    m = measure_layout(tr, slots, window=1)
    # token 0: {0,1} one run, {6,7} one run; token 1: {0,2} two runs, {5,7} two runs
    assert m.seeks_per_token == pytest.approx(3.0)
    assert m.mean_run_length == pytest.approx(8 / 6)
    assert m.experts_per_token == 4.0
    g = measure_layout(tr, slots, window=1, max_gap=1)
    assert g.seeks_per_token == pytest.approx(2.0)
    assert g.slots_read_per_token == pytest.approx(5.0)
    w2 = measure_layout(tr, slots, window=2)  # token 0 reads {0,1,6,7}: two runs
    assert w2.seeks_per_token == pytest.approx((2 + 4) / 2)
    # a cache hit removes the request: token 0 layer 0 expert 1 cached
    hits = np.zeros(8, bool)
    hits[1] = True
    h = measure_layout(tr, slots, hits=hits, window=1)
    assert h.experts_per_token == pytest.approx(3.5)
    assert h.seeks_per_token == pytest.approx(3.0)


def test_a_class_order_changes_runs() -> None:
    tr = make_trace([[[0, 2]]] * 3, n_experts=4)
    assert measure_layout(tr, expert_slots("layer-major", 1, 4)).mean_run_length == 1.0
    class_of = np.array([[0, 2, 1, 3]])
    assert measure_layout(tr, expert_slots("layer-major", 1, 4, class_of)).mean_run_length == 2.0
    with pytest.raises(LocalityError, match="slots shape"):
        measure_layout(tr, np.zeros((2, 4), np.int64))


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 20), st.integers(1, 40), st.sampled_from(CURVES))
def test_slots_are_a_permutation(n_layers: int, n_experts: int, curve: str) -> None:
    s = expert_slots(curve, n_layers, n_experts)
    assert sorted(s.ravel().tolist()) == list(range(n_layers * n_experts))


def test_layer_major_is_row_major_and_class_order_applies() -> None:
    assert np.array_equal(expert_slots("layer-major", 3, 5), np.arange(15).reshape(3, 5))
    class_of = np.array([[1, 0, 2]])
    assert expert_slots("layer-major", 1, 3, class_of).tolist() == [[1, 0, 2]]
    with pytest.raises(LocalityError, match="unknown curve"):
        expert_slots("peano", 2, 2)
    with pytest.raises(LocalityError, match="class_of shape"):
        expert_slots("morton", 2, 2, np.zeros((1, 2), np.int64))


def test_hilbert_steps_between_grid_neighbours() -> None:
    slots = expert_slots("hilbert", 8, 8)
    cells = np.argwhere(slots >= 0)[np.argsort(slots.ravel())]
    steps = np.abs(np.diff(cells, axis=0)).sum(axis=1)
    assert np.all(steps == 1)
