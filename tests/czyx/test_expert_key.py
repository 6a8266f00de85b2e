"""Expert keys for any number of experts a layer: the class shift and its round trip."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from czyx.expert_key import (
    MAX_EXPERTS,
    class_shift,
    expert_key,
    expert_value,
    key_classes,
)
from czyx.key import Key, class_range_bounds

N_EXPERTS = st.integers(1, MAX_EXPERTS)


@st.composite
def expert_cells(draw):
    n = draw(N_EXPERTS)
    return n, draw(st.integers(0, n - 1)), draw(st.integers(0, 1023))


def test_shift_of_the_models_people_run():
    # Up to 256 a class byte holds the router's index; Kimi-K2 (384) and
    # Qwen3-Next (512) take one bit of y; the shift is the fewest bits needed.
    assert [class_shift(n) for n in (1, 8, 64, 128, 256)] == [0] * 5
    assert [class_shift(n) for n in (257, 384, 512)] == [1, 1, 1]
    assert [class_shift(n) for n in (513, 1024, 1025, MAX_EXPERTS)] == [2, 2, 3, 8]


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 256), st.integers(0, 255), st.integers(0, 1023))
def test_up_to_256_experts_the_key_is_the_one_stores_always_had(n, value, layer):
    value %= n
    assert expert_key(value, layer, class_shift(n)) == Key(value, layer)


@settings(max_examples=300, deadline=None)
@given(expert_cells())
def test_expert_key_round_trips_and_class_is_the_high_part(cell):
    n, value, layer = cell
    s = class_shift(n)
    k = expert_key(value, layer, s)
    assert 0 <= k.cls <= 255 and k.z == layer and k.x == 0
    assert expert_value(k, s) == value
    assert k.cls == value >> s == int(key_classes([value], s)[0])
    assert Key.unpack(k.pack()) == k


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 2048), st.integers(0, 255), st.integers(0, 255))
def test_a_class_range_is_a_contiguous_expert_range_and_a_key_range(n, a, b):
    """For all n: the experts whose keys fall in a class range are exactly the
    values [lo << s, (hi + 1) << s), the prefix range of the index (shifts 0 to 3;
    each example packs n keys)."""
    s = class_shift(n)
    lo, hi = min(a, b), max(a, b)
    values = np.arange(n)
    layer = 3
    keys = [expert_key(int(v), layer, s).pack() for v in values]
    lo_key, hi_key = class_range_bounds(lo, hi)
    inside = np.array([lo_key <= k <= hi_key for k in keys])
    want = (values >= lo << s) & (values < (hi + 1) << s)
    assert np.array_equal(inside, want)


@settings(max_examples=100, deadline=None)
@given(expert_cells(), expert_cells())
def test_distinct_experts_get_distinct_keys(c1, c2):
    n = max(c1[0], c2[0])
    s = class_shift(n)
    k1, k2 = expert_key(c1[1], c1[2], s), expert_key(c2[1], c2[2], s)
    assert (k1 == k2) == ((c1[1], c1[2]) == (c2[1], c2[2]))


def test_bad_input_is_a_value_error():
    for bad in (0, MAX_EXPERTS + 1, -3, 2.0, True):
        with pytest.raises(ValueError, match="n_experts"):
            class_shift(bad)
    with pytest.raises(ValueError, match="class value"):
        expert_key(256, 0, 0)  # needs a shift
    with pytest.raises(ValueError, match="class value"):
        expert_key(-1, 0, 1)
    with pytest.raises(ValueError, match="class shift"):
        expert_key(1, 0, 9)
    with pytest.raises(ValueError, match="not an expert key"):
        expert_value(Key(3, 1, 2), 1)  # y = 2 needs two bits
    with pytest.raises(ValueError, match="not an expert key"):
        expert_value(Key(3, 1, 0, 1), 1)
