"""Sessions on hybrid models (Qwen3-Next, Jamba): the recurrent state saved, resumed, forked.

The goal tested exactly: a saved state resumes with zero reprocessing (no
token runs through the model on resume) and the continuation's logits are
bit-identical to a run that never stopped. Format 2 (the recurrent section)
round-trips bit for bit; a state without one is still written as format 1.
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from czyx.inference.sampling import SamplingParams
from czyx.inference.sessions.errors import ModelVersionMismatchError, RecurrentCutError
from czyx.inference.sessions.format import (
    FORMAT_RECURRENT,
    FORMAT_VERSION,
    HEADER,
    ParsedExtent,
    encode,
)
from czyx.inference.sessions.live import LiveSession
from czyx.inference.sessions.store import RECORD_KEY
from czyx.testing.tiny_models import build_tiny_model
from tests.inference.sessions.helpers import (
    MODEL_A,
    engine_factory,
    random_state,
    steps,
)

SAMPLED = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=77)


@pytest.fixture(scope="module", params=["qwen3_next", "jamba"])
def make(request):
    return engine_factory(build_tiny_model(request.param, 3, initializer_range=0.2), MODEL_A)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 96, n).tolist()


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_hybrid_resume_reprocesses_nothing_and_is_bit_identical(make, sessions, sampling):
    a = LiveSession.start(make(), sampling, "alice")
    a.feed(_prompt(70))
    a.generate(5)
    info = sessions.save("chat", a.state())
    ref_toks, ref_logits = steps(a, 10)
    a.feed([5, 6, 7])  # a new user turn
    ref_toks2, ref_logits2 = steps(a, 4)

    rec = sessions.store.get(sessions.store.resolve_tag(f"session:chat@{info.version:08d}"),
                             RECORD_KEY)  # fmt: skip
    assert rec["format"] == FORMAT_RECURRENT and rec["rec_len"] > 0
    engine = make()
    routed_before = int(engine.model.route_counts.sum())
    b = LiveSession.resume(engine, sessions.read("chat", model=MODEL_A), "alice")
    # Zero reprocessing: nothing was prefilled and no token went through a layer.
    assert b.reused == 75 and b.prefilled == 0 and engine.kv.length == 75
    assert int(engine.model.route_counts.sum()) == routed_before
    toks, logits = steps(b, 10)
    b.feed([5, 6, 7])
    toks2, logits2 = steps(b, 4)
    assert toks == ref_toks and toks2 == ref_toks2
    assert all(np.array_equal(x, y) for x, y in zip(logits, ref_logits, strict=True))
    assert all(np.array_equal(x, y) for x, y in zip(logits2, ref_logits2, strict=True))


def test_hybrid_fork_is_whole_and_a_cut_is_refused(make, sessions):
    a = LiveSession.start(make(), SamplingParams(), "alice")
    a.feed(_prompt(40, 1))
    a.generate(3)
    sessions.save("chat", a.state())
    ref = steps(a, 6)
    sessions.fork("chat", "branch")  # at the full length: the parent's own state
    b = LiveSession.resume(make(), sessions.read("branch", model=MODEL_A), "alice")
    got = steps(b, 6)
    assert got[0] == ref[0] and all(np.array_equal(x, y) for x, y in zip(got[1], ref[1]))
    with pytest.raises(RecurrentCutError, match="43 positions"):
        sessions.fork("chat", "cut", at=20)
    assert sessions.versions("cut") == []
    parsed = sessions.read("chat", model=MODEL_A)
    with pytest.raises(RecurrentCutError):
        LiveSession.resume(make(), parsed, "alice", rows=20)


def test_hybrid_prefix_reuse_takes_the_whole_state_or_recomputes(make, sessions):
    a = LiveSession.start(make(), SamplingParams(), "alice")
    hist = _prompt(80, 2)
    a.feed(hist)
    a.generate(4)
    sessions.save("chat", a.state())
    longer = [*a.tokens, 9, 8]
    want = a.feed([9, 8]).copy()
    b = LiveSession.from_prompt(make(), sessions, longer, SamplingParams())
    assert b.reused == 84 and b.prefilled == 2
    assert np.array_equal(b.logits, want)
    # A prompt that shares only part of the history cannot use its recurrent state.
    c = LiveSession.from_prompt(make(), sessions, [*hist[:70], 1, 2], SamplingParams())
    assert c.reused == 0 and c.prefilled == 72


def test_a_hybrid_state_needs_a_hybrid_engine(sessions):
    from czyx.testing.refmodels import tiny_model

    st = random_state(np.random.default_rng(3), n_layers=2, n_kv=2, hd=16)
    sessions.save("plain", st)
    hybrid = engine_factory(build_tiny_model("qwen3_next", 0), MODEL_A)()
    with pytest.raises(ModelVersionMismatchError):
        LiveSession.resume(hybrid, sessions.read("plain"), "alice")
    plain = engine_factory(tiny_model("qwen3_moe", seed=1), MODEL_A)()
    a = LiveSession.start(hybrid, SamplingParams(), "alice")
    a.feed(_prompt(10))
    sessions.save("hy", a.state())
    with pytest.raises(ModelVersionMismatchError):
        LiveSession.resume(plain, sessions.read("hy"), "alice")


def test_format_2_round_trips_and_format_1_is_unchanged() -> None:
    rng = np.random.default_rng(4)
    plain = random_state(rng, length=70)
    enc1 = encode(plain)
    assert HEADER.unpack_from(enc1.payload, 0)[1] == FORMAT_VERSION
    meta = msgpack.unpackb(bytes(enc1.payload[128 : 128 + enc1.layout.meta_len]), raw=False)
    assert "recurrent" not in meta and enc1.layout.rec_len == 0
    rec = (
        rng.standard_normal((3, 40)).astype(np.float32),
        rng.standard_normal((4, 8, 8)).astype(np.float32),
    )
    import dataclasses

    hybrid = dataclasses.replace(plain, recurrent=rec)
    enc2 = encode(hybrid)
    assert HEADER.unpack_from(enc2.payload, 0)[1] == FORMAT_RECURRENT
    assert enc2.layout.rec_len == 4 * (120 + 256) and enc2.layout.kv_off % 4096 == 0
    parsed = ParsedExtent(enc2.payload)
    parsed.verify(enc2.head_sum, enc2.block_sums)
    assert all(np.array_equal(x, y) for x, y in zip(parsed.recurrent, rec, strict=True))
    back = parsed.to_state()
    assert all(np.array_equal(x, y) for x, y in zip(back.recurrent, rec, strict=True))
    assert all(np.array_equal(x, y) for x, y in zip(back.k, plain.k, strict=True))
    assert ParsedExtent(enc1.payload).recurrent == ()
    # The recurrent section is in the head: a flipped bit there fails the head's checksum.
    bad = enc2.payload.copy()
    bad[enc2.layout.rec_off + 5] ^= 1
    from czyx.inference.sessions.errors import SessionFormatError

    with pytest.raises(SessionFormatError, match="head"):
        ParsedExtent(bad).verify(enc2.head_sum, enc2.block_sums)
    with pytest.raises(RecurrentCutError):
        ParsedExtent(enc2.payload, rows=10).to_state()
