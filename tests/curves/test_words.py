"""Multi-word ordinal helpers: exact conversion and every refusal."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from czyx.curves.errors import CurveError
from czyx.curves.words import check_coords, check_words, ints_to_words, n_words, words_to_ints


@given(
    st.integers(1, 192).flatmap(
        lambda b: st.tuples(st.just(b), st.lists(st.integers(0, (1 << b) - 1), max_size=20))
    )
)
def test_ints_words_roundtrip_and_order(arg):
    bits, vals = arg
    words = ints_to_words(vals, bits)
    assert words.shape == (len(vals), n_words(bits))
    assert words_to_ints(words) == vals
    # Row-lexicographic order of big-endian words is numeric order.
    rows = sorted(range(len(vals)), key=lambda i: tuple(words[i].tolist()))
    assert [vals[i] for i in rows] == sorted(vals)


def test_big_endian_bytes():
    v = (0x0123 << 128) | (0x4567 << 64) | 0x89AB
    w = ints_to_words([v], 183)
    assert w.astype(">u8").tobytes() == v.to_bytes(24, "big")


def test_ints_to_words_refuses_out_of_range():
    with pytest.raises(CurveError, match=r"ordinal\[1\]"):
        ints_to_words([0, 1 << 10], 10)
    with pytest.raises(CurveError, match=r"ordinal\[0\]"):
        ints_to_words([-1], 10)


def test_check_words_errors():
    with pytest.raises(CurveError, match="shape"):
        check_words(np.zeros((3, 2), np.uint64), 64)
    with pytest.raises(CurveError, match="integer"):
        check_words(np.zeros((3, 1), np.float64), 64)
    with pytest.raises(CurveError, match="negative"):
        check_words(np.array([[-1]], np.int64), 10)
    with pytest.raises(CurveError, match=r"ordinals\[1\]"):
        check_words(np.array([[0], [1 << 10]], np.uint64), 10)
    assert check_words(np.arange(4), 10).shape == (4, 1)  # 1-D accepted for one word


def test_check_coords_errors():
    with pytest.raises(CurveError, match="shape"):
        check_coords(np.zeros((3, 2), np.uint64), 3, 8)
    with pytest.raises(CurveError, match="integer"):
        check_coords(np.zeros((3, 3), np.float32), 3, 8)
    with pytest.raises(CurveError, match=r"coords\[1, 2\]: negative"):
        check_coords(np.array([[0, 0, 0], [0, 0, -5]]), 3, 8)
    with pytest.raises(CurveError, match=r"coords\[0, 1\]: 256"):
        check_coords(np.array([[0, 256, 0]]), 3, 8)
