"""Role classes, named policies, --quant parsing and per-tensor decisions."""

from __future__ import annotations

import argparse

import pytest

from czyx.store.consumer import TRUNK_ROLES
from czyx.store.quant.errors import PolicyError
from czyx.store.quant.policy import (
    POLICIES,
    ROLE_CLASSES,
    add_quant_argument,
    parse_policy,
    role_class,
)


def test_every_consumer_role_has_a_class():
    for role in TRUNK_ROLES:
        assert role_class(role) in ROLE_CLASSES
    with pytest.raises(PolicyError):
        role_class("nonsense")


def test_named_policies():
    sel = POLICIES["selective"]
    assert sel.format_for("expert") == "q2"
    assert sel.format_for("q_proj") == "q4"
    assert sel.format_for("shared_down_proj") == "q4"
    assert sel.format_for("embed") == sel.format_for("lm_head") == "q8"
    assert sel.format_for("router") is None
    assert sel.format_for("input_norm") is None
    assert POLICIES["q2-all"].format_for("router") == "q2"
    assert POLICIES["q4-all"].format_for("embed") == "q4"
    assert not POLICIES["none"].quantizes
    for p in POLICIES.values():
        assert p.format_for("q_bias") is None and p.format_for("final_norm") is None


def test_decisions_fall_back_by_group_then_to_float():
    sel = POLICIES["selective"]
    assert sel.decide("expert", (96, 128)).format_name == "q2"
    d = sel.decide("expert", (96, 96))  # 96 is not a multiple of 64
    assert d.format_name == "q2g32" and "not a multiple" in d.reason
    assert sel.decide("expert", (96, 40)).fmt is None
    assert sel.decide("input_norm", (64,)).format_name == "f32"
    assert POLICIES["q4-all"].decide("input_norm", (64,)).fmt is None


def test_parse_overrides_and_errors():
    p = parse_policy("selective, embed=q4 ,router=q8,expert=q3g128")
    assert p.format_for("embed") == "q4"
    assert p.format_for("router") == "q8"
    assert p.format_for("expert") == "q3g128"
    assert parse_policy("q4-all,lm_head=f32").format_for("lm_head") is None
    assert parse_policy("selective") is POLICIES["selective"]
    for bad in ("", "fancy", "selective,embed", "selective,bogus=q4", "selective,embed=q7"):
        with pytest.raises(PolicyError):
            parse_policy(bad)


def test_argparse_option():
    parser = argparse.ArgumentParser()
    add_quant_argument(parser)
    assert parser.parse_args([]).quant is POLICIES["none"]
    assert parser.parse_args(["--quant", "selective"]).quant is POLICIES["selective"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--quant", "fancy"])
