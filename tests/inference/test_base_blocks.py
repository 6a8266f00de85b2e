"""The prefill building blocks: small-block matmul, in-place SwiGLU, column-form experts."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from czyx.inference.models import base
from czyx.inference.models.base import matmul_small, silu, silu_mul_, swiglu_columns, swiglu_fused


def _rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(1, 300),
    k=st.integers(1, 96),
    n=st.integers(1, 40),
    limit=st.sampled_from([0, 4096, 30_000, 10**6]),
    seed=st.integers(0, 2**16),
)
def test_matmul_small_is_the_product_and_repeatable(m, k, n, limit, seed):
    rng = np.random.default_rng(seed)
    w, b = _rand(rng, m, k), _rand(rng, k, n)
    old = base.SMALL_GEMM
    base.SMALL_GEMM = limit
    try:
        got = matmul_small(w, b)
        out = np.full((m, n), np.nan, np.float32)
        again = matmul_small(w, b, out=out)  # into a given output: the same bits
        wide = np.zeros((m, k + 3), np.float32)
        wide[:, :k] = w
        strided = matmul_small(wide[:, :k], b)  # a strided weight: the per-block loop
    finally:
        base.SMALL_GEMM = old
    ref = w.astype(np.float64) @ b.astype(np.float64)
    tol = 1e-5 * (np.abs(w).astype(np.float64) @ np.abs(b).astype(np.float64)) + 1e-6
    assert got.dtype == np.float32 and got.shape == (m, n)
    assert np.all(np.abs(got - ref) <= tol)
    assert again is out and np.array_equal(again, got)
    assert np.all(np.abs(strided - ref) <= tol)


def test_matmul_small_blocks_a_tall_weight():
    """The case it exists for: more rows than one small block, with a remainder."""
    rng = np.random.default_rng(0)
    w, b = _rand(rng, 1000, 512), _rand(rng, 512, 16)  # 1e6 // (16*512) = 122 -> 112 rows
    got = matmul_small(w, b)
    np.testing.assert_allclose(got, w @ b, rtol=1e-4, atol=1e-4)


@given(seed=st.integers(0, 2**16), t=st.integers(1, 5), i=st.integers(1, 9))
def test_silu_mul_in_place_matches_the_expression(seed, t, i):
    rng = np.random.default_rng(seed)
    g, u = _rand(rng, t, i) * 30, _rand(rng, t, i)
    want = silu(g) * u
    out = silu_mul_(g, u)
    assert out is g and np.array_equal(out, want)


def test_swiglu_columns_matches_row_form():
    rng = np.random.default_rng(1)
    h, inter, t = 64, 48, 7
    gate_up, down, x = _rand(rng, 2 * inter, h), _rand(rng, h, inter), _rand(rng, t, h)
    seen = []
    y = swiglu_columns(np.ascontiguousarray(x.T), gate_up, down, seen.append).T
    act = silu(x @ gate_up[:inter].T) * (x @ gate_up[inter:].T)
    np.testing.assert_allclose(y, act @ down.T, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(seen[0], act, rtol=1e-4, atol=1e-4)
    assert np.array_equal(swiglu_fused(x, gate_up, down), y)
