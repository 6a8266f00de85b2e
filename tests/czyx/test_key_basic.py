from __future__ import annotations

import pytest

from czyx.key import KEY_SIZE, Key, class_range_bounds
from czyx.space import Selector


def test_pack_roundtrip_and_size():
    k = Key(0x2A, 3, 5, 7)
    b = k.pack()
    assert len(b) == KEY_SIZE and b[0] == 0x2A
    assert Key.unpack(b) == k


@pytest.mark.parametrize(
    "args, field",
    [
        ((256,), "class"),
        ((-1,), "class"),
        ((1, -1), "z"),
        ((1, 0, 1 << 61), "y"),
        ((1, 0, 0, 2**70), "x"),
    ],
)
def test_bad_key_names_field(args, field):
    with pytest.raises(ValueError, match=field):
        Key(*args)


def test_unpack_wrong_length():
    with pytest.raises(ValueError, match="key"):
        Key.unpack(b"\x00" * 23)


def test_class_bounds_bracket_class():
    lo, hi = class_range_bounds(7)
    assert lo <= Key(7, 2**61 - 1, 2**61 - 1, 2**61 - 1).pack() <= hi
    assert not lo <= Key(8).pack() <= hi


def test_reserved_selector_refused():
    with pytest.raises(ValueError, match="reserved"):
        Selector.for_space(b"\xff" + bytes(31))
    assert not Selector.from_content(b"x").reserved
