"""store.widen: the lazy trunk's fp16/bf16 widening gives numpy's bits, for every input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from czyx.store.io import widen as widen_mod
from czyx.store.io.widen import c_available, widen
from czyx.store.models.checkpoint import to_float32

ALL16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype == np.float32 and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_every_half_and_bf16_value_widens_to_numpys_bits():
    assert c_available()  # tests/test_native_built.py also requires the build
    assert _same(widen(ALL16.view(np.float16), "F16"), to_float32(ALL16.view(np.float16), "F16"))
    assert _same(widen(ALL16, "BF16"), to_float32(ALL16, "BF16"))


@settings(max_examples=30, deadline=None)
@given(
    hnp.arrays(np.uint16, hnp.array_shapes(min_dims=1, max_dims=3, max_side=9)),
    st.sampled_from(["F16", "BF16"]),
    st.booleans(),
)
def test_any_shape_and_layout(bits, dtype, transpose):
    arr = bits.view(np.float16) if dtype == "F16" else bits
    if transpose:  # a non-contiguous view is widened in its logical order
        arr = arr.T
    got = widen(arr, dtype)
    assert got.shape == arr.shape and _same(got, to_float32(arr, dtype))
    assert not np.shares_memory(got, arr)


def test_other_dtypes_and_the_fallback_are_numpys(monkeypatch):
    x = np.linspace(-3, 3, 17)
    assert _same(widen(x, "F64"), to_float32(x, "F64"))
    monkeypatch.setattr(widen_mod, "_c", None)
    monkeypatch.setattr(widen_mod, "_warned", False)
    half = ALL16[:4096].view(np.float16)
    with pytest.warns(RuntimeWarning, match="widening kernel unavailable"):
        assert _same(widen(half, "F16"), to_float32(half, "F16"))


@pytest.mark.parametrize("dtype", ["F16", "BF16"])
@pytest.mark.parametrize("kernel", [True, False])
def test_widen_into_a_preallocated_array(dtype, kernel, monkeypatch):
    src = ALL16.reshape(256, 256)
    arr = src.view(np.float16) if dtype == "F16" else src
    if not kernel:
        monkeypatch.setattr(widen_mod, "_c", None)
        monkeypatch.setattr(widen_mod, "_warned", True)
    out = np.full((256, 256), np.nan, np.float32)
    widen_mod.widen_into(out, arr, dtype)
    assert _same(out, to_float32(arr, dtype))
    with pytest.raises(ValueError, match="same size"):
        widen_mod.widen_into(out[:3], arr, dtype)
    with pytest.raises(ValueError, match="dtype"):
        widen_mod.widen_into(out, arr, "F32")
