"""Engine.prefill: a prompt through the batched C step where the model decodes in C.

The prompt's logits and KV must then be those of decoding it token by token,
bit for bit, whatever the format and however the prompt is chunked
(``PREFILL_CHUNK``); the model's own prompt forward keeps the cases the C step
does not take: every token's logits, a model observed layer by layer, and a
prompt longer than one chunk on a cache that cannot hold every expert (which
the prompt forward reads at most once each for the whole prompt).
"""

from __future__ import annotations

import numpy as np
import pytest

from czyx.inference import engine as engine_mod
from czyx.inference.engine import PREFILL_CHUNK, Engine, prompt_in_c
from czyx.inference.kernels import fused
from czyx.store.quant.memory import QuantizedConsumer
from czyx.store.quant.policy import POLICIES, parse_policy
from czyx.testing.refmodels import StateDictConsumer, tiny_model

pytestmark = pytest.mark.skipif(not fused.have_czk(), reason="the C kernels are not built")

Q8 = "none,expert=q8,attention=q8,router=q8,embed=q8,lm_head=q8"


def _engine(arch: str, fmt: str | None, threads: int = 1, **kw) -> Engine:
    base = StateDictConsumer(tiny_model(arch, hidden_size=64, intermediate_size=32))
    if fmt is not None:
        base = QuantizedConsumer(base, POLICIES["q4-all"] if fmt == "q4" else parse_policy(Q8))
    return Engine(base, threads=threads, **kw)


def _decoded(eng: Engine, prompt: np.ndarray) -> np.ndarray:
    """The last logits of ``prompt`` decoded one token at a time."""
    for t in prompt:
        logits = eng.decode(int(t))
    return logits


@pytest.mark.parametrize(
    ("arch", "fmt", "threads"),
    [("mixtral", None, 1), ("olmoe", "q8", 2), ("qwen3_moe", "q4", 2)],
)
def test_a_prompt_is_its_tokens_decoded_one_at_a_time(arch, fmt, threads):
    prompt = np.random.default_rng(1).integers(0, 256, 23)
    a, b = _engine(arch, fmt, threads), _engine(arch, fmt, threads)
    try:
        assert prompt_in_c(a.model, prompt.size, True)
        got = a.prefill(prompt)
        want = _decoded(b, prompt)
        assert np.array_equal(got, want)
        n = prompt.size
        for la, lb in zip(a.kv.k, b.kv.k, strict=True):
            assert np.array_equal(la[:, :n], lb[:, :n])
        assert a.position == b.position == n
        # and the next token decodes the same on both
        assert np.array_equal(a.decode(7), b.decode(7))
    finally:
        a.close()
        b.close()


def test_a_prompt_longer_than_a_chunk_runs_in_chunks_with_the_same_bits(monkeypatch):
    monkeypatch.setattr(engine_mod, "PREFILL_CHUNK", 5)
    prompt = np.random.default_rng(2).integers(0, 256, 17)  # 5 + 5 + 5 + 2
    a, b = _engine("olmoe", "q8", 2), _engine("olmoe", "q8", 2)
    try:
        assert np.array_equal(a.prefill(prompt), _decoded(b, prompt))
    finally:
        a.close()
        b.close()


def test_the_prompt_forward_keeps_what_the_c_step_does_not_take():
    eng = _engine("mixtral", None)
    try:
        model = eng.model
        assert prompt_in_c(model, PREFILL_CHUNK, False)
        # longer than a chunk on a cache short of every expert: one prompt forward
        assert not prompt_in_c(model, PREFILL_CHUNK + 1, False)
        assert prompt_in_c(model, PREFILL_CHUNK + 1, True)
        assert not prompt_in_c(model, 0, True)
        model.observer = lambda name, x: None  # calibration observes every layer
        assert not prompt_in_c(model, 4, True)
        model.observer = None
        prompt = np.random.default_rng(3).integers(0, 256, 6)
        every = eng.prefill(prompt, all_logits=True)  # every token's logits: the prompt forward
        assert every.shape == (6, model.cfg.vocab_size)
        eng.reset()
        np.testing.assert_allclose(eng.prefill(prompt), every[-1], rtol=1e-4, atol=1e-4)
    finally:
        eng.close()


def test_a_cache_short_of_every_expert_takes_the_c_step_for_a_chunk():
    eng = _engine("mixtral", None, cache_fraction=0.25)
    ref = _engine("mixtral", None)
    try:
        assert eng.cache.max_acquire < eng.cfg.n_sparse_experts
        prompt = np.random.default_rng(4).integers(0, 256, 9)
        assert np.array_equal(eng.prefill(prompt), _decoded(ref, prompt))
    finally:
        eng.close()
        ref.close()
