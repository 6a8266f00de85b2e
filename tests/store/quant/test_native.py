"""The C quantizer (store.quant.native) against the numpy reference: the same bytes.

``quantize`` runs the C search; ``quantize_reference`` is the numpy one it was
written from. Property tests draw shapes, formats (every width, default and
larger groups, including one above 128 that takes the one-group C path), heavy
tails, constant groups, tiny and huge magnitudes, with and without importance,
and source dtypes (f32, f16, bf16 bit patterns), and require identical bytes;
the thread count must not change a byte either.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from czyx.store.models.checkpoint import to_float32
from czyx.store.quant import native
from czyx.store.quant.errors import FormatError, ShapeError
from czyx.store.quant.formats import get_format, quantize, quantize_reference

pytestmark = pytest.mark.skipif(not native.available(), reason="C quantizer not built")

FORMATS = ["q2", "q3", "q4", "q8", "q4g64", "q2g128", "q8g96", "q3g160"]


def _matrix(seed: int, rows: int, cols: int, kind: str) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "normal":
        w = rng.standard_normal((rows, cols)) * rng.uniform(1e-3, 3.0)
    elif kind == "heavy":
        w = np.clip(rng.standard_t(2, size=(rows, cols)), -5e4, 5e4)
    elif kind == "tiny":  # fp16 subnormal scales and offsets
        w = rng.standard_normal((rows, cols)) * 1e-6
    elif kind == "huge":
        w = rng.uniform(-5.9e4, 5.9e4, size=(rows, cols))
    else:  # "plateaus": constant runs, exact zeros, repeated values
        w = np.round(rng.standard_normal((rows, cols)) * 2) / 2
        w[:, : cols // 3] = 0.25
        w[0] = 0.0
    return w.astype(np.float32)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    fmt=st.sampled_from(FORMATS),
    rows=st.integers(1, 9),
    groups=st.integers(1, 4),
    kind=st.sampled_from(["normal", "heavy", "tiny", "huge", "plateaus"]),
    weighted=st.sampled_from(["none", "random", "sparse"]),
    method=st.sampled_from(["search", "search", "minmax"]),
)
def test_same_bytes_as_numpy_reference(seed, fmt, rows, groups, kind, weighted, method):
    f = get_format(fmt)
    cols = groups * f.group_size
    w = _matrix(seed, rows, cols, kind)
    rng = np.random.default_rng(seed ^ 0xC0FFEE)
    imp = None
    if weighted == "random":
        imp = rng.exponential(size=cols).astype(np.float32)
    elif weighted == "sparse":  # most columns never seen by the calibration
        imp = np.where(rng.random(cols) < 0.2, rng.exponential(size=cols), 0).astype(np.float32)
    ref = quantize_reference(w, f, imp, method=method)
    got = quantize(w, f, imp, method=method, threads=1 + seed % 3)
    assert got.dtype == np.uint8 and got.shape == ref.shape
    np.testing.assert_array_equal(got, ref)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    fmt=st.sampled_from(["q2", "q4", "q8", "q4g64", "q8g96"]),
    rows=st.integers(1, 4),
    sets=st.integers(1, 2),
    kind=st.sampled_from(["normal", "heavy", "tiny", "plateaus"]),
    weighted=st.sampled_from(["random", "sparse"]),
)
def test_rows_of_whole_lane_sets_same_bytes(seed, fmt, rows, sets, kind, weighted):
    # 16 or 32 groups a row: the C search lays each row place's error weights out once
    # per matrix (and sums them once) instead of per set of 16 groups
    f = get_format(fmt)
    cols = 16 * sets * f.group_size
    w = _matrix(seed, rows, cols, kind)
    rng = np.random.default_rng(seed ^ 0xBEEF)
    imp = rng.exponential(size=cols).astype(np.float32)
    if weighted == "sparse":
        imp[rng.random(cols) < 0.8] = 0
    got = quantize(w, f, imp, threads=1 + seed % 2)
    np.testing.assert_array_equal(got, quantize_reference(w, f, imp))


def _to_f16(v: np.ndarray, path: int) -> tuple[np.ndarray, int]:
    from czyx.store.quant._quantizer import ffi, lib

    v = np.ascontiguousarray(v, np.float64)
    out = np.empty(v.size, np.uint16)
    used = lib.czyx_f64_to_f16(
        ffi.cast("double *", ffi.from_buffer(v)),
        ffi.cast("uint16_t *", ffi.from_buffer(out)),
        v.size,
        path,
    )
    return out, used


@settings(max_examples=60, deadline=None)
@given(
    halves=st.lists(st.integers(0, 0x7BFE), min_size=1, max_size=40),
    nudge=st.sampled_from([-1, 0, 1]),
    signs=st.integers(0, 2**40 - 1),
    spread=st.lists(st.floats(-6e4, 6e4, allow_nan=False, width=64), max_size=40),
)
def test_fp16_rounding_of_the_search_is_numpys(halves, nudge, signs, spread):
    # midpoints between neighbouring fp16 values and the doubles just beside them: what a
    # double rounding through float32 would get wrong, and rounding to odd gets right
    h = np.array(halves, np.uint16)
    lo = h.view(np.float16).astype(np.float64)
    hi = (h + np.uint16(1)).view(np.float16).astype(np.float64)
    mid = (lo + hi) / 2
    if nudge:
        mid = np.nextafter(mid, np.inf if nudge > 0 else -np.inf)
    mid = np.where((signs >> np.arange(mid.size)) & 1, -mid, mid)
    v = np.concatenate([mid, np.array(spread), [0.0, -0.0, 1e-30, -1e-30, 2.0**-25, 65504.0]])
    want = v.astype(np.float16).view(np.uint16)
    for path in (0, 1, 2):  # the lanes' portable, the lanes' F16C, the one-group search's
        got, _ = _to_f16(v, path)
        np.testing.assert_array_equal(got, want)


def test_fp16_rounding_takes_f16c_where_the_cpu_has_it():
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo to read the CPU's flags from")
    flags = cpuinfo.read_text()
    has = " f16c" in flags and " avx2" in flags
    assert _to_f16(np.ones(3), 1)[1] == int(has)
    assert _to_f16(np.ones(3), 0)[1] == 0


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), dtype=st.sampled_from(["F16", "BF16"]))
def test_half_sources_read_as_their_float32_widening(seed, dtype):
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 1 << 16, size=(5, 64), dtype=np.uint16)
    bits &= np.uint16(0xBFFF)  # top exponent bit clear: finite, |w| < 2, subnormals kept
    flt = to_float32(bits.view(np.float16) if dtype == "F16" else bits, dtype)
    ref = quantize_reference(flt, "q4", None)
    np.testing.assert_array_equal(quantize(bits, "q4", dtype=dtype), ref)


def test_bytes_do_not_depend_on_threads():
    w = _matrix(3, 257, 512, "heavy")
    imp = np.random.default_rng(1).exponential(size=512).astype(np.float32)
    one = quantize(w, "q4", imp, threads=1)
    for t in (2, 3, 8):
        np.testing.assert_array_equal(quantize(w, "q4", imp, threads=t), one)


def test_errors_match_the_reference():
    w = _matrix(0, 4, 64, "normal")
    w[2, 40] = np.nan
    w[3, 1] = 1e5
    for fn in (quantize, quantize_reference):
        with pytest.raises(FormatError, match="non-finite weight at group 5, index 8"):
            fn(w, "q8")
    w[2, 40] = 0.0
    for fn in (quantize, quantize_reference):
        with pytest.raises(FormatError, match="magnitude"):
            fn(w, "q8")
    with pytest.raises(ShapeError):
        quantize(np.zeros((2, 48), np.float32), "q4")
    with pytest.raises(FormatError):
        quantize(np.zeros((2, 64), np.float32), "q4", dtype="F8")
    with pytest.raises(ShapeError):
        native.quantize_native(np.zeros(10, np.float32), (2, 64), 4, 32, None)


def test_empty_rows_and_out_buffer():
    assert quantize(np.zeros((0, 64), np.float32), "q4").size == 0
    w = _matrix(9, 3, 64, "normal")
    out = np.empty(get_format("q8").nbytes(3, 64), np.uint8)
    res = native.quantize_native(w, (3, 64), 8, 32, None, out=out)
    assert res is out
    np.testing.assert_array_equal(out, quantize_reference(w, "q8"))
