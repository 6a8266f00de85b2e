"""The 24-byte key: scalar/vectorised round trips, byte order, class ranges, refusals."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from czyx.curves import HilbertCurve, MortonCurve, PermutedCurve, RowMajorCurve
from czyx.key import (
    COORD_BITS,
    EDG,
    KEY_SIZE,
    MEM,
    PRJ,
    SES,
    Key,
    as_void,
    class_prefix,
    class_range_bounds,
    default_curve,
    pack_keys,
    unpack_keys,
)

COORD = st.integers(0, (1 << COORD_BITS) - 1)
KEYS = st.builds(Key, st.integers(0, 255), COORD, COORD, COORD)
CURVES = [MortonCurve(3, 61), HilbertCurve(3, 61), RowMajorCurve(3, 61)]
CURVE = st.sampled_from(CURVES)


@settings(max_examples=100, deadline=None)
@given(KEYS, CURVE)
def test_scalar_roundtrip(key, curve):
    b = key.pack(curve)
    assert len(b) == KEY_SIZE and b[0] == key.cls
    assert Key.unpack(b, curve) == key
    assert Key.unpack(bytearray(b), curve) == key
    # Bytes 1..23 are the curve ordinal, big-endian.
    assert int.from_bytes(b[1:], "big") == curve.encode((key.z, key.y, key.x))


@settings(max_examples=60, deadline=None)
@given(st.lists(KEYS, min_size=1, max_size=30), CURVE)
def test_vectorised_equals_scalar(keys, curve):
    cls = np.array([k.cls for k in keys], dtype=np.uint8)
    coords = np.array([(k.z, k.y, k.x) for k in keys], dtype=np.uint64)
    packed = pack_keys(cls, coords, curve)
    assert packed.shape == (len(keys), KEY_SIZE) and packed.dtype == np.uint8
    assert [bytes(row) for row in packed] == [k.pack(curve) for k in keys]
    for form in (packed, as_void(packed)):
        c2, xyz = unpack_keys(form, curve)
        assert np.array_equal(c2, cls) and np.array_equal(xyz, coords)
    assert as_void(packed).dtype == np.dtype("V24")


@settings(max_examples=60, deadline=None)
@given(st.lists(KEYS, min_size=2, max_size=30), CURVE)
def test_byte_order_is_class_then_curve_order(keys, curve):
    by_bytes = sorted(keys, key=lambda k: k.pack(curve))
    by_ordinal = sorted(keys, key=lambda k: (k.cls, curve.encode((k.z, k.y, k.x))))
    assert [k.pack(curve) for k in by_bytes] == [k.pack(curve) for k in by_ordinal]


@settings(max_examples=100, deadline=None)
@given(KEYS, st.integers(0, 255), st.integers(0, 255), CURVE)
def test_class_ranges_are_disjoint_prefix_ranges(key, a, b, curve):
    lo_c, hi_c = min(a, b), max(a, b)
    lo, hi = class_range_bounds(lo_c, hi_c)
    assert (lo <= key.pack(curve) <= hi) == (lo_c <= key.cls <= hi_c)
    lo1, hi1 = class_range_bounds(key.cls)
    assert lo1 <= key.pack(curve) <= hi1 and key.pack(curve).startswith(class_prefix(key.cls))
    other = a if a != key.cls else (a + 1) % 256
    olo, ohi = class_range_bounds(other)
    assert not olo <= key.pack(curve) <= ohi  # never inside another class's range


@given(KEYS, KEYS)
def test_key_is_a_frozen_ordered_hashable_value(a, b):
    assert (a < b) == ((a.cls, a.z, a.y, a.x) < (b.cls, b.z, b.y, b.x))
    assert (a == b) == (a.pack() == b.pack())  # the packing is injective
    assert hash(Key(a.cls, a.z, a.y, a.x)) == hash(a)
    assert Key(np.uint8(a.cls), np.uint64(a.z), a.y, a.x) == a
    assert hash(Key(np.uint8(a.cls), np.uint64(a.z), a.y, a.x)) == hash(a)
    with pytest.raises(AttributeError):
        a.cls = 1  # type: ignore[misc]


def test_extremes_and_named_classes():
    top = (1 << COORD_BITS) - 1
    for curve in CURVES:
        b = Key(255, top, top, top).pack(curve)
        assert b[1] < 0x80  # the 184th code bit is always zero
        assert Key.unpack(b, curve) == Key(255, top, top, top)
    assert len({MEM, SES, PRJ, EDG}) == 4
    assert Key(MEM).pack() == bytes([MEM]) + bytes(23)
    assert Key(1, 1, 0, 0).pack() == bytes([1]) + (4).to_bytes(23, "big")  # Morton default
    assert default_curve() == MortonCurve(3, 61)


@settings(max_examples=30, deadline=None)
@given(st.lists(KEYS, min_size=1, max_size=30))
def test_kernel_and_generic_paths_agree(keys):
    # An identity PermutedCurve is the same curve but never takes the C key kernel.
    cls = np.array([k.cls for k in keys], dtype=np.uint8)
    coords = np.array([(k.z, k.y, k.x) for k in keys], dtype=np.uint64)
    for inner in (MortonCurve(3, 61), HilbertCurve(3, 61)):
        generic = PermutedCurve(inner, (None, None, None))
        fast = pack_keys(cls, coords, inner)
        assert np.array_equal(pack_keys(cls, coords, generic), fast)
        c1, x1 = unpack_keys(fast, generic)
        c2, x2 = unpack_keys(fast, inner)
        assert np.array_equal(c1, c2) and np.array_equal(x1, x2) and np.array_equal(x1, coords)


def test_scalar_class_broadcasts_and_signed_input():
    coords = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int64)
    packed = pack_keys(MEM, coords)
    assert [bytes(r) for r in packed] == [Key(MEM, 1, 2, 3).pack(), Key(MEM, 4, 5, 6).pack()]
    assert pack_keys(np.zeros(0, np.uint8), np.zeros((0, 3), np.uint64)).shape == (0, KEY_SIZE)


@pytest.mark.parametrize(
    "args, field",
    [
        ((256,), "class"),
        ((-1,), "class"),
        ((True,), "class"),
        ((1.0,), "class"),
        ((1, -1), "z"),
        ((1, 0, 1 << 61), "y"),
        ((1, 0, 0, 2**70), "x"),
        ((1, 0, 0, "3"), "x"),
    ],
)
def test_bad_key_names_field(args, field):
    with pytest.raises(ValueError, match=field):
        Key(*args)


def test_unpack_errors():
    with pytest.raises(ValueError, match="key: expected 24 bytes, got 23"):
        Key.unpack(b"\x00" * 23)
    with pytest.raises(ValueError, match="key: expected bytes"):
        Key.unpack("x" * 24)
    with pytest.raises(ValueError, match="key code"):
        Key.unpack(b"\x01\x80" + bytes(22))
    with pytest.raises(ValueError, match="curve"):
        Key(1).pack(MortonCurve(2, 61))
    with pytest.raises(ValueError, match="curve"):
        Key.unpack(bytes(24), MortonCurve(3, 60))


def test_vectorised_errors():
    ok = np.zeros((2, 3), np.uint64)
    with pytest.raises(ValueError, match="coords: expected shape"):
        pack_keys(1, np.zeros((2, 2), np.uint64))
    with pytest.raises(ValueError, match="coords: expected integers"):
        pack_keys(1, ok.astype(float))
    with pytest.raises(ValueError, match=r"y\[1\]: negative"):
        pack_keys(1, np.array([[0, 0, 0], [0, -1, 0]]))
    with pytest.raises(ValueError, match=r"x\[0\]: 2305843009213693952"):
        pack_keys(1, np.array([[0, 0, 1 << 61]], np.uint64))
    with pytest.raises(ValueError, match=r"class\[1\]: 256"):
        pack_keys(np.array([0, 256]), ok)
    with pytest.raises(ValueError, match=r"class\[0\]: -1"):
        pack_keys(np.array([-1, 0]), ok)
    with pytest.raises(ValueError, match="class: expected shape"):
        pack_keys(np.array([0, 1, 2]), ok)
    with pytest.raises(ValueError, match="class: expected integers"):
        pack_keys(np.array([0.0, 1.0]), ok)
    with pytest.raises(ValueError, match="curve"):
        pack_keys(1, ok, HilbertCurve(2, 61))
    with pytest.raises(ValueError, match="key: expected an"):
        unpack_keys(np.zeros((2, 23), np.uint8))
    with pytest.raises(ValueError, match="key: expected an"):
        unpack_keys(np.zeros((2, 24), np.int8))
    with pytest.raises(ValueError, match="key: expected a 1-D V24"):
        unpack_keys(np.zeros(2, "V23"))
    bad = np.zeros((3, 24), np.uint8)
    bad[2, 1] = 0x80
    with pytest.raises(ValueError, match=r"key code\[2\]"):
        unpack_keys(bad)


def test_class_range_errors():
    with pytest.raises(ValueError, match="class range"):
        class_range_bounds(5, 4)
    with pytest.raises(ValueError, match="class"):
        class_range_bounds(0, 256)
    with pytest.raises(ValueError, match="class"):
        class_prefix(-1)


def test_default_curve_attribute():
    import czyx.key as key

    assert key.DEFAULT_CURVE is default_curve()
    with pytest.raises(AttributeError):
        _ = key.NOT_A_NAME
