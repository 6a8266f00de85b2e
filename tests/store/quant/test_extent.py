"""Quantized expert extents and format records."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from czyx.store.quant.errors import FormatError, PackedBufferError, ShapeError
from czyx.store.quant.extent import (
    ExpertLayout,
    expert_format,
    format_record,
    pack_expert,
    parse_format_record,
)
from czyx.store.quant.formats import dequantize, get_format, quantize
from czyx.store.quant.policy import POLICIES


def test_pack_expert_parts_are_the_quantized_matrices():
    rng = np.random.default_rng(0)
    inter, hidden = 32, 64
    gate, up = (rng.standard_normal((inter, hidden)).astype(np.float32) for _ in range(2))
    down = rng.standard_normal((hidden, inter)).astype(np.float32)
    fmt = get_format("q4")
    imp_h = rng.random(hidden).astype(np.float32)
    ext = pack_expert(gate, up, down, fmt, imp_h, None)
    lay = ExpertLayout(fmt, inter, hidden)
    assert ext.size == lay.nbytes == sum(lay.part_nbytes)
    g, u, d = lay.split(np.concatenate([ext, np.zeros(100, np.uint8)]))
    assert np.array_equal(g, quantize(gate, fmt, imp_h))
    assert np.array_equal(u, quantize(up, fmt, imp_h))
    assert np.array_equal(d, quantize(down, fmt))
    assert np.allclose(dequantize(d, fmt, lay.shapes[2]), down, atol=0.4)
    with pytest.raises(PackedBufferError):
        lay.split(ext[:-1])
    with pytest.raises(ShapeError):
        pack_expert(gate, up, down.T, fmt)


def test_pack_expert_fills_a_given_buffer_in_place():
    rng = np.random.default_rng(1)
    inter, hidden = 32, 64
    gate, up = (rng.standard_normal((inter, hidden)).astype(np.float32) for _ in range(2))
    down = rng.standard_normal((hidden, inter)).astype(np.float32)
    lay = ExpertLayout(get_format("q8"), inter, hidden)
    out = np.full(lay.nbytes, 0xAB, np.uint8)
    got = pack_expert(gate, up, down, "q8", out=out)
    assert got is out
    np.testing.assert_array_equal(out, pack_expert(gate, up, down, "q8"))
    with pytest.raises(ShapeError):
        pack_expert(gate, up, down, "q8", out=np.empty(lay.nbytes - 4, np.uint8))
    with pytest.raises(ShapeError):
        quantize(gate, "q8", out=np.empty(7, np.uint8))


def test_expert_format_must_divide_both_dimensions():
    sel = POLICIES["selective"]
    assert expert_format(sel, 128, 64).name == "q2"
    assert expert_format(sel, 96, 64).name == "q2g32"
    assert expert_format(sel, 24, 64) is None
    assert expert_format(POLICIES["none"], 128, 64) is None


def test_format_records_round_trip_and_fail_closed():
    fmt = get_format("q3g128")
    rec = msgpack.unpackb(msgpack.packb(format_record(fmt, (5, 256))), raw=False)
    assert parse_format_record(rec) == (fmt, (5, 256))
    assert parse_format_record(format_record(None, (7,))) == (None, (7,))
    bad = dict(rec, nbytes=rec["nbytes"] + 1)
    with pytest.raises(FormatError):
        parse_format_record(bad)
    with pytest.raises(FormatError):
        parse_format_record(dict(rec, bits=4))
    with pytest.raises(FormatError):
        parse_format_record({"tag": "x"})
    with pytest.raises(FormatError):
        parse_format_record(dict(rec, format="q9"))
