"""Two-level expert layout: compaction, inverses, runs, permutations, manifest form."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from czyx.curves import make_curve
from czyx.curves.errors import CurveError
from czyx.curves.layout import ExpertLayout


@st.composite
def layouts(draw):
    nl = draw(st.integers(1, 24))
    nc = draw(st.integers(1, 40))
    outer = draw(st.sampled_from(["morton", "hilbert", "rowmajor"]))
    perm = None
    if draw(st.booleans()):
        perm = [draw(st.permutations(range(nc))) for _ in range(nl)]
    return ExpertLayout(nl, nc, outer, perm)


@settings(max_examples=50, deadline=None)
@given(layouts())
def test_slots_are_a_compact_order_preserving_bijection(lay):
    cells = [(l, e) for l in range(lay.n_layers) for e in range(lay.n_classes)]
    slots = [lay.ordinal(l, e) for l, e in cells]
    assert sorted(slots) == list(range(lay.n_slots)) == list(range(len(cells)))  # no holes
    assert all(lay.cell(s) == c for s, c in zip(slots, cells))
    # Compaction keeps the outer curve's order.
    raw = [lay.curve_ordinal(l, e) for l, e in cells]
    assert all(r < lay.curve_span for r in raw)
    assert sorted(range(len(cells)), key=lambda i: raw[i]) == sorted(
        range(len(cells)), key=lambda i: slots[i]
    )
    la = np.array([c[0] for c in cells])
    ea = np.array([c[1] for c in cells])
    assert lay.ordinal_array(la, ea).tolist() == slots
    assert lay.cell_array(np.array(slots)).tolist() == [list(c) for c in cells]
    assert lay.slot_table[la, ea].tolist() == slots
    assert lay.cell_table[slots].tolist() == [list(c) for c in cells]
    assert not lay.slot_table.flags.writeable
    assert lay.class_array(la, ea).tolist() == [lay.class_of(l, e) for l, e in cells]
    for l, e in cells[:50]:
        assert lay.expert_of(l, lay.class_of(l, e)) == e
    # The curve sees (layer, class value): the permutation applies first.
    curve = make_curve(lay.outer, 2, max(1, (max(lay.n_layers, lay.n_classes) - 1).bit_length()))
    l, e = cells[-1]
    assert lay.curve_ordinal(l, e) == curve.encode((l, lay.class_of(l, e)))
    assert ExpertLayout.from_dict(json.loads(json.dumps(lay.to_dict()))) == lay


@settings(max_examples=50, deadline=None)
@given(layouts(), st.data())
def test_runs_cover_exactly_the_set(lay, data):
    picks = data.draw(
        st.lists(
            st.tuples(st.integers(0, lay.n_layers - 1), st.integers(0, lay.n_classes - 1)),
            max_size=30,
        )
    )
    runs = lay.runs(picks)
    covered = [s for start, n in runs for s in range(start, start + n)]
    assert covered == sorted({lay.ordinal(l, e) for l, e in picks})
    # Maximal and disjoint: a gap of at least one slot between runs.
    assert all(a[0] + a[1] < b[0] for a, b in itertools.pairwise(runs))
    assert lay.runs(np.array(picks, dtype=np.int64).reshape(-1, 2)) == runs


def test_rowmajor_is_plain_arithmetic_and_morton_vector():
    r = ExpertLayout(3, 6, "rowmajor")
    assert [r.ordinal(l, e) for l in range(3) for e in range(6)] == list(range(18))
    m = ExpertLayout(2, 2, "morton")  # (layer, class) Morton, layer most significant
    assert [m.ordinal(0, 0), m.ordinal(0, 1), m.ordinal(1, 0), m.ordinal(1, 1)] == [0, 1, 2, 3]
    m = ExpertLayout(3, 5, "morton")
    assert m.n_slots == 15 and m.curve_span == 64
    assert [m.ordinal(0, e) for e in range(5)] == [0, 1, 4, 5, 12]
    assert m.runs([(0, 0), (0, 1), (1, 0), (2, 4)]) == [(0, 3), (14, 1)]


def test_identity_permutation_is_no_permutation():
    assert ExpertLayout(3, 4, "hilbert", [0, 1, 2, 3]) == ExpertLayout(3, 4, "hilbert")
    assert ExpertLayout(3, 4, "hilbert", [0, 1, 2, 3]).to_dict()["class_perm"] is None


def test_shared_permutation_and_class_mapping():
    perm = [3, 1, 0, 2]
    lay = ExpertLayout(2, 4, "rowmajor", perm)  # one order for every layer
    assert [lay.class_of(1, e) for e in range(4)] == perm
    assert [lay.ordinal(0, e) for e in range(4)] == perm
    assert lay.expert_of(1, 3) == 0


def test_errors():
    with pytest.raises(CurveError, match="n_layers"):
        ExpertLayout(0, 4)
    with pytest.raises(CurveError, match="n_classes"):
        ExpertLayout(2, (1 << 16) + 1)
    with pytest.raises(CurveError, match="n_classes"):
        ExpertLayout(2, 4.0)
    with pytest.raises(CurveError, match="outer"):
        ExpertLayout(2, 4, "zigzag")
    with pytest.raises(CurveError, match="class_perm: expected shape"):
        ExpertLayout(2, 4, class_perm=[[0, 1, 2, 3]] * 3)
    with pytest.raises(CurveError, match=r"class_perm\[1\]"):
        ExpertLayout(2, 4, class_perm=[[0, 1, 2, 3], [0, 1, 1, 3]])
    with pytest.raises(CurveError, match="class_perm: expected integers"):
        ExpertLayout(2, 2, class_perm=[0.0, 1.0])
    lay = ExpertLayout(2, 4)
    with pytest.raises(CurveError, match="layer"):
        lay.ordinal(2, 0)
    with pytest.raises(CurveError, match="expert"):
        lay.ordinal(0, -1)
    with pytest.raises(CurveError, match="ordinal"):
        lay.cell(8)
    with pytest.raises(CurveError, match="class"):
        lay.expert_of(0, 4)
    with pytest.raises(CurveError, match=r"expert\[1\]"):
        lay.ordinal_array([0, 1], [0, 4])
    with pytest.raises(CurveError, match="layer: expected integers"):
        lay.ordinal_array([0.5], [0])
    with pytest.raises(CurveError, match=r"ordinal\[0\]"):
        lay.cell_array([9])
    with pytest.raises(CurveError, match="ordinal: expected integers"):
        lay.cell_array([1.0])
    with pytest.raises(CurveError, match="pairs"):
        lay.runs([(0, 1, 2)])
    assert lay.runs([]) == []
    good = lay.to_dict()
    for change, field in (
        ({"version": 2}, "version"),
        ({"inner": "morton"}, "inner"),
        ({"compaction": "none"}, "compaction"),
    ):
        with pytest.raises(CurveError, match=field):
            ExpertLayout.from_dict({**good, **change})
    with pytest.raises(CurveError, match="missing 'outer'"):
        ExpertLayout.from_dict({k: v for k, v in good.items() if k != "outer"})
    with pytest.raises(CurveError, match="dict"):
        ExpertLayout.from_dict([1])
