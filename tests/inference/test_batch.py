"""Continuous batching (inference.batch): results independent of the batch, on the bundled model.

Each sequence's logits in a step shared with others must be bit-identical to the
same sequence stepped alone, and its greedy tokens identical; the batched step
must match the single-sequence engine to float32 rounding; the scheduler's queue,
KV budget and cancellation fail closed and free what they hold.
"""

from __future__ import annotations

import numpy as np
import pytest

from czyx.inference.assets import bundled_model_dir
from czyx.inference.batch import (
    BatchOptions,
    Done,
    QueueFull,
    RequestTooLarge,
    Scheduler,
    forward_batch,
)
from czyx.inference.engine import Engine
from czyx.inference.generate import generate_ids
from czyx.portals import open_consumer
from czyx.store import Store
from czyx.store.models.mount import mount

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
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    store = Store.open(root / "store")
    mount(store, bundled_model_dir(), "stdlib@1")
    consumer = open_consumer(store, None, "stdlib@1")
    eng = Engine(consumer, stream=None)
    yield eng
    eng.close()
    consumer.close()
    store.close()


def _solo_logits(model, prompt: bytes) -> list[np.ndarray]:
    kv = model.new_kv()
    out = forward_batch(model, [np.frombuffer(prompt, np.uint8)], [kv])
    toks = []
    for _ in range(4):
        toks.append(int(np.argmax(out[-1])))
        out.append(forward_batch(model, [np.array(toks[-1:])], [kv])[0])
    return out


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


def test_scheduler_eight_concurrent_equal_solo(engine):
    opts = BatchOptions(max_batch=8, prefill_chunk=8, step_tokens=40)
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
