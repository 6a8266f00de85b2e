"""Continuous batching (inference.batch): results independent of the batch, on the bundled model.

Each sequence's logits in a step shared with others must be bit-identical to the
same sequence stepped alone, and its greedy tokens identical; the batched step
must match the single-sequence engine to float32 rounding; the scheduler's queue,
KV budget and cancellation fail closed and free what they hold.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from czyx.inference.batch import (
    BatchOptions,
    Done,
    QueueFull,
    RequestTooLarge,
    Scheduler,
    _acquire_parts,
    _copy_kv,
    forward_batch,
)
from czyx.inference.engine import Engine
from czyx.inference.generate import generate_ids

PROMPTS = [
    b"def main(argv):\n    ",
    b"import os\nimport sys\n",
    b"class Parser:\n    def __init__(self",
    b"    return ",
    b"# Copyright",
    b"for i in range(",
    b"if __name__ == ",
    b"raise ValueError(",
]


@pytest.fixture(scope="module")
def engine(bundled_consumer):
    eng = Engine(bundled_consumer, stream=None)
    yield eng
    eng.close()


def _solo_logits(model, prompt: bytes) -> list[np.ndarray]:
    kv = model.new_kv()
    out = forward_batch(model, [np.frombuffer(prompt, np.uint8)], [kv])
    toks = []
    for _ in range(4):
        toks.append(int(np.argmax(out[-1])))
        out.append(forward_batch(model, [np.array(toks[-1:])], [kv])[0])
    return out


@pytest.mark.parametrize("bad", [-1, -(2**62), 256, 2**40])
def test_a_token_outside_the_vocabulary_is_refused_before_anything_runs(engine, bad):
    model = engine.model
    kvs = [model.new_kv(), model.new_kv()]
    forward_batch(model, [np.array([1, 2, 3]), np.array([4])], kvs)
    for chunks in ([np.array([5, bad])], [np.array([5]), np.array([bad, 6])]):
        with pytest.raises(ValueError, match="out of range"):
            forward_batch(model, chunks, kvs[: len(chunks)])
        assert [kv.length for kv in kvs] == [3, 1]


def test_a_step_shared_with_others_is_bit_identical_to_the_sequence_alone(engine):
    model = engine.model
    alone = [_solo_logits(model, p) for p in PROMPTS[:5]]
    kvs = [model.new_kv() for _ in range(5)]
    # Step 1: every prompt whole; then greedy decode tokens together, with a late joiner.
    got = [
        [lg]
        for lg in forward_batch(model, [np.frombuffer(p, np.uint8) for p in PROMPTS[:4]], kvs[:4])
    ]
    for step in range(4):
        chunks = [np.array([int(np.argmax(g[-1]))]) for g in got[:4]]
        seqs = list(kvs[:4])
        if step == 1:  # a fifth sequence's prompt joins a decode step
            chunks.append(np.frombuffer(PROMPTS[4], np.uint8))
            seqs.append(kvs[4])
            got.append([])
        elif step > 1:
            chunks.append(np.array([int(np.argmax(got[4][-1]))]))
            seqs.append(kvs[4])
        for g, lg in zip(got, forward_batch(model, chunks, seqs), strict=False):
            g.append(lg)
    for s in range(4):
        for a, b in zip(alone[s], got[s], strict=True):
            assert np.array_equal(a, b)
    for a, b in zip(alone[4][:3], got[4], strict=False):
        assert np.array_equal(a, b)


def test_batched_step_matches_the_single_sequence_engine(engine):
    model = engine.model
    prompt = list(PROMPTS[2])
    kv = model.new_kv()
    got = forward_batch(model, [np.array(prompt)], [kv])[0]
    engine.reset()
    want = engine.prefill(prompt)
    assert np.abs(got - want).max() <= 1e-4 * float(want.max() - want.min())
    ref, _ = generate_ids(engine, prompt, 12)
    sched = Scheduler(model, BatchOptions(max_batch=4, prefill_chunk=8))
    try:
        toks, done = sched.submit(prompt, 12).result(timeout=60)
    finally:
        sched.close()
    assert toks == ref and done.reason == "length" and done.completion_tokens == 12


@pytest.mark.parametrize("c_decode", [True, False])
def test_scheduler_eight_concurrent_equal_solo(engine, c_decode):
    opts = BatchOptions(max_batch=8, prefill_chunk=8, step_tokens=40, c_decode=c_decode)
    sched = Scheduler(engine.model, opts)
    try:
        solo = [sched.submit(list(p), 10).result(timeout=60)[0] for p in PROMPTS]
        handles = [sched.submit(list(p), 10) for p in PROMPTS]
        together = [h.result(timeout=120)[0] for h in handles]
        st = sched.stats()
    finally:
        sched.close()
    assert together == solo
    assert st.active == 0 and st.kv_used == 0
    # The batch really formed: fewer steps than one per token per sequence.
    assert st.steps < st.generated


def test_queue_full_kv_budget_and_cancel_free_their_sequences(engine):
    cfg = engine.model.cfg
    kv_tok = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4
    opts = BatchOptions(max_batch=1, max_queue=1, prefill_chunk=8, kv_bytes=200 * kv_tok)
    sched = Scheduler(engine.model, opts)
    try:
        with pytest.raises(RequestTooLarge):
            sched.submit([1, 2, 3], 300)
        long = sched.submit(list(PROMPTS[0]), 150)
        next(long.events(timeout=60))  # its first token: it is active, the queue is empty
        waiting = sched.submit(list(PROMPTS[1]), 150)
        with pytest.raises(QueueFull):
            sched.submit(list(PROMPTS[2]), 4)
        long.cancel()
        waiting.cancel()
        for h in (long, waiting):
            last = list(h.events(timeout=60))[-1]
            assert isinstance(last, Done) and last.reason == "cancelled"
        toks, done = sched.submit(list(PROMPTS[2]), 4).result(timeout=60)
        assert len(toks) == 4 and done.reason == "length"
        st = sched.stats()
        assert st.active == 0 and st.waiting == 0 and st.kv_used == 0
    finally:
        sched.close()


def test_prefix_reuse_starts_from_cached_chunks_and_changes_nothing(engine):
    base = b"import os\nimport sys\nimport json\nimport time\n"  # 44 tokens
    a, b = base + b"def f(x):\n", base + b"class A:\n"
    plain = Scheduler(engine.model, BatchOptions(prefill_chunk=8))
    try:
        want = [plain.submit(list(p), 10).result(timeout=60)[0] for p in (a, b, a)]
    finally:
        plain.close()
    sched = Scheduler(engine.model, BatchOptions(prefill_chunk=8, prefix_cache_bytes=2**24))
    try:
        got, reused = [], []
        for p in (a, b, a):
            toks, done = sched.submit(list(p), 10).result(timeout=60)
            got.append(toks)
            reused.append(done.reused)
        st = sched.stats()
    finally:
        sched.close()
    assert got == want
    # b shares 44 tokens with a: five whole chunks; a again: all its whole chunks but
    # the one holding its last token (whose logits give the first sample).
    assert reused == [0, 40, (len(a) - 1) // 8 * 8]
    assert st.prefix_hits == 2 and st.prefix_tokens == sum(reused)


def test_tiered_streaming_batch_equals_resident(engine):
    """At a quarter of the expert bytes, streamed with look-ahead prefetch, a batch of
    sequences generates what the fully resident batch generates (the slot a weight comes
    from never changes a product)."""
    from czyx.inference.streaming import StreamOptions

    opts = BatchOptions(max_batch=4, prefill_chunk=8)
    resident = Scheduler(engine.model, opts)
    try:
        want = [
            h.result(timeout=120)[0] for h in [resident.submit(list(p), 12) for p in PROMPTS[:4]]
        ]
    finally:
        resident.close()
    small = Engine(engine.consumer, cache_fraction=0.25, stream=StreamOptions(prefetch=True))
    sched = Scheduler(small.model, opts)
    try:
        got = [h.result(timeout=120)[0] for h in [sched.submit(list(p), 12) for p in PROMPTS[:4]]]
        misses = small.stats().misses
    finally:
        sched.close()
        small.close()
    assert got == want and misses > 0


def _copy(model, kv):
    out = model.new_kv(kv.capacity)
    _copy_kv(out, kv, kv.length)  # the scheduler's own copy (sessions, prefix reuse)
    return out


@pytest.mark.parametrize("fraction", [None, 0.1])
def test_decode_tokens_are_the_engines_own_decode(engine, fraction):
    """A batch's decode tokens take the engine's C decode: each token's logits are exactly
    what Engine.decode (MoEDecoder.forward of one token) gives for it, with every expert
    resident and at a tenth of the expert bytes, where a layer's experts for the step
    exceed the slots and are acquired in parts, each expert once per step."""
    from czyx.inference.options import BATCHED_OPTIONS

    eng = engine
    if fraction is not None:
        eng = Engine(engine.consumer, cache_fraction=fraction, options=BATCHED_OPTIONS)
    model = eng.model
    try:
        assert model.decode_in_c()
        calls = []
        acquire = model.experts.acquire_streamed
        model.experts.acquire_streamed = lambda i, e: calls.append((i, list(e))) or acquire(i, e)
        kvs = [model.new_kv() for _ in PROMPTS]
        first = forward_batch(model, [np.frombuffer(p, np.uint8) for p in PROMPTS], kvs)
        toks = [int(np.argmax(lg)) for lg in first]
        for _ in range(3):
            want = [model.forward(np.array([t]), _copy(model, kv)) for t, kv in zip(toks, kvs)]
            calls.clear()
            got = forward_batch(model, [np.array([t]) for t in toks], kvs)
            groups = len(calls)
            for a, b in zip(want, got, strict=True):
                assert np.array_equal(a, b)
            toks = [int(np.argmax(lg)) for lg in got]
            for layer in range(model.cfg.n_layers):  # each expert acquired once per step
                held = [e for i, es in calls if i == layer for e in es]
                assert len(held) == len(set(held)) > 0
        n_layers = model.cfg.n_layers
        assert groups == n_layers if fraction is None else groups > n_layers
        if fraction is not None:
            assert eng.stats().misses > 0
    finally:
        model.experts.__dict__.pop("acquire_streamed", None)
        if eng is not engine:
            eng.close()


@pytest.mark.parametrize("reverse", [False, True])
def test_a_streamed_step_computes_each_read_as_it_lands_bit_for_bit(engine, reverse):
    """At a quarter of the expert bytes a step's reads are waited for one by one, the
    resident experts computed first (the one-token decode's pipeline, in the batched
    step): every row of a verified chunk and of a decode token beside it is the resident
    step's bit for bit, also when the reads are taken in the opposite order."""
    from czyx.inference.streaming import StreamOptions

    def run(model):
        kvs = [model.new_kv(), model.new_kv()]
        forward_batch(model, [np.frombuffer(p, np.uint8) for p in PROMPTS[:2]], kvs)
        chunks = [np.frombuffer(b"def f(x):\n", np.uint8), np.array([7])]
        return forward_batch(model, chunks, kvs, all_logits=[True, False])

    want = run(engine.model)
    small = Engine(engine.consumer, cache_fraction=0.25, stream=StreamOptions(prefetch=False))
    cache = small.model.experts
    acquire, wait = cache.acquire_streamed, cache.wait_ready
    pending_sizes, waited = [], []

    def acquire_streamed(layer, experts):
        slots, pending = acquire(layer, experts)
        pending_sizes.append(len(pending))
        return slots, pending[::-1] if reverse else pending

    cache.acquire_streamed = acquire_streamed
    cache.wait_ready = lambda j: waited.append(j) or wait(j)
    try:
        got = run(small.model)
    finally:
        small.close()
    assert max(pending_sizes) >= 2 and len(waited) == sum(pending_sizes)
    assert all(np.array_equal(a, b) for a, b in zip(want, got, strict=True))


@given(
    size=hs.integers(1, 40),
    resident=hs.integers(0, 40),
    cap=hs.integers(1, 48),
    top_k=hs.integers(1, 8),
)
@settings(max_examples=300, deadline=None)
def test_acquire_parts_keep_hits_apart_and_misses_a_token_at_a_time(size, resident, cap, top_k):
    """For every union: the parts cover it in order and none exceeds the cache; it is one
    acquire exactly when its misses are at most a token's top-k and it fits the cache, and
    otherwise no part mixes a resident expert with a miss, the misses a top-k at a time."""
    r = min(resident, size)
    held = np.arange(size, dtype=np.int64)
    table = np.full(size, -1, np.int32)
    table[:r] = np.arange(r)
    cuts = _acquire_parts(held, table, cap, top_k)
    assert cuts[0] == 0 and cuts[-1] == size
    parts = list(itertools.pairwise(cuts))
    assert all(0 < b - a <= cap for a, b in parts)
    assert (len(parts) == 1) == (size - r <= top_k and size <= cap)
    if len(parts) > 1:
        assert all(b <= r or a >= r for a, b in parts)
        assert all(b - a <= min(top_k, cap) for a, b in parts if a >= r)
