"""Block prefix hashes and the prefix index in a store's edge space."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from czyx.inference.sessions.format import BLOCK
from czyx.inference.sessions.prefix import PREFIX_EDGE, PrefixIndex, indexed_blocks, prefix_hashes
from czyx.space import Selector
from czyx.store import Store
from tests.inference.sessions.helpers import MODEL_A, MODEL_B

tokens_st = st.lists(st.integers(0, 2**31 - 1), max_size=5 * BLOCK)


@settings(max_examples=50, deadline=None)
@given(tokens_st, st.integers(0, 5 * BLOCK))
def test_hashes_of_a_prefix_are_a_prefix_of_the_hashes(toks, cut):
    full = prefix_hashes(toks, MODEL_A, "t")
    part = prefix_hashes(toks[:cut], MODEL_A, "t")
    assert len(full) == len(toks) // BLOCK
    assert part == full[: len(part)]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), min_size=BLOCK, max_size=4 * BLOCK), st.data())
def test_any_change_in_a_block_changes_its_hash_and_every_later_one(toks, data):
    i = data.draw(st.integers(0, len(toks) - 1))
    other = list(toks)
    other[i] = (other[i] + 1) % 2**31
    a, b = prefix_hashes(toks, MODEL_A, "t"), prefix_hashes(other, MODEL_A, "t")
    first = i // BLOCK
    assert a[:first] == b[:first]
    assert all(x != y for x, y in zip(a[first:], b[first:]))


def test_model_and_tenant_are_bound():
    toks = list(range(BLOCK))
    base = prefix_hashes(toks, MODEL_A, "alice")
    assert prefix_hashes(toks, MODEL_B, "alice") != base
    assert prefix_hashes(toks, MODEL_A, "bob") != base
    assert prefix_hashes(toks, MODEL_A, "alice") == base


def test_indexed_blocks():
    assert indexed_blocks(0) == []
    assert indexed_blocks(1) == [1]
    assert indexed_blocks(8) == [1, 2, 4, 8]
    assert indexed_blocks(64) == [1, 2, 4, 8, 16, 32, 64]
    assert indexed_blocks(11) == [1, 2, 4, 8, 11]


def test_index_finds_the_longest_prefix_and_skips_held_blocks(tmp_path):
    st_ = Store.open(tmp_path)
    idx = PrefixIndex(st_)
    s1, s2 = Selector.from_name("s1"), Selector.from_name("s2")
    hist = list(range(5 * BLOCK + 10))
    assert idx.add(s1, hist[: 2 * BLOCK + 3], MODEL_A, "alice") == 2  # blocks 1, 2
    # s2 extends s1's history: blocks 1, 2 are held by s1; 4 and 5 are new.
    assert idx.add(s2, hist, MODEL_A, "alice") == 2
    assert len(list(st_.edges(PREFIX_EDGE))) == 4
    hit = idx.longest([*hist[: 4 * BLOCK + 1], 7, 7], MODEL_A, "alice")
    assert hit is not None and hit.space == s2 and hit.blocks == 4
    hit = idx.longest(hist[: 3 * BLOCK + 5], MODEL_A, "alice")  # block 3 is not indexed
    assert hit is not None and hit.space == s1 and hit.positions == 2 * BLOCK
    assert idx.longest(hist[: BLOCK - 1], MODEL_A, "alice") is None
    assert idx.longest([9, *hist], MODEL_A, "alice") is None
    assert idx.longest(hist, MODEL_B, "alice") is None
    assert idx.longest(hist, MODEL_A, "bob") is None
    st_.close()


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 9 * BLOCK), min_size=1, max_size=4),
    probe_len=st.integers(0, 10 * BLOCK),
)
def test_longest_equals_brute_force(lengths, probe_len, tmp_path_factory):
    st_ = Store.open(tmp_path_factory.mktemp("px"))
    idx = PrefixIndex(st_)
    rng = np.random.default_rng(len(lengths) * 1000 + probe_len)
    base = rng.integers(0, 50, 10 * BLOCK).tolist()
    want = 0
    probe = base[:probe_len]
    for j, n in enumerate(lengths):
        hist = base[:n] if j % 2 == 0 else base[: n // 2] + [99] * (n - n // 2)
        idx.add(Selector.from_name(f"s{j}"), hist, MODEL_A, "t")
        common = 0
        while common < min(len(hist), len(probe)) and hist[common] == probe[common]:
            common += 1
        found = [k for k in indexed_blocks(len(hist) // BLOCK) if k <= common // BLOCK]
        want = max([want, *found])
    hit = idx.longest(probe, MODEL_A, "t")
    assert (hit.blocks if hit else 0) == want
    st_.close()
