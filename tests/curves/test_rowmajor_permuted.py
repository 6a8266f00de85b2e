"""Row-major and permuted curves, the curve registry and manifest round trips."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from czyx.curves import (
    Curve,
    HilbertCurve,
    MortonCurve,
    PermutedCurve,
    RowMajorCurve,
    curve_from_dict,
    make_curve,
)
from czyx.curves.errors import CurveError
from czyx.curves.words import words_to_ints
from tests.curves.strategies import shape_and_points


def test_rowmajor_vectors():
    r = RowMajorCurve(3, 4)
    assert r.encode((1, 2, 3)) == (1 << 8) | (2 << 4) | 3
    assert r.decode(0x123) == (1, 2, 3)
    assert [RowMajorCurve(2, 1).decode(i) for i in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]


@settings(max_examples=60, deadline=None)
@given(shape_and_points())
def test_rowmajor_roundtrip_and_order(arg):
    ndim, bits, pts = arg
    r = RowMajorCurve(ndim, bits)
    words = r.encode_array(pts)
    scalar = [r.encode(tuple(int(v) for v in p)) for p in pts]
    assert words_to_ints(words) == scalar
    assert np.array_equal(r.decode_array(words), pts)
    # Row-major order is lexicographic order of the coordinates.
    tuples = [tuple(int(v) for v in p) for p in pts]
    assert sorted(range(len(pts)), key=lambda i: scalar[i]) == sorted(
        range(len(pts)), key=lambda i: tuples[i]
    )


@st.composite
def permuted(draw):
    inner_cls = draw(st.sampled_from([MortonCurve, HilbertCurve, RowMajorCurve]))
    ndim = draw(st.sampled_from([2, 3]))
    bits = draw(st.integers(1, 61))
    perms = []
    for _ in range(ndim):
        if draw(st.booleans()):
            n = draw(st.integers(1, min(64, 1 << bits)))
            perms.append(draw(st.permutations(range(n))))
        else:
            perms.append(None)
    pts = draw(
        st.lists(st.tuples(*[st.integers(0, (1 << bits) - 1)] * ndim), min_size=1, max_size=20)
    )
    return PermutedCurve(inner_cls(ndim, bits), tuple(perms)), np.array(pts, np.uint64)


@settings(max_examples=60, deadline=None)
@given(permuted())
def test_permuted_roundtrip(arg):
    curve, pts = arg
    words = curve.encode_array(pts)
    scalar = [curve.encode(tuple(int(v) for v in p)) for p in pts]
    assert words_to_ints(words) == scalar
    assert np.array_equal(curve.decode_array(words), pts)
    assert [curve.decode(s) for s in scalar] == [tuple(int(v) for v in p) for p in pts]
    assert curve_from_dict(curve.to_dict()) == curve


def test_permuted_applies_before_inner():
    inner = RowMajorCurve(2, 2)
    c = PermutedCurve(inner, (None, (3, 2, 1, 0)))
    assert [c.encode((0, v)) for v in range(4)] == [3, 2, 1, 0]
    assert c.encode((1, 0)) == inner.encode((1, 3))
    # Values beyond the permutation's length pass through.
    c2 = PermutedCurve(RowMajorCurve(1, 3), ((1, 0),))
    assert [c2.encode((v,)) for v in range(8)] == [1, 0, 2, 3, 4, 5, 6, 7]


def test_permuted_errors():
    inner = MortonCurve(2, 2)
    with pytest.raises(CurveError, match="perms: expected 2"):
        PermutedCurve(inner, ((0, 1),))
    with pytest.raises(CurveError, match=r"perms\[1\]: not a permutation"):
        PermutedCurve(inner, (None, (0, 0, 1)))
    with pytest.raises(CurveError, match=r"perms\[0\]: length 5"):
        PermutedCurve(inner, ((0, 1, 2, 3, 4), None))
    with pytest.raises(CurveError, match=r"perms\[0\]: expected"):
        PermutedCurve(inner, ((0.0, 1.0), None))
    with pytest.raises(CurveError, match="inner"):
        PermutedCurve("morton", (None, None))


def test_registry_and_dicts():
    for name in ("morton", "hilbert", "rowmajor"):
        c = make_curve(name, 2, 7)
        assert isinstance(c, Curve) and c.name == name
        assert curve_from_dict(c.to_dict()) == c
    with pytest.raises(CurveError, match="curve name"):
        make_curve("peano")
    with pytest.raises(CurveError, match="'name'"):
        curve_from_dict({"ndim": 3})
    with pytest.raises(CurveError, match="missing 'bits'"):
        curve_from_dict({"name": "morton", "ndim": 3})
    with pytest.raises(CurveError, match="'inner' and 'perms'"):
        curve_from_dict({"name": "permuted"})
