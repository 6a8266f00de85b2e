"""Quantized products: C (AVX2 and portable paths) vs the numpy reference vs float64."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from czyx.inference.kernels import ops, prepare, qmatmul, qmatvec
from czyx.store.quant.errors import PackedBufferError, ShapeError
from czyx.store.quant.formats import dequantize, get_format, quantize

FORMAT_NAMES = ("q2", "q3", "q4", "q8", "q2g32", "q3g32", "q4g64", "q8g64")
needs_c = pytest.mark.skipif(
    not ops.have_c(), reason="inference._qkernels not built (python setup.py build_ext --inplace)"
)


def _case(seed: int, fmt_name: str, rows: int, ngroups: int, nvec: int):
    fmt = get_format(fmt_name)
    cols = ngroups * fmt.group_size
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    buf = quantize(w, fmt, method="minmax")
    x = rng.standard_normal((nvec, cols)).astype(np.float32)
    wq = dequantize(buf, fmt, (rows, cols)).astype(np.float64)
    exact = x.astype(np.float64) @ wq.T
    tol = 2e-6 * (np.abs(x).astype(np.float64) @ np.abs(wq).T) + 1e-6
    return fmt, buf, x, exact, tol


@pytest.fixture(params=list(ops.SIMD_LEVELS))
def c_path(request):
    if not ops.have_c():
        pytest.skip("inference._qkernels not built (python setup.py build_ext --inplace)")
    want = ops.SIMD_LEVELS.index(request.param)
    if ops._lib.qk_simd_level() < want:
        pytest.skip(f"this CPU lacks {request.param}: that path cannot run here")
    ops.set_simd_cap(request.param)
    yield request.param
    ops.set_simd_cap("avx512")


# c_path only selects the kernel path for the whole test: sharing it across
# the generated inputs is what we want.
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 2**32 - 1),
    fmt_name=st.sampled_from(FORMAT_NAMES),
    rows=st.integers(1, 21),
    ngroups=st.integers(1, 4),
    nvec=st.sampled_from([1, 2, 5, 16, 19]),
)
def test_c_matches_reference_and_float64(c_path, seed, fmt_name, rows, ngroups, nvec):
    fmt, buf, x, exact, tol = _case(seed, fmt_name, rows, ngroups, nvec)
    pm = prepare(buf, fmt, (rows, x.shape[1]))
    ref = pm.reference(x)
    got = pm.matmul(x)
    assert (np.abs(ref - exact) <= tol).all()
    assert (np.abs(got - exact) <= tol).all()
    assert (np.abs(pm.matvec(x[0]) - exact[0]) <= tol[0]).all()


@pytest.mark.parametrize("fmt_name", FORMAT_NAMES)
def test_every_format_odd_shapes(c_path, fmt_name):
    # rows 6 and 13 leave tails after the kernel's 4-row tiles; 17 vectors span two
    # blocks of 16 in the matmul.
    for rows, nvec in ((1, 3), (3, 2), (6, 17), (7, 3), (13, 17)):
        fmt, buf, x, exact, tol = _case(rows, fmt_name, rows, 3, nvec)
        y = qmatmul(buf, fmt, (rows, x.shape[1]), x)
        assert (np.abs(y - exact) <= tol).all()
        y1 = qmatvec(buf, fmt, (rows, x.shape[1]), x[1])
        assert (np.abs(y1 - exact[1]) <= tol[1]).all()


@needs_c
@pytest.mark.parametrize("fmt_name", FORMAT_NAMES)
def test_paths_agree_with_each_other(fmt_name):
    fmt, buf, x, _, tol = _case(99, fmt_name, 37, 4, 1)
    pm = prepare(buf, fmt, (37, x.shape[1]))
    got = {}
    try:
        for level in ops.SIMD_LEVELS:
            ops.set_simd_cap(level)
            got[level] = pm.matvec(x[0])
    finally:
        ops.set_simd_cap("avx512")
    for level in ops.SIMD_LEVELS[1:]:
        assert (np.abs(got[level] - got["portable"]) <= tol[0]).all()
    with pytest.raises(ValueError):
        ops.set_simd_cap("sse9")


def test_out_argument_is_written_in_place():
    fmt, buf, x, exact, tol = _case(5, "q8", 6, 2, 2)
    pm = prepare(buf, fmt, (6, x.shape[1]))
    out = np.full((2, 6), np.nan, np.float32)
    assert pm.matmul(x, out=out) is out
    assert (np.abs(out - exact) <= tol).all()
    out1 = np.empty(6, np.float32)
    assert pm.matvec(x[0], out=out1) is out1
    # any array-like x is converted (float64 list, strided view)
    assert np.allclose(pm.matvec(x[0].astype(np.float64).tolist()), out1, atol=1e-5)
    wide = np.repeat(x[:1], 2, axis=1)[0, ::2]
    assert np.allclose(pm.matvec(wide), out1, atol=1e-5)


def test_error_paths():
    fmt, buf, x, _, _ = _case(1, "q4", 4, 2, 1)
    pm = prepare(buf, fmt, (4, 64))
    with pytest.raises(ShapeError):
        pm.matvec(np.zeros(63, np.float32))
    with pytest.raises(ShapeError):
        pm.matmul(np.zeros(64, np.float32))
    with pytest.raises(ShapeError):
        pm.matvec(x[0], out=np.empty(4, np.float64))
    with pytest.raises(ShapeError):
        pm.matmul(x, out=np.empty((4, 2), np.float32).T)
    with pytest.raises(PackedBufferError):
        prepare(buf[:-2], fmt, (4, 64))
    with pytest.raises(ShapeError):
        prepare(buf, fmt, (4, 48))


@needs_c
def test_c_entry_point_rejects_bad_arguments():
    lib, ffi = ops._lib, ops._ffi
    null = ffi.NULL
    assert lib.qk_matmul(5, 32, 1, 32, null, null, null, null, 1, null, 0, 1) == -1
    assert lib.qk_matmul(4, 48, 1, 96, null, null, null, null, 1, null, 0, 1) == -1
    assert lib.qk_matmul(4, 32, 1, 48, null, null, null, null, 1, null, 0, 1) == -1
    assert lib.qk_matmul(4, 32, 2, 32, null, null, null, null, 1, null, 1, 3) == -1
    assert lib.qk_matmul(4, 32, 2, 32, null, null, null, null, 0, null, 0, 2) == -1


def test_numpy_fallback_warns_once_and_agrees(monkeypatch):
    fmt, buf, x, exact, tol = _case(8, "q3", 9, 2, 2)
    monkeypatch.setattr(ops, "_lib", None)
    monkeypatch.setattr(ops, "_warned", False)
    assert ops.simd_level() == "numpy"
    pm = prepare(buf, fmt, (9, x.shape[1]))
    with pytest.warns(RuntimeWarning, match="not compiled"):
        y = pm.matmul(x)
    assert (np.abs(y - exact) <= tol).all()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pm.matvec(x[0])  # no second warning
