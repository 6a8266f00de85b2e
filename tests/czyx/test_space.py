"""Space selectors: size, reserved prefixes, content and name derivation, refusals."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from czyx.space import (
    EDGE_PREFIX,
    PORTAL_PREFIX,
    SELECTOR_SIZE,
    Selector,
    canonical_manifest,
)


@given(st.binary(min_size=0, max_size=200))
def test_content_selectors_are_never_reserved_and_deterministic(data):
    s = Selector.from_content(data)
    assert len(s.raw) == SELECTOR_SIZE and not s.reserved
    assert Selector.from_content(data) == s
    assert Selector.for_space(s.raw) == s
    assert Selector.from_hex(s.hex()) == s


@given(st.text(min_size=1, max_size=40))
def test_name_selectors_are_never_reserved(name):
    s = Selector.from_name(name)
    assert not s.reserved and s == Selector.from_name(name)


def test_canonical_manifest_ignores_key_order():
    a = {"model": "x", "layers": 2, "nested": {"b": 1, "a": [1, 2]}}
    b = {"nested": {"a": [1, 2], "b": 1}, "layers": 2, "model": "x"}
    assert canonical_manifest(a) == canonical_manifest(b)
    assert Selector.from_manifest(a) == Selector.from_manifest(b)
    assert Selector.from_manifest(a) != Selector.from_manifest({**a, "layers": 3})
    # Content and name derivations are domain-separated.
    assert Selector.from_content(b"m") != Selector.from_name("m")


def test_reserved_spaces():
    edges = Selector.reserved_space(EDGE_PREFIX, "edges")
    portals = Selector.reserved_space(PORTAL_PREFIX)
    assert edges.raw[0] == 0xFF and portals.raw[0] == 0xFE
    assert edges.reserved and portals.reserved
    with pytest.raises(ValueError, match="reserved"):
        Selector.for_space(edges.raw)


@pytest.mark.parametrize("first", [0xFE, 0xFF])
def test_reserved_prefix_refused(first):
    with pytest.raises(ValueError, match="reserved"):
        Selector.for_space(bytes([first]) + bytes(31))


def test_errors():
    with pytest.raises(ValueError, match="selector: expected 32 bytes, got 31"):
        Selector(bytes(31))
    with pytest.raises(ValueError, match="selector: expected 32 bytes"):
        Selector("a" * 32)
    with pytest.raises(ValueError, match="selector: not hex"):
        Selector.from_hex("zz")
    with pytest.raises(ValueError, match="not a reserved prefix"):
        Selector.reserved_space(0x01)
    with pytest.raises(ValueError, match="selector name"):
        Selector.from_name("")
    with pytest.raises(ValueError, match="manifest: not canonical JSON"):
        canonical_manifest({"hash": b"\x00"})
    with pytest.raises(ValueError, match="manifest: not canonical JSON"):
        canonical_manifest({"x": float("nan")})
    with pytest.raises(ValueError, match="manifest: expected a dict"):
        canonical_manifest([1])
