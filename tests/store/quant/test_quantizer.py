"""The weighted scale/offset search of store.quant.quantizer."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from czyx.store.quant.errors import FormatError, ShapeError
from czyx.store.quant.formats import SUPPORTED_BITS
from czyx.store.quant.quantizer import fit_groups, weighted_error


def _groups(seed: int, n: int, g: int, heavy: bool) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_t(2, size=(n, g)) if heavy else rng.standard_normal((n, g))
    return np.clip(x, -1e3, 1e3).astype(np.float32)


@settings(max_examples=40)
@given(
    seed=st.integers(0, 2**32 - 1),
    bits=st.sampled_from(SUPPORTED_BITS),
    heavy=st.booleans(),
    weighted=st.booleans(),
)
def test_search_never_worse_than_minmax_per_group(seed, bits, heavy, weighted):
    x = _groups(seed, 24, 32, heavy)
    rng = np.random.default_rng(seed ^ 0x5A5A)
    w = rng.exponential(size=x.shape).astype(np.float32) if weighted else None
    mm = fit_groups(x, bits, w, method="minmax")
    se = fit_groups(x, bits, w, method="search")
    e_mm = weighted_error(x, w, *mm)
    e_se = weighted_error(x, w, *se)
    assert (e_se <= e_mm * (1 + 1e-6) + 1e-30).all()
    assert (se[0] <= (1 << bits) - 1).all()


def test_search_improves_on_minmax_in_aggregate():
    x = _groups(11, 2000, 64, heavy=True)
    for bits in (2, 3, 4):
        e_mm = weighted_error(x, None, *fit_groups(x, bits, method="minmax")).sum()
        e_se = weighted_error(x, None, *fit_groups(x, bits, method="search")).sum()
        assert e_se < 0.9 * e_mm, bits


def test_weights_steer_the_fit():
    """Error weights move the grid toward the heavily weighted half of each group."""
    x = _groups(5, 500, 32, heavy=False)
    w = np.ones_like(x)
    w[:, :16] = 100.0
    plain = fit_groups(x, 2)
    steer = fit_groups(x, 2, w)
    left = np.zeros_like(x)
    left[:, :16] = 1.0
    assert weighted_error(x, left, *steer).sum() < 0.9 * weighted_error(x, left, *plain).sum()


def test_constant_and_zero_weight_groups():
    x = np.full((3, 32), 0.25, np.float32)
    x[2] = 0.0
    codes, scales, mins = fit_groups(x, 4, np.zeros_like(x))
    rec = (
        codes.astype(np.float32) * scales.astype(np.float32)[:, None]
        + mins.astype(np.float32)[:, None]
    )
    assert np.allclose(rec, x, atol=1e-3)


def test_input_errors():
    with pytest.raises(ShapeError):
        fit_groups(np.zeros(32, np.float32), 4)
    with pytest.raises(FormatError):
        fit_groups(np.full((1, 32), np.inf, np.float32), 4)
    with pytest.raises(FormatError):
        fit_groups(np.zeros((1, 32), np.float32), 4, np.full((1, 32), np.nan, np.float32))
    with pytest.raises(FormatError):
        fit_groups(np.zeros((1, 32), np.float32), 4, method="nope")
