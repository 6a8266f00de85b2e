"""The SES extent codec: exact round trips, prefix reads, and refusal of bad bytes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from czyx.inference.sessions.errors import SessionFormatError
from czyx.inference.sessions.format import BLOCK, HEADER, KV_ALIGN, Layout, ParsedExtent, encode
from tests.inference.sessions.helpers import random_state, states_equal


@settings(max_examples=40, deadline=None)
@given(
    n_layers=st.integers(1, 3),
    n_kv=st.integers(1, 3),
    hd=st.integers(1, 6),
    length=st.integers(0, 3 * BLOCK + 3),
    vocab=st.sampled_from([0, 1, 17]),
    tenant=st.text(max_size=12),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip_is_exact(n_layers, n_kv, hd, length, vocab, tenant, seed):
    rng = np.random.default_rng(seed)
    s = random_state(
        rng, n_layers=n_layers, n_kv=n_kv, hd=hd, length=length, vocab=vocab, tenant=tenant
    )
    enc = encode(s)
    assert enc.payload.size == enc.layout.total
    assert enc.layout.kv_off % KV_ALIGN == 0
    parsed = ParsedExtent(enc.payload)
    parsed.verify(enc.head_sum, enc.block_sums)
    assert states_equal(parsed.to_state(), s)


@settings(max_examples=30, deadline=None)
@given(length=st.integers(1, 3 * BLOCK + 5), data=st.data())
def test_prefix_read_needs_only_its_blocks(length, data):
    rows = data.draw(st.integers(0, length))
    s = random_state(np.random.default_rng(length), length=length)
    enc = encode(s)
    n = enc.layout.prefix_nbytes(rows)
    # Only the blocks covering ``rows`` positions lie in the prefix read.
    nb = -(-rows // BLOCK)
    assert n == (
        enc.layout.kv_off
        if nb == 0
        else enc.layout.block_off(nb - 1) + enc.layout.block_len(nb - 1) * enc.layout.row_bytes
    )
    parsed = ParsedExtent(enc.payload[:n].copy(), rows)
    parsed.verify(enc.head_sum, enc.block_sums)
    got = parsed.to_state()
    assert got.length == rows and np.array_equal(got.tokens, s.tokens[:rows])
    for i in range(s.n_layers):
        assert np.array_equal(got.k[i], s.k[i][:, :rows])
        assert np.array_equal(got.v[i], s.v[i][:, :rows])
    assert (got.logits is None) == (rows < length)
    if n > enc.layout.kv_off:
        with pytest.raises(SessionFormatError, match="truncated"):
            ParsedExtent(enc.payload[: n - 1].copy(), rows)


def test_copy_into_wider_cache_matches_and_leaves_the_rest():
    s = random_state(np.random.default_rng(1), length=2 * BLOCK + 7)
    parsed = ParsedExtent(encode(s).payload)
    cap = 300
    k = [np.full((s.n_kv_heads, cap, s.head_dim), -5.0, np.float32) for _ in range(s.n_layers)]
    v = [np.full((s.n_kv_heads, cap, s.head_dim), -5.0, np.float32) for _ in range(s.n_layers)]
    parsed.copy_kv_into(k, v)
    for i in range(s.n_layers):
        assert np.array_equal(k[i][:, : s.length], s.k[i])
        assert np.array_equal(v[i][:, : s.length], s.v[i])
        assert (k[i][:, s.length :] == -5.0).all() and (v[i][:, s.length :] == -5.0).all()
    with pytest.raises(SessionFormatError, match="too small"):
        parsed.copy_kv_into([a[:, :10] for a in k], v)


def test_layout_offsets():
    lay = Layout(n_layers=2, n_kv_heads=3, head_dim=4, length=130, vocab=5, meta_len=10)
    assert lay.meta_off == HEADER.size == 128
    assert lay.tokens_off % 8 == 0 and lay.logits_off % 8 == 0
    assert lay.n_blocks == 3 and lay.block_len(2) == 2
    assert lay.total == lay.kv_off + 130 * lay.row_bytes
    with pytest.raises(ValueError):
        lay.prefix_nbytes(131)


@pytest.mark.parametrize(
    ("offset", "value", "match"),
    [(0, b"X", "bad magic"), (8, b"\x09", "format version"), (24, b"\x03", "layout says")],
)
def test_bad_header_fields_are_refused(offset, value, match):
    buf = encode(random_state(np.random.default_rng(2))).payload.copy()
    buf[offset : offset + len(value)] = np.frombuffer(value, np.uint8)
    with pytest.raises(SessionFormatError, match=match):
        ParsedExtent(buf)


def test_checksums_name_the_damaged_section():
    s = random_state(np.random.default_rng(3), length=BLOCK + 3)
    enc = encode(s)
    head = enc.payload.copy()
    head[enc.layout.tokens_off] ^= 1
    with pytest.raises(SessionFormatError, match="head"):
        ParsedExtent(head).verify(enc.head_sum, enc.block_sums)
    blk = enc.payload.copy()
    blk[enc.layout.block_off(1) + 5] ^= 1
    with pytest.raises(SessionFormatError, match="KV block 1"):
        ParsedExtent(blk).verify(enc.head_sum, enc.block_sums)
    # A prefix that stops before the damaged block verifies.
    ParsedExtent(blk, BLOCK).verify(enc.head_sum, enc.block_sums)
    with pytest.raises(SessionFormatError, match="block sums"):
        ParsedExtent(enc.payload).verify(enc.head_sum, enc.block_sums[:1])


def test_inconsistent_state_is_refused():
    s = random_state(np.random.default_rng(4), length=10)
    with pytest.raises(SessionFormatError, match="layer 1"):
        type(s)(s.model, s.tenant, s.tokens, s.k, (s.v[0], s.v[1][:, :5]))
    with pytest.raises(SessionFormatError, match="not f32"):
        type(s)(s.model, s.tenant, s.tokens, tuple(a.astype(np.float16) for a in s.k), s.v)
    with pytest.raises(SessionFormatError, match="32 bytes"):
        type(s)(b"short", s.tenant, s.tokens, s.k, s.v)
