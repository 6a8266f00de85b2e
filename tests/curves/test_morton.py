"""Morton curve: pinned bit convention, reference libraries, C/numpy/scalar agreement."""

from __future__ import annotations

import numpy as np
import pymorton
import pytest
import zCurve
from hypothesis import given, settings
from hypothesis import strategies as st

from czyx.curves import MortonCurve, _native
from czyx.curves.errors import CurveError
from czyx.curves.morton import deinterleave_np, interleave_np
from czyx.curves.words import words_to_ints
from tests.curves.strategies import shape_and_points


def test_published_vectors_3d():
    m = MortonCurve(3, 2)
    # Axis 0 most significant in each group: (z, y, x) = (1, 0, 0) -> 0b100.
    assert m.encode((1, 0, 0)) == 4
    assert m.encode((0, 1, 0)) == 2
    assert m.encode((0, 0, 1)) == 1
    assert m.encode((3, 1, 3)) == 0b101_111  # high group (1,0,1), low group (1,1,1)
    # Classic 2x2x2 Z-order visit sequence, x fastest.
    assert [m.decode(i) for i in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1),
        (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1),
    ]  # fmt: skip


def test_published_vectors_2d():
    m = MortonCurve(2, 2)
    # The 4x4 Z-order table with (row, col): row is axis 0.
    table = [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]]
    for r in range(4):
        for c in range(4):
            assert m.encode((r, c)) == table[r][c]


@settings(max_examples=60, deadline=None)
@given(shape_and_points())
def test_roundtrip_all_paths(arg):
    ndim, bits, pts = arg
    m = MortonCurve(ndim, bits)
    words = m.encode_array(pts)
    scalar = [m.encode(tuple(int(v) for v in p)) for p in pts]
    assert words.shape == (len(pts), m.n_words)
    assert words_to_ints(words) == scalar
    assert np.array_equal(interleave_np(pts, bits), words)  # numpy path == C path
    assert np.array_equal(m.decode_array(words), pts)
    assert np.array_equal(deinterleave_np(words, ndim, bits), pts)
    assert [m.decode(s) for s in scalar] == [tuple(int(v) for v in p) for p in pts]


@settings(max_examples=30, deadline=None)
@given(shape_and_points(max_bits=12, ndims=(1, 4, 5)))
def test_other_dimensions_numpy_path(arg):
    ndim, bits, pts = arg
    m = MortonCurve(ndim, bits)
    words = m.encode_array(pts)
    assert words_to_ints(words) == [m.encode(tuple(int(v) for v in p)) for p in pts]
    assert np.array_equal(m.decode_array(words), pts)


@settings(max_examples=60, deadline=None)
@given(shape_and_points(max_bits=61, max_n=5))
def test_matches_zcurve(arg):
    ndim, bits, pts = arg
    m = MortonCurve(ndim, bits)
    for p in pts.tolist():
        # zCurve puts its first argument least significant: pass the axes reversed.
        assert m.encode(tuple(p)) == zCurve.interlace(*reversed(p), dims=ndim, bits_per_dim=bits)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, (1 << 10) - 1), st.integers(0, (1 << 10) - 1), st.integers(0, 1023))
def test_matches_pymorton_where_it_is_exact(z, y, x):
    # pymorton silently truncates inputs above 10 bits in 3-D and 16 bits in
    # 2-D, so it is a reference only up to those widths.
    assert MortonCurve(3, 10).encode((z, y, x)) == pymorton.interleave3(x, y, z)
    a = (z << 6) | (y & 63)
    assert MortonCurve(2, 16).encode((a, x)) == pymorton.interleave2(x, a)


def test_full_width_extremes():
    m = MortonCurve(3, 61)
    top = (1 << 61) - 1
    assert m.encode((top, top, top)) == (1 << 183) - 1
    assert m.encode_array(np.array([[top, top, top]], np.uint64)).tolist() == [
        [(1 << 55) - 1, (1 << 64) - 1, (1 << 64) - 1]
    ]
    assert m.decode((1 << 183) - 1) == (top, top, top)


def test_errors():
    m = MortonCurve(3, 4)
    with pytest.raises(CurveError, match="expected 3 coordinates"):
        m.encode((1, 2))
    with pytest.raises(CurveError, match=r"coords\[1\]: 16"):
        m.encode((1, 16, 0))
    with pytest.raises(CurveError, match=r"coords\[2\]: -1"):
        m.encode((1, 1, -1))
    with pytest.raises(CurveError, match=r"coords\[0\]"):
        m.encode((1.5, 1, 1))
    with pytest.raises(CurveError, match="not a sequence"):
        m.encode(5)
    with pytest.raises(CurveError, match="ordinal"):
        m.decode(1 << 12)
    with pytest.raises(CurveError, match="ordinal"):
        m.decode(-1)
    with pytest.raises(CurveError, match="ordinal"):
        m.decode("3")
    with pytest.raises(CurveError, match=r"ordinals\[0\]"):
        m.decode_array(np.array([1 << 12], np.uint64))
    with pytest.raises(ValueError, match="bits"):
        MortonCurve(3, 65)
    with pytest.raises(ValueError, match="ndim"):
        MortonCurve(0, 4)
    with pytest.raises(ValueError, match="ndim"):
        MortonCurve(17, 4)
    with pytest.raises(ValueError, match="ndim"):
        MortonCurve("3", 4)


@pytest.mark.parametrize("ndim", [2, 3, 5])
def test_empty_arrays(ndim):
    m = MortonCurve(ndim, 61)
    words = m.encode_array(np.zeros((0, ndim), np.uint64))
    assert words.shape == (0, m.n_words)
    assert m.decode_array(words).shape == (0, ndim)


def test_kernel_state_is_reported():
    # Either the C kernel serves 2-D and 3-D or the numpy path does; never a mix.
    assert _native.available(2) == _native.available(3) == (_native.LIB is not None)
    assert not _native.available(4)
