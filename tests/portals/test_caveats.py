"""Caveat values, human specs and the permission algebra."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from czyx.portals.caveats import (
    ClassRange,
    ClassSet,
    LayerRange,
    Rights,
    Spaces,
    Tenant,
    check_tenant,
    format_mask,
    parse_classes,
    parse_layers,
    parse_rights,
)
from czyx.portals.errors import CaveatError
from czyx.portals.permission import Permission, Scope
from tests.portals.strategies import SPACE_POOL

A, B = SPACE_POOL[0], SPACE_POOL[1]


@given(st.integers(1, (1 << 256) - 1))
def test_class_spec_round_trips_through_its_text(mask):
    cav = parse_classes(format_mask(mask))
    assert cav.mask == mask
    # A contiguous set always gets the compact range encoding.
    lo, hi = (mask & -mask).bit_length() - 1, mask.bit_length() - 1
    assert isinstance(cav, ClassRange) == (mask == ((1 << (hi + 1)) - 1) ^ ((1 << lo) - 1))


def test_parse_specs():
    assert parse_classes("0-63") == ClassRange(0, 63)
    assert parse_classes("0x2a") == ClassRange(42, 42)
    assert parse_classes("1,3").mask == 0b1010 and isinstance(parse_classes("1,3"), ClassSet)
    assert parse_layers("0-3") == LayerRange(0, 3)
    assert parse_layers("7") == LayerRange(7, 7)
    assert parse_rights("read, INFER") == Rights(frozenset({"read", "infer"}))


@pytest.mark.parametrize(
    "fn, spec, field",
    [
        (parse_classes, "0-256", "classes"),
        (parse_classes, "9-3", "classes"),
        (parse_classes, "", "classes"),
        (parse_classes, "a-b", "classes"),
        (parse_layers, "3-1", "layers"),
        (parse_layers, "-1", "layers"),
        (parse_rights, "read,write", "rights"),
        (parse_rights, " , ", "rights"),
    ],
)
def test_bad_specs_name_their_field(fn, spec, field):
    with pytest.raises(CaveatError, match=field):
        fn(spec)


def test_value_checks():
    with pytest.raises(CaveatError):
        Spaces(frozenset())
    with pytest.raises(CaveatError):
        Spaces(frozenset({b"short"}))
    with pytest.raises(CaveatError):
        ClassSet(0)
    for bad in ("", "a b", "x" * 200, "é"):
        with pytest.raises(CaveatError, match="tenant"):
            check_tenant(bad)
    assert Tenant("team-a@corp.example").name


def test_scoped_caveats_only_touch_their_space():
    perm = Permission.from_caveats(
        b"\x00" * 16,
        [Spaces(frozenset({A, B})), ClassRange(0, 7, space=A), LayerRange(2, 3, space=A)],
    )
    assert perm.scope_for(A) == Scope(classes=0xFF, layer_lo=2, layer_hi=3)
    assert perm.scope_for(B) == Scope()
    assert perm.allows(B, "read", 200, 50) and not perm.allows(A, "read", 200, 2)
    assert perm.scope_for(SPACE_POOL[2]).empty  # not named at all


def test_tenant_and_expiry_semantics():
    perm = Permission.from_caveats(b"\x00" * 16, [Tenant("acme")])
    assert perm.tenant == "acme"
    assert perm.allows_open(A, "read") and perm.allows_open(A, "read", tenant="acme")
    assert not perm.allows_open(A, "read", tenant="globex")
    from czyx.portals.caveats import Expires

    late = perm.with_caveat(Expires(100)).with_caveat(Expires(200))
    assert late.expires == 100
    assert late.allows_open(A, "read", now=99) and not late.allows_open(A, "read", now=100)
