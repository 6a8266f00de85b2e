"""A driven scheduler (inference.batch.Scheduler(driven=True)): no thread of its own, its
owner calls ``step_once``. Its outputs equal the threaded scheduler's, a long prompt's
prefill chunks share steps with another sequence's decode tokens, cancel and close free
what they hold, and ``on_wake`` says when there may be work."""

from __future__ import annotations

import threading

import pytest

from czyx.inference.batch import (
    BatchOptions,
    Done,
    Scheduler,
    SchedulerClosed,
    Token,
)
from czyx.inference.engine import Engine
from czyx.inference.options import EngineOptions
from czyx.inference.sampling import SamplingParams

PROMPTS = [
    b"def main(argv):\n    ",
    b"import os\nimport sys\n",
    b"class Parser:\n    def __init__(self",
    b"    return ",
    b"# Copyright",
    b"for i in range(",
]
#: Bounds every drive loop of these tests (each step does work, so this is never reached).
MAX_STEPS = 10_000


@pytest.fixture(scope="module")
def engine(bundled_consumer):
    eng = Engine(bundled_consumer, options=EngineOptions(stream=None))
    yield eng
    eng.close()


def _drive(sched: Scheduler) -> int:
    """Step until there is no work; returns the steps run."""
    for n in range(MAX_STEPS):
        if not sched.step_once():
            return n
    raise AssertionError(f"still working after {MAX_STEPS} steps")


def _requests():
    """(prompt, max_tokens, sampling): greedy and seeded, different lengths."""
    out = []
    for i, p in enumerate(PROMPTS):
        sp = (
            SamplingParams(temperature=0.0)
            if i % 2
            else SamplingParams(temperature=0.8, top_p=0.9, seed=i)
        )
        out.append((list(p), 6 + 3 * i, sp))
    return out


def _tokens(handle) -> tuple[list[int], Done]:
    return handle.result(timeout=60)


def test_driven_outputs_equal_the_threaded_scheduler(engine):
    opts = BatchOptions(max_batch=4, prefill_chunk=8, step_tokens=24)
    threaded = Scheduler(engine.model, opts)
    try:
        hs = [threaded.submit(p, n, sp) for p, n, sp in _requests()]
        want = [_tokens(h) for h in hs]
    finally:
        threaded.close()
    before = {t.ident for t in threading.enumerate()}
    driven = Scheduler(engine.model, opts, driven=True)
    try:
        assert {t.ident for t in threading.enumerate()} == before  # no thread of its own
        hs = [driven.submit(p, n, sp) for p, n, sp in _requests()]
        steps = _drive(driven)
        got = [_tokens(h) for h in hs]
        st = driven.stats()
    finally:
        driven.close()
    assert [t for t, _ in got] == [t for t, _ in want]
    assert [(d.reason, d.completion_tokens) for _, d in got] == [
        (d.reason, d.completion_tokens) for _, d in want
    ]
    assert steps == st.steps and st.active == st.waiting == st.kv_used == 0
    assert st.steps < st.generated  # more than 4 sequences shared steps


def test_events_come_on_the_driving_thread_inside_step_once(engine):
    driven = Scheduler(engine.model, BatchOptions(prefill_chunk=8), driven=True)
    seen: list[tuple[object, int]] = []
    try:
        h = driven.submit(
            list(PROMPTS[0]), 3, on_event=lambda ev: seen.append((ev, threading.get_ident()))
        )
        assert seen == []  # nothing runs until the owner steps
        _drive(driven)
    finally:
        driven.close()
    assert {tid for _, tid in seen} == {threading.get_ident()}
    assert [type(ev) for ev, _ in seen] == [Token, Token, Token, Done]
    assert _tokens(h)[1].reason == "length"


def test_a_long_prefill_shares_steps_with_a_decoding_sequence(engine):
    chunk = 8
    driven = Scheduler(engine.model, BatchOptions(prefill_chunk=chunk, step_tokens=64), driven=True)
    steps: list[list[tuple[int, int]]] = []  # per step: (request id, chunk length)
    step = driven._step

    def recorded(work):
        steps.append([(s.handle.id, int(c.size)) for s, c in work])
        return step(work)

    driven._step = recorded
    try:
        a = driven.submit(list(PROMPTS[1]), 40)
        for _ in range(4):  # A's prompt, then decoding
            assert driven.step_once()
        long_prompt = list((PROMPTS[2] * 8)[: 6 * chunk])
        b = driven.submit(long_prompt, 2)
        _drive(driven)
        (ta, da), (tb, db) = _tokens(a), _tokens(b)
    finally:
        driven.close()
    assert da.reason == "length" and len(ta) == 40 and db.reason == "length"
    b_steps = [s for s in steps if any(rid == b.id and n > 1 for rid, n in s)]
    # One chunk of B's prompt per step, each beside A's decode token: A never waited.
    assert len(b_steps) == 6
    assert all((a.id, 1) in s and (b.id, chunk) in s for s in b_steps)
    # Sharing the steps changed nothing for B: its tokens equal B's alone.
    alone = Scheduler(engine.model, BatchOptions(prefill_chunk=chunk), driven=True)
    try:
        hb = alone.submit(long_prompt, 2)
        _drive(alone)
    finally:
        alone.close()
    assert _tokens(hb)[0] == tb


def test_on_wake_cancel_and_close(engine):
    wakes: list[str] = []
    driven = Scheduler(
        engine.model,
        BatchOptions(prefill_chunk=8),
        driven=True,
        on_wake=lambda: wakes.append("wake"),
    )
    assert not driven.step_once()  # idle: no work
    h = driven.submit(list(PROMPTS[0]), 100)
    assert wakes == ["wake"]
    for _ in range(5):  # its prompt (3 chunks), then decode tokens
        assert driven.step_once()
    assert driven.stats().active == 1
    h.cancel()
    assert wakes == ["wake", "wake"]
    assert not driven.step_once()  # reaped before planning: nothing left to step
    st = driven.stats()
    assert st.active == 0 and st.kv_used == 0
    toks, done = _tokens(h)
    assert done.reason == "cancelled" and 0 < len(toks) < 100
    pending = driven.submit(list(PROMPTS[1]), 10)
    driven.close()  # driven: ends every pending request now, on this thread
    assert driven.closed and wakes[-1] == "wake"
    assert _tokens(pending)[1].reason == "cancelled"
    assert not driven.step_once()
    with pytest.raises(SchedulerClosed):
        driven.submit(list(PROMPTS[1]), 10)


def test_a_sampler_that_fails_ends_its_sequence_alone(engine, monkeypatch):
    """An error choosing one sequence's token (a sampler raising) ends that sequence with
    the error and frees its KV; the others in its steps go on to their own tokens."""
    import czyx.inference.batch as batch
    from czyx.inference.sampling import Sampler

    class Failing(Sampler):
        def __call__(self, logits):
            if self.params.seed == 666 and self.calls == 2:
                raise ValueError("probabilities do not sum to 1")
            self.calls += 1
            return super().__call__(logits)

    def make(params):
        s = Failing(params)
        s.calls = 0
        return s

    opts = BatchOptions(max_batch=4, prefill_chunk=8)
    reqs = [(list(PROMPTS[i]), 8, SamplingParams(temperature=0.0)) for i in range(3)]
    alone = Scheduler(engine.model, opts, driven=True)
    try:
        hs = [alone.submit(p, n, sp) for p, n, sp in reqs]
        _drive(alone)
        want = [_tokens(h) for h in hs]
    finally:
        alone.close()
    monkeypatch.setattr(batch, "Sampler", make)
    driven = Scheduler(engine.model, opts, driven=True)
    try:
        hs = [driven.submit(p, n, sp) for p, n, sp in reqs]
        bad = driven.submit(list(PROMPTS[3]), 8, SamplingParams(temperature=0.5, seed=666))
        _drive(driven)
        got = [_tokens(h) for h in hs]
        toks, done = _tokens(bad)
        st = driven.stats()
    finally:
        driven.close()
    assert done.reason == "error" and "ValueError: probabilities" in done.error
    assert len(toks) == 2
    assert [t for t, _ in got] == [t for t, _ in want]
    assert [d.reason for _, d in got] == ["length"] * 3
    assert st.active == st.waiting == st.kv_used == 0


def _failed_step_then_one_more(engine, driven: bool, error: str) -> None:
    """Two requests whose step fails: both end with ``error`` (KV freed); a third request
    after them is served as usual."""
    sched = Scheduler(engine.model, BatchOptions(max_batch=4, prefill_chunk=8), driven=driven)
    try:
        hs = [sched.submit(list(p), 8, SamplingParams()) for p in PROMPTS[:2]]
        if driven:
            _drive(sched)
        dones = [_tokens(h)[1] for h in hs]
        after = sched.submit(list(PROMPTS[2]), 4, SamplingParams())
        if driven:
            _drive(sched)
        toks, done = _tokens(after)
        st = sched.stats()
    finally:
        sched.close()
    assert [d.reason for d in dones] == ["error", "error"]
    assert all(error in d.error for d in dones)
    assert done.reason == "length" and len(toks) == 4
    assert st.active == st.waiting == st.kv_used == 0


@pytest.mark.parametrize("driven", [False, True], ids=["threaded", "driven"])
def test_a_failing_step_ends_its_sequences_and_the_scheduler_goes_on(engine, monkeypatch, driven):
    """A bug past the forward (here: making the third token event raises) ends the step's
    sequences with the error, none left waiting; the next request is served as usual."""
    import czyx.inference.batch as batch

    made = []

    class Boom(Token):
        def __init__(self, *args):
            made.append(args)
            if len(made) == 3:
                raise RuntimeError("boom")
            super().__init__(*args)

    monkeypatch.setattr(batch, "Token", Boom)
    _failed_step_then_one_more(engine, driven, "RuntimeError: boom")


def test_a_failing_forward_ends_its_steps_sequences(engine, monkeypatch):
    """A forward that fails (a read failing its checksum, say) ends every sequence of its
    step with the error, KV freed; the next request is served as usual."""
    import czyx.inference.batch as batch
    from czyx.store import ChecksumError

    real, calls = batch.forward_batch, []

    def forward(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise ChecksumError("expert (1, 2): checksum mismatch")
        return real(*args, **kw)

    monkeypatch.setattr(batch, "forward_batch", forward)
    _failed_step_then_one_more(engine, True, "ChecksumError: expert (1, 2)")
