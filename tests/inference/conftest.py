"""Fixtures the inference tests share: the C kernels' SIMD paths and thread splits."""

from __future__ import annotations

import pytest

from czyx.inference.kernels import fused


@pytest.fixture(params=fused.LEVELS)
def level(request):
    """The kernels capped at each SIMD path the machine has (the others are skipped)."""
    if not fused.have_czk():
        pytest.skip("the C kernels are not built")
    if fused.LEVELS.index(request.param) > fused._lib.czk_level():
        pytest.skip(f"no {request.param} on this machine")
    fused.set_level_cap(request.param)
    yield request.param
    fused.set_level_cap("avx512vnni")


@pytest.fixture
def split_loops():
    """Every pool loop of more than one task splits over the pool's threads."""
    fused.set_min_work(1)
    yield
    fused.set_min_work(1 << 16)
