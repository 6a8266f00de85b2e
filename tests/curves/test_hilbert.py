"""Hilbert curve: pinned vectors, hilbertcurve / numpy-hilbert-curve agreement, adjacency."""

from __future__ import annotations

import hilbert as nphilbert  # numpy-hilbert-curve
import numpy as np
import pytest
from hilbertcurve.hilbertcurve import HilbertCurve as RefHilbert
from hypothesis import given, settings
from hypothesis import strategies as st

from czyx.curves import HilbertCurve
from czyx.curves.errors import CurveError
from czyx.curves.hilbert import hilbert_decode_np, hilbert_encode_np
from czyx.curves.words import ints_to_words, words_to_ints
from tests.curves.strategies import shape_and_points

# The 4x4 Hilbert curve, ordinal -> (axis0, axis1): the sequence printed in the
# hilbertcurve README for p=2, n=2 (Skilling's orientation).
HILBERT_2D_ORDER2 = [
    (0, 0), (1, 0), (1, 1), (0, 1), (0, 2), (0, 3), (1, 3), (1, 2),
    (2, 2), (2, 3), (3, 3), (3, 2), (3, 1), (2, 1), (2, 0), (3, 0),
]  # fmt: skip


def test_published_vectors():
    h = HilbertCurve(2, 2)
    assert [h.decode(i) for i in range(16)] == HILBERT_2D_ORDER2
    assert [h.encode(p) for p in HILBERT_2D_ORDER2] == list(range(16))
    h3 = HilbertCurve(3, 1)  # the unit cube is the 3-bit Gray code, axis 0 most significant
    assert [h3.decode(i) for i in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 1), (0, 1, 0), (1, 1, 0), (1, 1, 1), (1, 0, 1), (1, 0, 0),
    ]  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(shape_and_points())
def test_roundtrip_all_paths(arg):
    ndim, bits, pts = arg
    h = HilbertCurve(ndim, bits)
    words = h.encode_array(pts)
    scalar = [h.encode(tuple(int(v) for v in p)) for p in pts]
    assert words_to_ints(words) == scalar
    assert np.array_equal(hilbert_encode_np(pts, bits), words)  # numpy path == C path
    assert np.array_equal(h.decode_array(words), pts)
    assert np.array_equal(hilbert_decode_np(words, ndim, bits), pts)
    assert [h.decode(s) for s in scalar] == [tuple(int(v) for v in p) for p in pts]


@settings(max_examples=25, deadline=None)
@given(shape_and_points(max_bits=10, ndims=(4,)))
def test_four_dimensions_numpy_path(arg):
    ndim, bits, pts = arg
    h = HilbertCurve(ndim, bits)
    words = h.encode_array(pts)
    assert words_to_ints(words) == [h.encode(tuple(int(v) for v in p)) for p in pts]
    assert np.array_equal(h.decode_array(words), pts)


@settings(max_examples=60, deadline=None)
@given(shape_and_points(max_bits=64, max_n=8))
def test_matches_hilbertcurve(arg):
    ndim, bits, pts = arg
    ref = RefHilbert(bits, ndim)
    h = HilbertCurve(ndim, bits)
    assert words_to_ints(h.encode_array(pts)) == ref.distances_from_points(pts.tolist())


@settings(max_examples=60, deadline=None)
@given(shape_and_points(max_bits=21))
def test_matches_numpy_hilbert_curve(arg):
    ndim, bits, pts = arg  # that package needs ndim * bits <= 64
    h = HilbertCurve(ndim, bits)
    # (that package also squeezes a single row to a scalar)
    ref = np.atleast_1d(nphilbert.encode(pts.astype(np.int64), ndim, bits))
    assert np.array_equal(h.encode_array(pts)[:, 0], ref.astype(np.uint64))
    back = nphilbert.decode(ref, ndim, bits).reshape(-1, ndim)
    assert np.array_equal(h.decode_array(ref.astype(np.uint64)), back.astype(np.uint64))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([2, 3]), st.integers(1, 64), st.data())
def test_consecutive_ordinals_are_neighbours(ndim, bits, data):
    h = HilbertCurve(ndim, bits)
    last = h.size - 2
    starts = data.draw(st.lists(st.integers(0, last), min_size=1, max_size=20))
    a = h.decode_array(ints_to_words(starts, h.total_bits)).astype(object)
    b = h.decode_array(ints_to_words([s + 1 for s in starts], h.total_bits)).astype(object)
    diff = np.abs(a - b)
    assert (diff.sum(axis=1) == 1).all()  # exactly one axis moves, by exactly 1
    # And the scalar path agrees.
    s = starts[0]
    assert sum(abs(u - v) for u, v in zip(h.decode(s), h.decode(s + 1))) == 1


def test_full_curve_small_is_a_hamiltonian_path():
    h = HilbertCurve(3, 3)
    pts = h.decode_array(np.arange(h.size, dtype=np.uint64)).astype(np.int64)
    assert len({tuple(p) for p in pts.tolist()}) == h.size
    assert (np.abs(np.diff(pts, axis=0)).sum(axis=1) == 1).all()


def test_errors():
    h = HilbertCurve(2, 3)
    with pytest.raises(CurveError, match=r"coords\[0\]: 8"):
        h.encode((8, 0))
    with pytest.raises(CurveError, match="ordinal"):
        h.decode(64)
    with pytest.raises(CurveError, match="shape"):
        h.encode_array(np.zeros((2, 3), np.uint64))
    with pytest.raises(CurveError, match=r"ordinals\[2\]"):
        h.decode_array(np.array([0, 1, 64], np.uint64))
