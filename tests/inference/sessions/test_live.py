"""Resuming on a real (tiny) MoE engine: bit-identical continuation, prefix reuse, refusals."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from czyx.inference.engine import Engine
from czyx.inference.sampling import SamplingParams
from czyx.inference.sessions.errors import ModelVersionMismatchError
from czyx.inference.sessions.live import LiveSession, run_with_session
from czyx.inference.tokenizer import ByteTokenizer
from czyx.testing.refmodels import tiny_model
from tests.inference.sessions.helpers import (
    MODEL_A,
    MODEL_B,
    engine_factory,
    freeze_consumer,
    steps,
)

ROOT = Path(__file__).resolve().parents[3]
SAMPLED = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1234)


@pytest.fixture(scope="module")
def model():
    return tiny_model("olmoe", seed=2)


@pytest.fixture(scope="module")
def make(model):
    return engine_factory(model, MODEL_A)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(1, 256, n).tolist()


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_resume_is_bit_identical_to_a_run_that_never_stopped(make, sessions, sampling):
    a = LiveSession.start(make(), sampling, "alice")
    a.feed(_prompt(70))
    a.generate(9)
    sessions.save("chat", a.state())
    ref_toks, ref_logits = steps(a, 12)
    a.feed([5, 6, 7])  # a new user turn
    ref_toks2, ref_logits2 = steps(a, 6)

    b = LiveSession.resume(make(), sessions.read("chat", model=MODEL_A), "alice")
    assert b.reused == 79 and b.prefilled == 0
    toks, logits = steps(b, 12)
    b.feed([5, 6, 7])
    toks2, logits2 = steps(b, 6)
    assert toks == ref_toks and toks2 == ref_toks2
    assert all(np.array_equal(x, y) for x, y in zip(logits, ref_logits))
    assert all(np.array_equal(x, y) for x, y in zip(logits2, ref_logits2))
    if sampling.temperature:
        # The continuation is really sampled: a fresh RNG would have diverged.
        c = LiveSession.resume(make(), sessions.read("chat"), "alice", sampling=SAMPLED)
        assert steps(c, 12)[0] != ref_toks


def test_resume_on_a_tiered_engine_is_bit_identical(model, sessions):
    a = LiveSession.start(engine_factory(model)(), SAMPLED, "alice")
    a.feed(_prompt(40, 1))
    sessions.save("chat", a.state())
    ref = steps(a, 8)
    tiered = Engine(engine_factory(model)().consumer, cache_fraction=0.3)
    b = LiveSession.resume(tiered, sessions.read("chat"), "alice")
    got = steps(b, 8)
    assert tiered.stats().misses > tiered.stats().n_slots  # it really streamed experts
    assert got[0] == ref[0] and all(np.array_equal(x, y) for x, y in zip(got[1], ref[1]))


def test_resume_in_another_process(make, sessions, tmp_path):
    a = LiveSession.start(make(), SAMPLED, "alice")
    a.feed(_prompt(100, 2))
    a.generate(5)
    sessions.save("chat", a.state())
    ref_toks, ref_logits = steps(a, 10)
    out, frozen = tmp_path / "child.npz", tmp_path / "model.pkl"
    frozen.write_bytes(pickle.dumps(freeze_consumer(a.engine.consumer)))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="1")
    argv = [str(frozen), str(sessions.store.path), sessions.portal, "chat", "10", str(out)]
    r = subprocess.run(
        [sys.executable, "-m", "tests.inference.sessions._resume_child", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    got = np.load(out)
    assert got["tokens"].tolist() == ref_toks
    assert np.array_equal(got["logits"], np.stack(ref_logits))


def _counting(engine):
    """The token count of each prompt the engine runs from here on."""
    seen: list[int] = []
    orig = engine.prefill

    def prefill(tokens, all_logits=False):
        seen.append(len(tokens))
        return orig(tokens, all_logits)

    engine.prefill = prefill
    return seen


def test_prefix_reuse_skips_the_saved_prefix(make, sessions):
    a = LiveSession.start(make(), SamplingParams(), "alice")
    hist = _prompt(150, 3)
    a.feed(hist)
    a.generate(10)
    sessions.save("chat", a.state())
    saved = list(a.tokens)
    extra = [(saved[150] + 1) % 256 or 1, 9, 8, 7]
    prompt = saved[:150] + extra

    eng = make()
    seen = _counting(eng)
    c = LiveSession.from_prompt(eng, sessions, prompt, SamplingParams())
    assert c.reused == 150 and c.prefilled == 4 and seen == [4]
    # Bit-exact against the original cache cut at 150 and fed the same suffix ...
    a.engine.kv.truncate(150)
    want = a.engine.prefill(extra)
    assert np.array_equal(c.logits, want)
    # ... and, to float32 rounding, a fresh prefill of the whole prompt.
    fresh = LiveSession.start(make(), SamplingParams(), "alice")
    np.testing.assert_allclose(c.logits, fresh.feed(prompt), rtol=1e-4, atol=1e-4)


def test_prefix_reuse_edge_cases(make, sessions):
    a = LiveSession.start(make(), SamplingParams(), "alice")
    a.feed(_prompt(130, 4))
    sessions.save("chat", a.state())
    hist = list(a.tokens)
    # The whole saved history: nothing to prefill, the saved logits are used.
    eng = make()
    seen = _counting(eng)
    c = LiveSession.from_prompt(eng, sessions, hist, SamplingParams())
    assert (c.reused, c.prefilled, seen) == (130, 0, [])
    assert np.array_equal(c.logits, a.logits)
    # A strict prefix: its last token is prefilled to get its logits.
    c = LiveSession.from_prompt(make(), sessions, hist[:100], SamplingParams())
    assert (c.reused, c.prefilled) == (99, 1)
    # Shorter than a block, or another model version: no reuse.
    c = LiveSession.from_prompt(make(), sessions, hist[:40], SamplingParams())
    assert (c.reused, c.prefilled) == (0, 40)
    other = Engine(freeze_consumer(a.engine.consumer, MODEL_B))
    c = LiveSession.from_prompt(other, sessions, hist, SamplingParams())
    assert (c.reused, c.prefilled) == (0, 130)


def test_resume_refuses_another_model_version(model, sessions):
    a = LiveSession.start(engine_factory(model)(), SamplingParams(), "alice")
    a.feed(_prompt(20, 5))
    sessions.save("chat", a.state())
    with pytest.raises(ModelVersionMismatchError, match="model version"):
        sessions.read("chat", model=MODEL_B)
    parsed = sessions.read("chat")
    with pytest.raises(ModelVersionMismatchError, match="model version"):
        LiveSession.resume(engine_factory(model, MODEL_B)(), parsed, "alice")
    wider = engine_factory(tiny_model("olmoe", seed=2, num_key_value_heads=4), MODEL_A)()
    with pytest.raises(ModelVersionMismatchError, match="KV shape"):
        LiveSession.resume(wider, parsed, "alice")


def test_run_with_session_continues_exactly(make, sessions):
    tok = ByteTokenizer()
    hello = "hello there, " * 6
    first = run_with_session(make(), tok, sessions, "talk", hello, 8, SAMPLED)
    assert not first.resumed and first.info.version == 1 and len(first.tokens) == 8
    second = run_with_session(make(), tok, sessions, "talk", " and more", 8)
    assert second.resumed and second.reused == first.info.length and second.info.version == 2
    assert second.prefilled == len(tok.encode(" and more"))
    ref = LiveSession.start(make(), SAMPLED, "alice")
    ref.feed(tok.encode(hello))
    assert ref.generate(8) == first.tokens
    ref.feed(tok.encode(" and more"))
    assert ref.generate(8) == second.tokens
    assert sessions.tokens("talk").tolist() == ref.tokens
    # A new session whose prompt extends a saved history reuses that history.
    n = len(tok.encode(hello))
    third = run_with_session(make(), tok, sessions, "talk2", hello + "\x01", 2)
    assert not third.resumed and third.reused == n and third.prefilled == 1
