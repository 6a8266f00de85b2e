"""Watching a batched generation's routing (inference.routewatch), on the bundled model.

A watched sequence's frames carry the routing the single-sequence engine computes for
the same tokens, whichever sequences share its steps (decoding or prefilling, the C
pass and the numpy pass); their hit / miss / prefetched states agree with the cache's
own counters; a sequence that does not watch receives no frame.
"""

from __future__ import annotations

import numpy as np
import pytest

from czyx.inference.batch import BatchOptions, Done, Scheduler, Token
from czyx.inference.engine import Engine
from czyx.inference.options import EngineOptions
from czyx.inference.routewatch import (
    RESIDENT_HIT,
    RESIDENT_MISS,
    RESIDENT_PREFETCHED,
    RouteFrame,
)

PROMPT = b"def main(argv):\n    "
OTHERS = [b"import os\nimport sys\n", b"class Parser:\n    def __init__(self", b"# Copyright"]
N = 8


@pytest.fixture(scope="module")
def engine(bundled_consumer):
    eng = Engine(bundled_consumer, options=EngineOptions(stream=False))
    yield eng
    eng.close()


class _Rows:
    """A route recorder keeping each layer's first row."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, np.ndarray]] = []

    def record(self, layer: int, idx: np.ndarray, w: np.ndarray) -> None:
        self.rows.append((layer, np.array(idx[0])))


def _engine_routes(engine: Engine, prompt: list[int], tokens: list[int]):
    """Per fed generated token, ``(layers, experts [L, k])`` as the engine's decode routes it."""
    engine.reset()
    engine.prefill(prompt)
    out = []
    for t in tokens:
        rec = engine.model.recorder = _Rows()
        try:
            engine.decode(t)
        finally:
            engine.model.recorder = None
        out.append((np.array([r[0] for r in rec.rows]), np.stack([r[1] for r in rec.rows])))
    return out


def _events(handle) -> tuple[list[int], list[RouteFrame], Done]:
    toks, frames = [], []
    for ev in handle.events(timeout=120):
        if isinstance(ev, Token):
            toks.append(ev.token)
        elif isinstance(ev, RouteFrame):
            assert ev.index == len(toks) - 1  # the frame of the token fed, before the next
            frames.append(ev)
        else:
            return toks, frames, ev
    raise AssertionError("no Done")


@pytest.mark.parametrize("c_decode", [True, False])
def test_frames_are_the_engines_routing_whatever_shares_the_step(engine, c_decode):
    opts = BatchOptions(max_batch=8, prefill_chunk=8, step_tokens=64, c_decode=c_decode)
    sched = Scheduler(engine.model, opts)
    try:
        others = [sched.submit(list(p), N + 4) for p in OTHERS[:2]]
        watched = sched.submit(list(PROMPT), N, watch=True)
        late = sched.submit(list(OTHERS[2]), N)  # its prompt prefills beside our decodes
        toks, frames, done = _events(watched)
        rest = [h.result(timeout=120) for h in (*others, late)]
        assert sched._watching == 0
    finally:
        sched.close()
    assert done.reason == "length" and len(toks) == N
    # One frame per fed token (the last token is never fed), in order.
    assert [f.index for f in frames] == list(range(N - 1))
    assert [f.token for f in frames] == toks[:-1]
    for toks_o, done_o in rest:  # the others ran to completion beside the watched one
        assert done_o.completion_tokens == len(toks_o)
    want = _engine_routes(engine, list(PROMPT), toks[:-1])
    cfg = engine.cfg
    for f, (layers, experts) in zip(frames, want, strict=True):
        assert np.array_equal(f.layers, layers)
        assert np.array_equal(f.experts, experts)
        assert f.experts.shape == (len(layers), cfg.top_k)
        assert f.resident.shape == (len(layers), cfg.n_experts)
        assert f.step_sequences >= 1 and f.step_tokens >= f.step_sequences


def test_states_agree_with_the_cache_and_nonwatchers_get_no_frame(engine):
    opts = EngineOptions(stream=True, prefetch=True)
    small = Engine(engine.consumer, cache_fraction=0.25, options=opts)
    sched = Scheduler(small.model, BatchOptions(max_batch=4, prefill_chunk=8))
    try:
        plain = sched.submit(list(OTHERS[0]), N)
        plain_events = list(plain.events(timeout=120))
        _, frames, _ = _events(sched.submit(list(PROMPT), 24, watch=True))
    finally:
        sched.close()
        small.close()
    assert all(isinstance(e, Token | Done) for e in plain_events)
    states = np.concatenate([f.state.ravel() for f in frames])
    assert set(states.tolist()) <= {RESIDENT_HIT, RESIDENT_PREFETCHED, RESIDENT_MISS}
    assert (states == RESIDENT_MISS).any()  # a quarter of the experts: some reads
    for f in frames:
        # Alone in its steps: the step's cache counters are this token's lookups.
        assert f.step_sequences == 1
        assert f.misses == int((f.state == RESIDENT_MISS).sum())
        assert f.hits == int((f.state != RESIDENT_MISS).sum())
        assert f.bytes_read >= f.misses * small.model.experts.slot_nbytes
        # A miss is an expert the cache did not hold; a hit one it held.
        held = np.take_along_axis(f.resident, f.experts, axis=1)
        assert np.array_equal(held, f.state != RESIDENT_MISS)
