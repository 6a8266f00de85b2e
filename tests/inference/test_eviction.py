"""Decay and SLRU eviction: invariants, and the engine's cache against the replay simulation.

For every access sequence the slot cache with a policy must (a) never pick a
blocked (held or pinned) slot, and (b) where the engine's constraint cannot
bind (one expert per acquire) produce exactly the hit/miss sequence of
:mod:`inference.locality.replay`'s simulation of the same policy; LRU must
match the replay for any top-k.
"""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from czyx.inference.cache import POLICIES, ExpertCache
from czyx.inference.eviction import (
    HALF_LIFE_TOKENS,
    PROTECTED_FRAC,
    START_HALF_LIFE_TOKENS,
    WARMUP_TOKENS,
    DecayPolicy,
    NextUsePolicy,
    SLRUPolicy,
)
from czyx.inference.locality import replay
from czyx.inference.trace import text_sha256
from czyx.testing.fakes import FakeConsumer

SLOT = 4096
L, E = 2, 6
ASSET = Path(__file__).resolve().parents[2] / "inference" / "assets" / "czyx-moe-stdlib"
TRACE_BYTES = 300


def _engine_hits(policy: str, experts: np.ndarray, n_slots: int) -> np.ndarray:
    """Hits per layer group of an ExpertCache fed ``experts [T, L, k]`` token by token."""
    t_, l_, k = experts.shape
    c = ExpertCache(FakeConsumer(l_, E), SLOT * n_slots, top_k=k, policy=policy)
    hits = np.zeros((t_, l_), np.int64)
    for t in range(t_):
        c.advance(1)
        for layer in range(l_):
            before = c.hits
            c.acquire(layer, experts[t, layer])
            c.release()
            hits[t, layer] = c.hits - before
    c.check()
    return hits.reshape(-1)


def _replay_hits(policy: str, experts: np.ndarray, n_slots: int) -> np.ndarray:
    t_, l_, k = experts.shape
    ids = (experts + (np.arange(l_) * E)[None, :, None]).reshape(-1).astype(np.int64)
    tok = np.repeat(np.arange(t_, dtype=np.int64), l_ * k)
    if policy == "lru":
        return replay.lru(ids, n_slots)
    if policy == "decay":
        return replay.hotness(ids, tok, n_slots)
    return replay.slru(ids, n_slots)


def _distinct_rows(draw_rows: list[list[int]], k: int) -> np.ndarray:
    """[T, L, k] experts, each layer's k distinct (top-k never repeats an expert)."""
    out = []
    for row in draw_rows:
        layers = []
        for layer in range(L):
            start = row[layer]
            layers.append([(start + 1 + j * row[L]) % E if j else start for j in range(k)])
        out.append(layers)
    return np.array(out, np.int64)


@pytest.mark.parametrize("policy", ["lru", "decay", "slru"])
@settings(max_examples=150, deadline=None)
@given(
    n_slots=st.integers(1, 12),
    tokens=st.lists(st.lists(st.integers(0, E - 1), min_size=L, max_size=L), max_size=120),
)
def test_engine_cache_matches_the_replay_simulation_one_expert_at_a_time(policy, n_slots, tokens):
    experts = np.array(tokens, np.int64).reshape(len(tokens), L, 1)
    got = _engine_hits(policy, experts, n_slots).astype(bool)
    want = _replay_hits(policy, experts, n_slots) if len(tokens) else np.zeros(0, bool)
    assert np.array_equal(got, want)


@settings(max_examples=40, deadline=None)
@given(
    n_slots=st.integers(2, 12),
    rows=st.lists(
        st.tuples(st.integers(0, E - 1), st.integers(0, E - 1), st.integers(1, E - 2)).map(list),
        min_size=1,
        max_size=80,
    ),
)
def test_engine_lru_matches_the_replay_for_top_2(n_slots, rows):
    # The engine looks up a layer's hits before filling its misses (a miss never
    # evicts an expert the same token needs there), so its LRU is the sequential
    # replay of each layer group reordered hits first.
    experts = _distinct_rows(rows, 2)
    got = _engine_hits("lru", experts, n_slots)
    want = _grouped_lru_hits(experts, n_slots)
    assert np.array_equal(got, want)


def _hits_per_acquire(eng, stream: bool, text) -> tuple[list[int], int]:
    """Decode ``text`` token by token on ``eng``; the hits of each of its cache's layer
    acquires, in order, and its slot count (the engine is closed after)."""
    cache = eng.cache
    per_call: list[int] = []
    # Decoding acquires through acquire_streamed (which the plain acquire also calls on
    # the streaming cache): count each layer's hits there, once per call.
    name = "acquire_streamed" if stream else "acquire"
    acquire = getattr(cache, name)

    def counting(layer, ex):
        before = cache.hits
        out = acquire(layer, ex)
        per_call.append(cache.hits - before)
        return out

    setattr(cache, name, counting)
    try:
        for b in text:
            eng.decode(b)
        cache.check()
        return per_call, cache.n_slots
    finally:
        eng.close()


def _grouped_lru_hits(experts: np.ndarray, n_slots: int, n_experts: int = E) -> np.ndarray:
    """Hits per layer group of an LRU that serves a group's resident experts first."""
    from collections import OrderedDict

    cache: OrderedDict[int, None] = OrderedDict()
    out = []
    t_, l_, _ = experts.shape
    for t in range(t_):
        for layer in range(l_):
            group = [layer * n_experts + int(e) for e in experts[t, layer]]
            present = [x for x in group if x in cache]
            for x in present:
                cache.move_to_end(x)
            for x in group:
                if x in cache:
                    continue
                if len(cache) >= n_slots:
                    victim = next(k for k in cache if k not in group)
                    del cache[victim]
                cache[x] = None
            out.append(len(present))
    return np.array(out, np.int64)


@pytest.fixture(scope="module")
def stdlib_trace(tmp_path_factory):
    """The bundled model mounted, and the routing of a held-out-like text (resident run)."""
    from czyx.inference.engine import Engine
    from czyx.inference.opened import OpenedModel
    from czyx.inference.profile import RouteRecorder
    from czyx.store import Store
    from czyx.store.models.mount import mount

    root = tmp_path_factory.mktemp("policies")
    with Store.open(root / "store") as st:
        mount(st, ASSET, "m@1")
    opened = OpenedModel(str(root / "store"), "m@1", None)
    text = Path(json.__file__).read_bytes()[:TRACE_BYTES]  # stdlib prose-and-code
    full = Engine(opened.consumer, cache_fraction=1.0)
    cfg = full.cfg
    rec = RouteRecorder(cfg.sparse_layers, cfg.n_experts, cfg.top_k)
    full.model.recorder = rec
    rec.new_segment(len(text))
    for b in text:
        full.decode(b)
    full.close()
    kind = "topk_renormalized" if cfg.renormalize else "softmax"
    trace = rec.trace("m@1", text_sha256(text), kind)
    yield opened, text, trace.experts, cfg.n_experts
    opened.close()


@pytest.mark.parametrize("stream", [True, False])
def test_engine_lru_at_a_tight_budget_is_the_hits_first_replay(stdlib_trace, stream):
    """Issue 19: at 12.5 % (8 slots for 8 requests a token) the engine's LRU, on the
    default streaming path and on the synchronous cache, scores exactly the replay that
    serves each layer's resident experts before its misses (no miss evicts a same-token
    hit), group by group."""
    from czyx.inference.engine import Engine
    from czyx.inference.options import EngineOptions

    opened, text, experts, n_experts = stdlib_trace
    eng = Engine(
        opened.consumer,
        cache_fraction=0.125,
        options=EngineOptions(policy="lru", stream=stream, prefetch=False),
    )
    per_call, n_slots = _hits_per_acquire(eng, stream, text)
    want = _grouped_lru_hits(experts, n_slots, n_experts)
    assert np.array_equal(np.array(per_call), want)
    assert want.sum() > 0 and (want < experts.shape[2]).sum() > 0


@settings(max_examples=60, deadline=None)
@given(
    cls=st.sampled_from([DecayPolicy, SLRUPolicy, NextUsePolicy]),
    n_slots=st.integers(1, 10),
    ops=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 29), st.integers(0, 5)), max_size=60),
    blocked_bits=st.lists(st.booleans(), min_size=10, max_size=10),
)
def test_victim_is_never_a_blocked_slot(cls, n_slots, ops, blocked_bits):
    p = cls(n_slots, 30)
    t = 0
    for slot, key, dt in ops:
        slot %= n_slots
        if hasattr(p, "set_token"):
            t += dt
            p.set_token(t)
        if dt == 0:
            p.filled(slot, key)
        p.touch(slot)
    blocked = np.array(blocked_bits[:n_slots])
    v = p.victim(blocked)
    if blocked.all():
        assert v == -1
    else:
        assert 0 <= v < n_slots and not blocked[v]


@settings(max_examples=40, deadline=None)
@given(
    policy=st.sampled_from(["decay", "slru", "cyclic", "nextuse"]),
    n_slots=st.integers(3, 10),
    pinned=st.integers(0, 3),
    steps=st.lists(
        st.tuples(st.integers(0, 2), st.lists(st.integers(0, 7), min_size=1, max_size=2)),
        min_size=1,
        max_size=60,
    ),
)
def test_held_and_pinned_slots_survive_every_miss(policy, n_slots, pinned, steps):
    c = ExpertCache(FakeConsumer(3, 8), SLOT * n_slots, top_k=2, policy=policy)
    pinned = min(pinned, n_slots - 2)
    c.pin([(0, e) for e in range(pinned)])
    pins = {int(c.table[0, e]) for e in range(pinned)}
    for layer, experts in steps:
        c.advance(1)
        experts = np.array(sorted(set(experts)))
        slots = c.acquire(layer, experts).copy()
        # A later miss in the same acquire never took an earlier expert's slot.
        assert all(c.owner[s] == layer * 8 + e for s, e in zip(slots.tolist(), experts.tolist()))
        c.release()
        c.check()
        assert all(c.owner[s] == e for s, e in zip(sorted(pins), range(pinned)))


def test_defaults_are_the_locality_studys():
    assert inspect.signature(replay.hotness).parameters["half_life"].default == HALF_LIFE_TOKENS
    for f in (replay.nextuse, NextUsePolicy):
        params = inspect.signature(f).parameters
        assert params["half_life"].default == HALF_LIFE_TOKENS
        assert params["start_half_life"].default == START_HALF_LIFE_TOKENS
        assert params["warmup"].default == WARMUP_TOKENS
    assert inspect.signature(replay.slru).parameters["protected_frac"].default == PROTECTED_FRAC
    assert {"lru", "lfu", "decay", "slru"} <= set(POLICIES)


def test_decay_forgets_a_stale_favourite_that_lfu_keeps():
    # Expert 0 is used 20 times early; then 1 and 2 are used 10 times each over 500
    # tokens; a new expert 3 arrives: LFU keeps the stale 0, decay drops it.
    seq = [(1, 0)] * 20 + [(25, 1), (25, 2)] * 10 + [(1, 3)]
    out = {}
    for policy in ("lfu", "decay"):
        c = ExpertCache(FakeConsumer(1, 8), SLOT * 3, top_k=1, policy=policy)
        for dt, e in seq:
            c.advance(dt)
            c.acquire(0, np.array([e]))
            c.release()
        out[policy] = sorted(c.resident()[:, 1].tolist())
    assert 0 in out["lfu"] and 3 in out["lfu"]
    assert out["decay"] == [1, 2, 3]


def test_slru_protects_reused_experts_from_a_scan():
    # 0 and 1 are reused (protected); a scan of one-off experts only churns probation.
    c = ExpertCache(FakeConsumer(1, 16), SLOT * 4, top_k=1, policy="slru")
    for e in [0, 1, 0, 1, *range(2, 14)]:
        c.acquire(0, np.array([e]))
        c.release()
    assert {0, 1} <= set(c.resident()[:, 1].tolist())
    lru = ExpertCache(FakeConsumer(1, 16), SLOT * 4, top_k=1, policy="lru")
    for e in [0, 1, 0, 1, *range(2, 14)]:
        lru.acquire(0, np.array([e]))
        lru.release()
    assert not {0, 1} & set(lru.resident()[:, 1].tolist())


@pytest.mark.parametrize("bad", [dict(half_life=0.0), dict(half_life=-1.0)])
def test_decay_half_life_must_be_positive(bad):
    with pytest.raises(ValueError, match="half_life"):
        DecayPolicy(4, 8, **bad)


def test_slru_protected_frac_is_validated():
    with pytest.raises(ValueError, match="protected_frac"):
        SLRUPolicy(4, 8, protected_frac=1.5)


# --------------------------------------------------------------------------- cyclic


def _one_expert_per_layer(policy_cls):
    """A layer-cycle policy over 3 layers of 4 experts, 3 slots: slot L holds layer L's
    expert 0, each used once at token 0 (equal scores)."""
    n_layers, n_exp = 3, 4
    p = policy_cls(3, n_layers * n_exp)
    p.set_layout(n_layers, n_exp)
    p.set_token(0)
    for slot in range(n_layers):
        p.filled(slot, slot * n_exp)
        p.touch(slot)
    return p


def test_cyclic_evicts_what_the_layer_cycle_needs_last():
    """Equal scores: the filled layer's other experts go first (needed next step), then the
    layer just computed, and the next layer's last (needed within this step)."""
    from czyx.inference.eviction import CyclicPolicy

    p = _one_expert_per_layer(CyclicPolicy)
    free = np.zeros(3, bool)
    p.set_layer(1)
    assert p.victim(free) == 1  # layer 1's other expert: not needed before the next step
    assert p.victim(np.array([False, True, False])) == 0  # then layer 0, just computed
    p.set_layer(2)
    assert p.victim(np.array([False, False, True])) == 1  # filling 2: layer 1 comes last
    # A score twice as high outweighs being one layer farther, not being twice as far.
    p.touch(0)  # layer 0 now scores 2
    p.set_layer(0)
    # filling 0: layer 1 is 1 ahead (score 1), layer 2 is 2 ahead (score 1): 2 goes.
    assert p.victim(np.array([True, False, False])) == 2
    assert p.victim(np.ones(3, bool)) == -1
    with pytest.raises(ValueError, match="half_life"):
        CyclicPolicy(3, 12, half_life=0)


@pytest.mark.parametrize("bad", [dict(half_life=0.0), dict(start_half_life=64.0), dict(warmup=0.0)])
def test_nextuse_parameters_are_validated(bad):
    with pytest.raises(ValueError, match=r"half_life|warmup"):
        NextUsePolicy(4, 8, **bad)


def _batched_sweep_misses(policy: str) -> int:
    """Four sequences stepping three layers together, each keeping to its own experts
    (a token's top-2 drawn from a per-sequence set of three), the batch's union of a
    step (about 16 of the 24 experts) over 10 slots."""
    rng = np.random.default_rng(7)
    n_layers, n_exp, seqs = 3, 8, 4
    own = [[rng.choice(n_exp, 3, replace=False) for _ in range(n_layers)] for _ in range(seqs)]
    c = ExpertCache(FakeConsumer(n_layers, n_exp), SLOT * 10, top_k=2, policy=policy)
    for _ in range(60):
        c.advance(seqs)
        for layer in range(n_layers):
            chosen = {int(e) for s in range(seqs) for e in rng.choice(own[s][layer], 2, False)}
            c.acquire(layer, np.array(sorted(chosen)))
            c.release()
        c.check()
    return c.stats().misses


def test_cyclic_reads_less_than_decay_and_lru_when_a_batch_overflows_the_slots():
    got = {p: _batched_sweep_misses(p) for p in ("cyclic", "decay", "lru")}
    assert got["cyclic"] < got["decay"] and got["cyclic"] < got["lru"], got


# --------------------------------------------------------------------------- nextuse


def _routed(rows: list[list[int]], n_layers: int, n_experts: int, k: int) -> np.ndarray:
    """``[T, n_layers, k]`` experts from hypothesis draws, each layer's k distinct: the
    distinct values of its draws in order, topped up with the lowest unused experts."""
    out = np.empty((len(rows), n_layers, k), np.int64)
    for t, row in enumerate(rows):
        for layer in range(n_layers):
            picks = list(dict.fromkeys(row[layer * k : (layer + 1) * k]))
            picks += [e for e in range(n_experts) if e not in picks][: k - len(picks)]
            out[t, layer] = picks
    return out


@settings(max_examples=60, deadline=None)
@given(
    n_layers=st.integers(1, 4),
    k=st.integers(1, 3),
    extra=st.integers(0, 8),
    warmup=st.sampled_from([1.0, 16.0, WARMUP_TOKENS]),
    rows=st.lists(st.lists(st.integers(0, 7), min_size=12, max_size=12), min_size=1, max_size=60),
)
def test_engine_nextuse_is_the_hits_first_replay(n_layers, k, extra, warmup, rows):
    """For any routing (k distinct experts a layer), any budget that holds a layer and a
    half-life warm within or after the trace, the cache with ``nextuse`` scores exactly
    :func:`replay.nextuse`, group by group."""
    n_experts = 8
    experts = _routed(rows, n_layers, n_experts, k)
    n_slots = k + extra
    policy = NextUsePolicy(n_slots, n_layers * n_experts, warmup=warmup)
    c = ExpertCache(FakeConsumer(n_layers, n_experts), SLOT * n_slots, top_k=k, policy=policy)
    got = []
    for t in range(len(experts)):
        c.advance(1)
        for layer in range(n_layers):
            before = c.hits
            c.acquire(layer, experts[t, layer])
            c.release()
            got.append(c.hits - before)
    c.check()
    want = replay.nextuse(experts, n_experts, n_slots, warmup=warmup).reshape(-1, k).sum(axis=1)
    assert np.array_equal(np.array(got), want)


@pytest.mark.parametrize("stream", [True, False])
def test_engine_nextuse_at_a_tight_budget_is_its_replay(stdlib_trace, stream):
    """At 12.5 % (8 slots for 8 requests a token) the engine's ``nextuse``, on the default
    streaming path and on the synchronous cache, scores exactly :func:`replay.nextuse` on
    the routing a resident run recorded, group by group."""
    from czyx.inference.engine import Engine
    from czyx.inference.options import EngineOptions

    opened, text, experts, n_experts = stdlib_trace
    eng = Engine(
        opened.consumer,
        cache_fraction=0.125,
        options=EngineOptions(policy="nextuse", stream=stream, prefetch=False),
    )
    assert isinstance(eng.cache.policy, NextUsePolicy)
    per_call, n_slots = _hits_per_acquire(eng, stream, text)
    want = replay.nextuse(experts, n_experts, n_slots).reshape(-1, experts.shape[2]).sum(axis=1)
    assert np.array_equal(np.array(per_call), want)
    assert want.sum() > 0 and (want < experts.shape[2]).sum() > 0


def test_nextuse_weighs_the_layer_cycle_only_between_equal_rates():
    """Equal scores: the filled layer's other experts go first (needed next step), the next
    layer's last (needed within this step); a rate twice as high outweighs any layer."""
    p = _one_expert_per_layer(NextUsePolicy)
    p.set_layer(1)
    assert p.victim(np.zeros(3, bool)) == 1  # layer 1's other expert: the next step
    assert p.victim(np.array([False, True, False])) == 0  # layer 0: 2 layers ahead
    p.set_layer(2)
    assert p.victim(np.array([False, False, True])) == 1  # layer 1 is 2 ahead, 0 is 1
    p.touch(2)  # layer 2's expert now scores 2: its wait halves, more than a layer's worth
    p.set_layer(0)
    assert p.victim(np.array([True, False, False])) == 1  # 1 ahead but scores 1
    assert p.victim(np.ones(3, bool)) == -1


def test_nextuse_counts_the_layer_cycle_in_tokens_of_the_last_step():
    """Waits are in tokens, so the layer term is too: a forward step of 4 tokens (a batch,
    a prefill) makes the filled layer's other experts 4 tokens away, the next layer's 2
    (of 2 layers); a decode step after it, 1 and 0.5 again."""
    p = NextUsePolicy(2, 8)
    p.set_layout(2, 4)
    assert p._ahead.tolist() == [1.0, 0.5]
    p.set_token(3)  # the first step: tokens 0..3
    assert p._ahead.tolist() == [4.0, 2.0]
    p.set_token(4)
    assert p._ahead.tolist() == [1.0, 0.5]


def test_nextuse_has_no_overflow_for_a_long_unused_expert():
    p = NextUsePolicy(2, 8)
    p.set_layout(2, 4)
    p.set_token(0)
    p.filled(0, 0)
    p.touch(0)
    p.set_token(10**7)  # 3e5 half-lives later: its wait is past any float
    p.filled(1, 5)
    p.touch(1)
    with np.errstate(all="raise"):
        assert p.victim(np.zeros(2, bool)) == 0


def test_nextuse_half_life_grows_from_its_start_to_decays():
    p = NextUsePolicy(2, 8)
    assert p.half_life_at(0) == START_HALF_LIFE_TOKENS
    assert (
        p.half_life_at(int(WARMUP_TOKENS) // 2) == (START_HALF_LIFE_TOKENS + HALF_LIFE_TOKENS) / 2
    )
    assert p.half_life_at(int(WARMUP_TOKENS)) == p.half_life_at(10**6) == HALF_LIFE_TOKENS
    # A use's weight halves over the half-life of the moment: 4 tokens at the start.
    p.set_layout(2, 4)
    p.set_token(0)
    p.filled(0, 0)
    p.touch(0)
    lv0 = p.lv[0]
    for t in range(1, 5):
        p.set_token(t)
    assert (
        abs((p._now - lv0) - math.log(2.0) * sum(1 / p.half_life_at(t) for t in range(1, 5)))
        < 1e-12
    )
