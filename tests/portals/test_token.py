"""The token codec: round trips, strictness, and refusal of garbled input."""

from __future__ import annotations

import base64
import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from czyx.portals._wire import Reader, encode_varint
from czyx.portals.caveats import ClassRange, Tenant, decode_caveat
from czyx.portals.errors import PortalDenied, TokenFormatError
from czyx.portals.token import PREFIX, Token
from tests.portals.strategies import any_caveat

tokens = st.builds(
    Token,
    st.binary(min_size=8, max_size=8),
    st.binary(min_size=16, max_size=16),
    st.lists(any_caveat, max_size=8).map(tuple),
    st.binary(min_size=32, max_size=32),
)


@given(tokens)
def test_text_and_bytes_round_trip(tok):
    text = tok.to_text()
    assert text.startswith(PREFIX) and text.isascii() and " " not in text
    assert Token.from_text(text) == tok
    assert Token.from_bytes(tok.to_bytes()) == tok


@given(any_caveat)
def test_caveat_encoding_is_canonical(cav):
    enc = cav.encode()
    r = Reader(enc)
    back, raw = decode_caveat(r)
    assert back == cav and raw == enc and r.remaining() == 0


@given(st.integers(0, 2**64 - 1))
def test_varint_round_trip(v):
    r = Reader(encode_varint(v))
    assert r.varint("v") == v
    r.done("v")


@given(tokens, st.data())
def test_every_truncation_is_refused(tok, data):
    raw = tok.to_bytes()
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(TokenFormatError):
        Token.from_bytes(raw[:cut])


@given(tokens, st.binary(min_size=1, max_size=8))
def test_trailing_garbage_is_refused(tok, extra):
    with pytest.raises(TokenFormatError):
        Token.from_bytes(tok.to_bytes() + extra)


@settings(max_examples=200)
@given(st.text(max_size=200))
def test_arbitrary_text_never_crashes(text):
    with contextlib.suppress(TokenFormatError):
        assert Token.from_text(text).to_text() == text  # what parses is canonical


@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_crash(raw):
    with contextlib.suppress(TokenFormatError):
        assert Token.from_bytes(raw).to_bytes() == raw  # what parses is canonical


@given(tokens, st.data())
def test_a_changed_byte_is_refused_or_a_different_canonical_token(tok, data):
    raw = bytearray(tok.to_bytes())
    i = data.draw(st.integers(0, len(raw) - 1))
    raw[i] ^= data.draw(st.integers(1, 255))
    try:
        other = Token.from_bytes(bytes(raw))
    except TokenFormatError:
        return
    assert other != tok and other.to_bytes() == bytes(raw)


def _tok(*caveats):
    return Token(b"S" * 8, b"R" * 16, tuple(caveats), b"\x00" * 32)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda raw: b"\x02" + raw[1:], "version"),
        (lambda raw: raw[:25] + b"\x7f" + raw[26:], "caveats"),  # count too large
    ],
)
def test_header_defects_are_named(mutate, match):
    raw = _tok(ClassRange(0, 3)).to_bytes()
    with pytest.raises(TokenFormatError, match=match):
        Token.from_bytes(mutate(raw))


def test_unknown_caveat_tag_fails_closed():
    raw = bytearray(_tok(ClassRange(0, 3)).to_bytes())
    raw[26] = 0x7E  # the first caveat's tag
    with pytest.raises(TokenFormatError, match="unknown caveat tag"):
        Token.from_bytes(bytes(raw))


def test_invalid_caveat_values_are_refused():
    raw = bytearray(_tok(ClassRange(0, 3)).to_bytes())
    raw[28], raw[29] = 9, 3  # lo > hi
    with pytest.raises(TokenFormatError):
        Token.from_bytes(bytes(raw))
    bad_tenant = _tok(Tenant("acme")).to_bytes().replace(b"acme", b"ac e")
    with pytest.raises(TokenFormatError, match="tenant"):
        Token.from_bytes(bad_tenant)


def test_text_form_is_strict():
    text = _tok().to_text()
    for bad in (text[len(PREFIX) :], "czp2_" + text[5:], text + "=", text[:-1] + "+"):
        with pytest.raises(TokenFormatError):
            Token.from_text(bad)
    # A second spelling of the same bytes (a spare low bit set in the last
    # base64 character: 58 bytes leave 4 spare bits) is refused.
    body = text[len(PREFIX) :]
    assert len(_tok().to_bytes()) % 3 == 1
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    other = body[:-1] + alphabet[alphabet.index(body[-1]) ^ 1]
    assert base64.urlsafe_b64decode(other + "==") == base64.urlsafe_b64decode(body + "==")
    with pytest.raises(TokenFormatError, match="canonical"):
        Token.from_text(PREFIX + other)
    with pytest.raises(TokenFormatError):
        Token.from_text("x" * 10_000)


def test_format_error_is_a_denial_and_a_value_error():
    assert issubclass(TokenFormatError, PortalDenied)
    assert issubclass(TokenFormatError, ValueError)


def test_str_and_repr_never_show_the_signature():
    tok = Token(b"S" * 8, b"R" * 16, (), bytes(range(32)))
    assert bytes(range(32)).hex() not in repr(tok)
    assert tok.to_text() not in str(tok)
