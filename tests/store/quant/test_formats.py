"""Packed layout, code packing and quantize/dequantize round trips of store.quant.formats."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from czyx.store.quant.errors import FormatError, PackedBufferError, ShapeError
from czyx.store.quant.formats import (
    FORMATS,
    SUPPORTED_BITS,
    QuantFormat,
    dequantize,
    get_format,
    is_quant_format,
    pack_codes,
    quantize,
    unpack_codes,
    views,
)

BITS = st.sampled_from(SUPPORTED_BITS)


def _bitstream_reference(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack one row the slow, obvious way: a Python int as the little-endian bit stream."""
    acc = 0
    for i, c in enumerate(int(v) for v in codes):
        acc |= c << (bits * i)
    return np.frombuffer(acc.to_bytes(len(codes) * bits // 8, "little"), dtype=np.uint8)


@given(bits=BITS, rows=st.integers(0, 4), octets=st.integers(1, 6), seed=st.integers(0, 2**32 - 1))
def test_pack_unpack_exact_for_all_widths(bits, rows, octets, seed):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 1 << bits, size=(rows, 8 * octets), dtype=np.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (rows, octets * bits)
    assert np.array_equal(unpack_codes(packed, bits, 8 * octets), codes)
    for r in range(rows):
        assert np.array_equal(packed[r], _bitstream_reference(codes[r], bits))


def test_bit_order_is_little_endian():
    assert pack_codes(np.array([[1, 2, 3, 0, 0, 0, 0, 0]], np.uint8), 2)[0, 0] == 0b00111001
    assert pack_codes(np.array([[1, 2, 0, 0, 0, 0, 0, 15]], np.uint8), 4)[0].tolist() == [
        0x21,
        0,
        0,
        0xF0,
    ]
    # q3: code 0 in bits 0-2, code 1 in bits 3-5, code 2 straddles bytes 0 and 1.
    assert pack_codes(np.array([[7, 0, 7, 0, 0, 0, 0, 0]], np.uint8), 3)[0].tolist() == [
        0b11000111,
        0b00000001,
        0,
    ]


def test_pack_rejects_out_of_range_codes_and_bad_widths():
    with pytest.raises(FormatError):
        pack_codes(np.full((1, 8), 4, np.uint8), 2)
    with pytest.raises(FormatError):
        pack_codes(np.zeros((1, 8), np.uint8), 5)
    with pytest.raises(ShapeError):
        pack_codes(np.zeros((1, 12), np.uint8), 4)
    with pytest.raises(ShapeError):
        unpack_codes(np.zeros((1, 5), np.uint8), 4, 8)


def test_format_names_and_defaults():
    assert get_format("q4") == FORMATS["q4"] == QuantFormat("q4", 4, 32)
    assert get_format("q2").group_size == 64
    assert get_format("q4g64") == QuantFormat("q4g64", 4, 64)
    assert get_format("q2g64") is not None and get_format("q2g64").name == "q2"
    assert get_format(FORMATS["q8"]) is FORMATS["q8"]
    for bad in ("f32", "q5", "q4g48", "q4g0", "Q4", "q4g", ""):
        with pytest.raises(FormatError):
            get_format(bad)
        assert not is_quant_format(bad)
    assert is_quant_format("q3g128")
    assert FORMATS["q2"].bits_per_weight == 2.5
    assert FORMATS["q4"].bits_per_weight == 5.0


@given(bits=BITS, k=st.integers(1, 4), rows=st.integers(0, 9), ng=st.integers(1, 5))
def test_nbytes_matches_layout(bits, k, rows, ng):
    fmt = QuantFormat(f"q{bits}g{32 * k}", bits, 32 * k)
    cols = ng * fmt.group_size
    codes, scales, mins, end = fmt.offsets(rows, cols)
    assert codes == 0
    assert scales == rows * cols * bits // 8
    assert mins - scales == end - mins == rows * ng * 2
    assert end == fmt.nbytes(rows, cols)
    assert end % 4 == 0


def test_shape_errors_name_the_columns():
    with pytest.raises(ShapeError, match="columns=48"):
        FORMATS["q4"].nbytes(3, 48)
    with pytest.raises(ShapeError):
        quantize(np.zeros((2, 40), np.float32), "q4")
    with pytest.raises(ShapeError):
        quantize(np.zeros(64, np.float32), "q4")
    with pytest.raises(ShapeError):
        quantize(np.zeros((2, 64), np.float32), "q4", importance=np.ones(32, np.float32))


def test_bad_values_fail_closed():
    w = np.zeros((2, 64), np.float32)
    w[1, 5] = np.nan
    with pytest.raises(FormatError, match="non-finite"):
        quantize(w, "q4")
    with pytest.raises(FormatError, match="fp16"):
        quantize(np.full((1, 64), 1e6, np.float32), "q8")
    with pytest.raises(FormatError):
        quantize(np.ones((1, 64), np.float32), "q4", importance=-np.ones(64, np.float32))
    with pytest.raises(FormatError):
        quantize(np.ones((1, 64), np.float32), "q4", method="magic")


def test_buffer_size_mismatch_is_an_error():
    buf = quantize(np.ones((3, 64), np.float32), "q4")
    with pytest.raises(PackedBufferError, match="needs"):
        views(buf[:-4], "q4", (3, 64))
    with pytest.raises(PackedBufferError):
        dequantize(buf, "q4", (4, 64))


_weights = st.builds(
    lambda seed, scale, rows, ng, const: _make_w(seed, scale, rows, ng, const),
    st.integers(0, 2**32 - 1),
    st.sampled_from([1e-4, 0.02, 1.0, 300.0]),
    st.integers(1, 5),
    st.integers(1, 3),
    st.booleans(),
)


def _make_w(seed: int, scale: float, rows: int, ng: int, const: bool) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, 64 * ng)) * scale).astype(np.float32)
    if const:  # a constant group, and a group with one outlier
        w[0, :32] = np.float32(scale)
        w[-1, 32:64] = 0.0
        w[-1, 40] = np.float32(7 * scale)
    return w


def _tol(w: np.ndarray) -> float:
    return 1e-6 * float(np.abs(w).max()) + 1e-7


@settings(max_examples=40)
@given(w=_weights, bits=BITS)
def test_minmax_round_trip_within_half_a_step(w, bits):
    fmt = get_format(f"q{bits}g32")
    buf = quantize(w, fmt, method="minmax")
    assert buf.dtype == np.uint8 and buf.size == fmt.nbytes(*w.shape)
    _, scales, _ = views(buf, fmt, w.shape)
    step = np.repeat(scales.astype(np.float32), fmt.group_size, axis=1)
    err = np.abs(dequantize(buf, fmt, w.shape) - w)
    assert (err <= step / 2 + _tol(w)).all()


@settings(max_examples=40)
@given(w=_weights, bits=BITS, weighted=st.booleans())
def test_search_reconstructs_each_weight_at_its_nearest_grid_point(w, bits, weighted):
    """The searched grid may clip outliers, but every code is the nearest one on its grid."""
    fmt = get_format(f"q{bits}g32")
    imp = np.linspace(0.01, 5.0, w.shape[1]).astype(np.float32) if weighted else None
    buf = quantize(w, fmt, importance=imp)
    _, scales, mins = views(buf, fmt, w.shape)
    d = np.repeat(scales.astype(np.float32), fmt.group_size, axis=1)
    m = np.repeat(mins.astype(np.float32), fmt.group_size, axis=1)
    top = m + d * fmt.qmax
    outside = np.maximum(0, np.maximum(m - w, w - top))
    err = np.abs(dequantize(buf, fmt, w.shape) - w)
    assert (d >= 0).all()
    assert (err <= d / 2 + outside + _tol(w)).all()


def test_dequantize_selected_rows_equals_full_rows():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((9, 96)).astype(np.float32)
    buf = quantize(w, "q8")
    full = dequantize(buf, "q8", w.shape)
    assert np.array_equal(dequantize(buf, "q8", w.shape, rows=np.array([7, 0, 7])), full[[7, 0, 7]])
    assert np.array_equal(dequantize(buf, "q8", w.shape, rows=slice(2, 5)), full[2:5])


def test_accepts_bytes_and_empty_rows():
    w = np.ones((0, 64), np.float32)
    buf = quantize(w, "q2")
    assert buf.size == 0
    w = np.arange(128, dtype=np.float32).reshape(2, 64) / 100
    buf = bytes(quantize(w, "q8"))
    assert np.allclose(dequantize(buf, "q8", (2, 64)), w, atol=0.01)


def test_more_bits_never_worse_on_gaussian_weights():
    rng = np.random.default_rng(7)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    errs = [
        float(np.mean((dequantize(quantize(w, f), f, w.shape) - w) ** 2))
        for f in ("q2", "q3", "q4", "q8")
    ]
    assert errs == sorted(errs, reverse=True)
    assert errs[-1] < 1e-4
