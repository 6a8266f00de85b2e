"""The batch scheduler (czyx serve's step) on hybrid models (Qwen3-Next, Jamba).

Each sequence carries its linear layers' recurrent state in its own cache:
sequences batched together get what each gets alone, a saved sequence resumes
through ``history`` with its recurrent state, and the prompt-prefix cache (which
reuses KV at chunk boundaries, where no recurrent state was kept) is skipped.
"""

from __future__ import annotations

import pytest

from czyx.inference.batch import BatchOptions, Scheduler
from czyx.inference.engine import Engine
from czyx.inference.errors import RecurrentStateError
from czyx.inference.generate import generate_ids
from czyx.testing.refmodels import StateDictConsumer
from czyx.testing.tiny_models import build_tiny_model

PROMPTS = [[3, 17, 5, 60, 1, 88, 42, 9, 11, 2, 40], [7, 7, 30], [50, 4, 19, 23, 8, 61, 2]]


@pytest.fixture(scope="module", params=["qwen3_next", "jamba"])
def engine(request):
    eng = Engine(StateDictConsumer(build_tiny_model(request.param, 1, initializer_range=0.2)))
    yield eng
    eng.close()


def test_hybrid_sequences_batched_equal_alone_and_the_engine(engine):
    opts = BatchOptions(max_batch=3, prefill_chunk=4, prefix_cache_bytes=2**24)
    sched = Scheduler(engine.model, opts)
    try:
        solo = [sched.submit(p, 8).result(timeout=120) for p in PROMPTS]
        handles = [sched.submit(p, 8) for p in PROMPTS]
        together = [h.result(timeout=120) for h in handles]
        st = sched.stats()
    finally:
        sched.close()
    assert [t for t, _ in together] == [t for t, _ in solo]
    # No prefix reuse: a hybrid cache's state exists at its end only.
    assert all(d.reused == 0 for _, d in together) and st.prefix_entries == 0
    for p, (toks, _) in zip(PROMPTS, solo, strict=True):
        assert toks == generate_ids(engine, list(p), 8)[0]  # the engine's own greedy tokens


def test_hybrid_history_resumes_its_recurrent_state(engine):
    sched = Scheduler(engine.model, BatchOptions(max_batch=2, prefill_chunk=4))
    try:
        _toks, done = sched.submit(PROMPTS[0], 5, keep_state=True).result(timeout=120)
        final = done.final
        assert final is not None and final.kv.length == len(final.tokens)
        assert final.kv.recurrent_nbytes() > 0 and any(a.any() for a in final.kv.recurrent_arrays())
        more, done2 = sched.submit([9, 8], 6, history=(final.tokens, final.kv)).result(timeout=120)
        assert done2.restored == len(final.tokens)
        plain, _ = sched.submit([*final.tokens, 9, 8], 6).result(timeout=120)
    finally:
        sched.close()
    assert more == plain
    with pytest.raises(RecurrentStateError, match="whole"):
        engine.model.new_kv().copy_from(final.kv, 3)
