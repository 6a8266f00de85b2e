"""The HMAC chain: offline attenuation narrows, nothing else verifies.

Adversarial cases that need no store: forged, tampered, truncated, removed or
reordered caveats, a widening attempt and a token from another secret.
"""

from __future__ import annotations

import dataclasses
import hmac
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from czyx.portals.caveats import (
    ClassRange,
    Expires,
    LayerRange,
    PortalId,
    Rights,
    Spaces,
    Tenant,
)
from czyx.portals.chain import ChainKeys, attenuate, extend_registered, hkdf, mint, verify_signature
from czyx.portals.errors import (
    CaveatError,
    ForeignPortal,
    InvalidSignature,
    TokenFormatError,
    WideningError,
)
from czyx.portals.token import Token
from tests.portals.strategies import SPACE_POOL, TENANT_POOL, restricting_caveats

KEYS = ChainKeys.from_secret(b"k" * 32)
OTHER = ChainKeys.from_secret(b"o" * 32)
A, B = SPACE_POOL[0], SPACE_POOL[1]


def _granted() -> Token:
    root = mint(KEYS, KEYS.owner_id)
    return extend_registered(
        root,
        b"\x01" * 16,
        [Spaces(frozenset({A})), Tenant("acme"), ClassRange(0, 63), LayerRange(0, 3)],
    )


def test_hkdf_matches_rfc5869_structure():
    # RFC 5869 with SHA-256: T(1) = HMAC(PRK, info || 0x01).
    prk = hmac.digest(b"czyx-portals-v1", b"secret", "sha256")
    assert hkdf(b"secret", b"x") == hmac.digest(prk, b"x\x01", "sha256")
    assert len(hkdf(b"secret", b"x", 80)) == 80
    assert hkdf(b"secret", b"x", 80)[:32] == hkdf(b"secret", b"x")


def test_keys_hide_the_root_key_and_differ_per_secret():
    assert KEYS.root_key.hex() not in repr(KEYS)
    assert KEYS.store_id != OTHER.store_id and KEYS.owner_id != OTHER.owner_id


def test_minted_and_attenuated_tokens_verify():
    tok = _granted()
    verify_signature(KEYS, tok)
    narrower = attenuate(tok, [ClassRange(10, 20), Rights(frozenset({"read"}))])
    verify_signature(KEYS, narrower)
    verify_signature(KEYS, Token.from_text(narrower.to_text()))


def test_forged_signature_is_refused():
    tok = dataclasses.replace(_granted(), signature=bytes(32))
    with pytest.raises(InvalidSignature):
        verify_signature(KEYS, tok)


def test_tampered_caveat_is_refused():
    tok = _granted()
    cavs = list(tok.caveats)
    i = next(i for i, c in enumerate(cavs) if isinstance(c, ClassRange))
    cavs[i] = ClassRange(0, 255)
    with pytest.raises(InvalidSignature):
        verify_signature(KEYS, dataclasses.replace(tok, caveats=tuple(cavs)))


def test_tampered_bytes_are_refused_everywhere():
    raw = _granted().to_bytes()
    for i in range(len(raw)):
        for flip in (0x01, 0x80):
            bad = bytearray(raw)
            bad[i] ^= flip
            with pytest.raises((TokenFormatError, InvalidSignature, ForeignPortal)):
                verify_signature(KEYS, Token.from_bytes(bytes(bad)))


def test_removed_or_reordered_caveats_are_refused():
    tok = attenuate(_granted(), [ClassRange(0, 7), LayerRange(1, 1)])
    cavs = tok.caveats
    for i in range(len(cavs)):
        dropped = cavs[:i] + cavs[i + 1 :]
        with pytest.raises(InvalidSignature):
            verify_signature(KEYS, dataclasses.replace(tok, caveats=dropped))
    with pytest.raises(InvalidSignature):
        verify_signature(KEYS, dataclasses.replace(tok, caveats=cavs[::-1]))
    # The parent's signature with the child's caveats (truncating the chain).
    with pytest.raises(InvalidSignature):
        verify_signature(KEYS, dataclasses.replace(tok, signature=_granted().signature))


def test_token_from_another_secret_is_refused():
    foreign = mint(OTHER, OTHER.owner_id)
    with pytest.raises(ForeignPortal):
        verify_signature(KEYS, foreign)
    # Copying this store's public id into the header does not help.
    posing = mint(OTHER, KEYS.owner_id)
    posing = dataclasses.replace(posing, store_id=KEYS.store_id)
    with pytest.raises(InvalidSignature):
        verify_signature(KEYS, posing)


def test_strict_attenuation_refuses_to_widen():
    tok = attenuate(_granted(), [Expires(2_000_000_000), Rights(frozenset({"read", "infer"}))])
    for wider in (
        ClassRange(0, 255),
        LayerRange(0, 7),
        Rights(frozenset({"read", "grant"})),
        Spaces(frozenset({A, B})),
        Tenant("globex"),
        Expires(2_000_000_001),
        ClassRange(0, 3, space=B),
    ):
        with pytest.raises(WideningError):
            attenuate(tok, [wider])


def test_non_strict_widening_does_not_widen():
    tok = _granted()
    loose = attenuate(tok, [ClassRange(0, 255), LayerRange(0, 99), Tenant("globex")], strict=False)
    verify_signature(KEYS, loose)
    perm, parent = loose.permission(), tok.permission()
    assert perm.is_subset_of(parent)
    assert not perm.allows(A, "read", 64, 0)  # still outside the parent's classes
    assert not perm.allows(A, "read", 0, 4)  # and layers
    assert not perm.allows_open(A, "read", tenant="acme")  # two tenants: nobody


def test_portal_ids_are_not_attenuation_caveats():
    with pytest.raises(CaveatError):
        attenuate(_granted(), [PortalId(b"\x02" * 16)])


def _probes(n: int = 300) -> list[tuple]:
    """A fixed spread of access requests (space, right, class, layer, tenant, now)."""
    rng = random.Random(1234)
    return [
        (
            rng.choice(SPACE_POOL),
            rng.choice(["read", "infer", "grant"]),
            rng.randrange(256),
            rng.randrange(12),
            rng.choice([None, *TENANT_POOL]),
            rng.randrange(4_000_000_000),
        )
        for _ in range(n)
    ]


PROBES = _probes()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(restricting_caveats, max_size=4), min_size=1, max_size=4))
def test_any_attenuation_sequence_only_narrows(steps):
    """For all sequences of attenuations: each token's permitted reads are a
    subset of its parent's, and the chain still verifies."""
    tok = mint(KEYS, KEYS.owner_id)
    for step in steps:
        child = attenuate(tok, step, strict=False)
        verify_signature(KEYS, child)
        cp, pp = child.permission(), tok.permission()
        assert cp.is_subset_of(pp)
        for space, right, cls, lay, tenant, now in PROBES:
            if cp.allows(space, right, cls, lay, tenant=tenant, now=now):
                assert pp.allows(space, right, cls, lay, tenant=tenant, now=now)
        tok = child


@settings(max_examples=100, deadline=None)
@given(st.lists(restricting_caveats, min_size=1, max_size=5))
def test_strict_attenuation_either_refuses_or_keeps_what_it_asked(cavs):
    """Strict mode never silently narrows a request below what it named."""
    tok = _granted()
    try:
        child = attenuate(tok, cavs)
    except WideningError:
        return
    verify_signature(KEYS, child)
    assert child.permission().is_subset_of(tok.permission())
