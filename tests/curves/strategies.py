"""Shared hypothesis strategies for the curve tests."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

NDIMS = (2, 3)


@st.composite
def shape_and_points(draw, max_bits: int = 64, ndims: tuple[int, ...] = NDIMS, max_n: int = 40):
    """(ndim, bits, (N, ndim) uint64 array) with coordinates below 2**bits."""
    ndim = draw(st.sampled_from(ndims))
    bits = draw(st.integers(1, max_bits))
    n = draw(st.integers(1, max_n))
    pts = draw(
        st.lists(st.tuples(*[st.integers(0, (1 << bits) - 1)] * ndim), min_size=n, max_size=n)
    )
    return ndim, bits, np.array(pts, dtype=np.uint64).reshape(n, ndim)
