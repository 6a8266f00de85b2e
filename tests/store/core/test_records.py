"""The record codec, the Extent value, key checks, block-file headers and prefix bounds."""

from __future__ import annotations

import ctypes
import pathlib

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from czyx.space import Selector
from czyx.store.core.blockfile import (
    DEFAULT_ALIGN,
    BlockIdentity,
    BlockWriter,
    dio_alignment,
    encode_header,
    read_header,
)
from czyx.store.core.catalog import prefix_end
from czyx.store.core.checksum import checksum, native_checksum
from czyx.store.core.records import Extent, check_key, check_selector, decode, encode
from czyx.store.errors import BlockFileError, KeyLengthError, RecordDecodeError

values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
records = st.dictionaries(st.text(max_size=10), values, max_size=6)


@given(records)
def test_encode_decode_roundtrip(rec: dict) -> None:
    assert decode(encode(rec)) == rec


@given(st.binary(max_size=40))
def test_decode_never_returns_a_non_dict(data: bytes) -> None:
    try:
        out = decode(data, "fuzz", b"\x01\x02")
    except RecordDecodeError as exc:
        assert "fuzz 0102" in str(exc)
    else:
        assert type(out) is dict


def test_decode_rejects_non_maps_and_trailing_bytes() -> None:
    for raw in (msgpack.packb([1, 2]), msgpack.packb({"a": 1}) + b"\x00", b""):
        with pytest.raises(RecordDecodeError):
            decode(raw)


def test_encode_refuses_non_dicts() -> None:
    with pytest.raises(TypeError):
        encode([1, 2])  # type: ignore[arg-type]


@given(st.integers(0, 2**62), st.integers(0, 2**40), st.integers(0, 2**64 - 1))
def test_extent_record_roundtrip(off: int, n: int, s: int) -> None:
    e = Extent(off, n, s)
    assert Extent.from_record(decode(encode({**e.record(), "fmt": "f32"}))) == e


@pytest.mark.parametrize(
    "rec",
    [
        {},
        {"off": 1, "len": 2},
        {"off": -1, "len": 2, "sum": 3},
        {"off": "1", "len": 2, "sum": 3},
        {"off": True, "len": 2, "sum": 3},
    ],
)
def test_extent_from_bad_record(rec: dict) -> None:
    with pytest.raises(RecordDecodeError):
        Extent.from_record(rec)


@given(st.binary(max_size=40))
def test_check_key(data: bytes) -> None:
    if len(data) == 24:
        assert check_key(data) == data
        assert check_key(bytearray(data)) == data
    else:
        with pytest.raises(KeyLengthError):
            check_key(data)


def test_check_selector() -> None:
    sel = Selector.from_name("x")
    assert check_selector(sel) == sel.raw == check_selector(sel.raw)
    with pytest.raises(KeyLengthError):
        check_selector(b"x" * 31)
    with pytest.raises(KeyLengthError):
        check_selector("x" * 32)  # type: ignore[arg-type]


@given(st.binary(max_size=6), st.lists(st.binary(max_size=8), max_size=30))
def test_prefix_end_bounds_exactly_the_prefixed_keys(prefix: bytes, keys: list[bytes]) -> None:
    end = prefix_end(prefix)
    for k in [*keys, prefix, prefix + b"\x00", prefix + b"\xff\xff"]:
        inside = prefix <= k and (end is None or k < end)
        assert inside == k.startswith(prefix)


@given(
    st.binary(min_size=32, max_size=32),
    st.binary(min_size=16, max_size=16),
    st.sampled_from([4096, 8192, 65536]),
)
def test_header_roundtrip(tmp_path_factory, sel: bytes, gen: bytes, align: int) -> None:
    p = tmp_path_factory.mktemp("h") / "f.blk"
    head = encode_header(sel, gen, align)
    assert len(head) == align
    p.write_bytes(head)
    assert read_header(p) == (sel, gen, align)


def test_block_writer_aligns_and_checksums(tmp_path: pathlib.Path) -> None:
    w = BlockWriter(tmp_path / "b.blk", b"s" * 32, b"g" * 16, DEFAULT_ALIGN)
    payloads = [b"", b"a", np.arange(1000, dtype=np.float64), memoryview(b"z" * 4096)]
    exts = [w.write(p) for p in payloads]
    w.sync()
    w.close()
    raw = (tmp_path / "b.blk").read_bytes()
    assert len(raw) == w.size and w.size % DEFAULT_ALIGN == 0
    for e, p in zip(exts, payloads):
        b = np.asarray(p).tobytes() if isinstance(p, np.ndarray) else bytes(p)
        assert e.offset % DEFAULT_ALIGN == 0 and e.length == len(b)
        assert raw[e.offset : e.offset + e.length] == b and e.checksum == checksum(b)
    with pytest.raises(Exception, match="exist"):
        BlockWriter(tmp_path / "b.blk", b"s" * 32, b"g" * 16, DEFAULT_ALIGN)  # never clobbers
    with pytest.raises(ValueError):
        BlockWriter(tmp_path / "c.blk", b"s" * 32, b"g" * 16, 1000)


def test_block_identity_roundtrip() -> None:
    i = BlockIdentity("x.blk", b"g" * 16, 8192, 4096)
    assert BlockIdentity.from_record(decode(encode(i.to_record()))) == i


def test_read_header_rejects_short_files(tmp_path: pathlib.Path) -> None:
    (tmp_path / "f").write_bytes(b"CZYX")
    with pytest.raises(BlockFileError, match="truncated header"):
        read_header(tmp_path / "f")
    with pytest.raises(BlockFileError, match="missing"):
        read_header(tmp_path / "nope")


def test_dio_alignment_is_a_power_of_two(tmp_path: pathlib.Path) -> None:
    a = dio_alignment(tmp_path)
    assert a >= 4096 and a & (a - 1) == 0
    assert dio_alignment(tmp_path / "does-not-exist") == 4096


@given(st.binary(max_size=3000))
def test_checksum_of_array_equals_checksum_of_its_bytes(data: bytes) -> None:
    arr = np.frombuffer(data, np.uint8)
    assert checksum(arr) == checksum(data) == checksum(memoryview(data))
    if len(data) >= 8:
        f = np.frombuffer(data[: len(data) // 8 * 8], np.float64)
        assert checksum(f) == checksum(data[: len(data) // 8 * 8])


@given(st.binary(max_size=5000))
@settings(max_examples=60)
def test_the_native_checksum_is_the_checksum(data: bytes) -> None:
    """The C function the read pool's threads hash with computes :func:`checksum`."""
    addr = native_checksum()
    assert addr is not None  # the xxhash wheel exports XXH3_64bits
    fn = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_char_p, ctypes.c_size_t)(addr)
    assert fn(data, len(data)) == checksum(data)
