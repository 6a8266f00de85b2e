"""Our numpy decoders against transformers on tiny checkpoints of each architecture.

fp32: logits within 1e-4 of the logit range, prefill and step-by-step decode;
greedy tokens identical to ``generate`` for 32 steps; and for cache budgets of
100 %, 50 % and one layer's top-k, logits and tokens bit-identical to the
fully resident run under every eviction policy (also when the store permutes
classes).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from czyx.inference.engine import Engine
from czyx.inference.generate import generate_ids
from czyx.inference.options import EngineOptions
from czyx.testing.refmodels import ARCHS, StateDictConsumer, hf_greedy, tiny_model

PROMPT = np.random.default_rng(7).integers(0, 256, 14)
STEPS = 32


@pytest.fixture(scope="module")
def ref() -> dict:
    """Per arch: the model, its all-position logits on PROMPT, and its 32 greedy tokens."""
    out = {}
    for arch in ARCHS:
        model = tiny_model(arch)
        with torch.no_grad():
            logits = model(torch.tensor(PROMPT)[None]).logits[0].numpy()
        out[arch] = (model, logits, hf_greedy(model, PROMPT, STEPS))
    return out


def _tol(logits: np.ndarray) -> float:
    return 1e-4 * float(logits.max() - logits.min())


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers(ref, arch):
    model, want, _ = ref[arch]
    got = Engine(StateDictConsumer(model)).prefill(PROMPT, all_logits=True)
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.abs(got - want).max() < _tol(want)


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_with_kv_cache_matches_transformers(ref, arch):
    model, want, _ = ref[arch]
    eng = Engine(StateDictConsumer(model))
    first = eng.prefill(PROMPT[:5], all_logits=True)
    rows = [*first, *(eng.decode(int(t)) for t in PROMPT[5:])]
    assert eng.position == len(PROMPT)
    assert np.abs(np.stack(rows) - want).max() < _tol(want)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_generate(ref, arch):
    model, _, want = ref[arch]
    got, stats = generate_ids(Engine(StateDictConsumer(model)), PROMPT.tolist(), STEPS)
    assert got == want
    assert stats.generated_tokens == STEPS and stats.stop_reason == "max_tokens"


def _run(
    consumer: StateDictConsumer, policy: str = "lru", **budget
) -> tuple[np.ndarray, list[int], Engine]:
    # No prefetch: every read is then a demand miss (misses == reads below).
    eng = Engine(consumer, options=EngineOptions(policy=policy, prefetch=False), **budget)
    logits = eng.prefill(PROMPT, all_logits=True)
    tokens, _ = generate_ids(eng, PROMPT.tolist(), STEPS)
    return logits, tokens, eng


@pytest.mark.parametrize("policy", ["lru", "lfu", "decay", "slru"])
@pytest.mark.parametrize("arch", ARCHS)
def test_tiered_runs_are_bit_identical_to_resident(ref, arch, policy):
    model = ref[arch][0]
    base_logits, base_tokens, full = _run(StateDictConsumer(model))
    assert full.stats().evictions == 0
    top_k = full.cfg.top_k
    slot = full.cache.slot_nbytes
    budgets = [dict(cache_fraction=0.5), dict(cache_bytes=top_k * slot)]
    for budget in budgets:
        consumer = StateDictConsumer(model)
        logits, tokens, eng = _run(consumer, policy, **budget)
        assert eng.cache.policy.name == policy
        # The token clock (decay's time) advanced once per token: two prefills, then decodes.
        assert eng.cache.tokens == eng.position + len(PROMPT)
        assert np.array_equal(logits, base_logits), budget
        assert tokens == base_tokens, budget
        eng.cache.check()
        st = eng.stats()
        assert st.evictions > 0 and st.misses == len(consumer.reads)
        assert st.bytes_read == st.misses * slot
    assert Engine(StateDictConsumer(model), cache_bytes=top_k * slot).cache.n_slots == top_k


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_class_permutation_in_the_store_is_invisible(ref, arch):
    model = ref[arch][0]
    base_logits, base_tokens, eng = _run(StateDictConsumer(model))
    rng = np.random.default_rng(3)
    perm = [rng.permutation(eng.cfg.n_experts) for _ in range(eng.cfg.n_layers)]
    logits, tokens, _ = _run(StateDictConsumer(model, perm), cache_fraction=0.5)
    assert np.array_equal(logits, base_logits) and tokens == base_tokens


@pytest.mark.parametrize(
    "arch, overrides",
    [
        ("qwen2_moe", dict(use_sliding_window=True, sliding_window=5, max_window_layers=3)),
        ("qwen3_moe", dict(use_sliding_window=True, sliding_window=5)),
        ("olmoe", dict(clip_qkv=0.05)),
        ("qwen3_moe", dict(tie_word_embeddings=True)),
    ],
)
def test_config_variants_match_transformers(arch, overrides):
    model = tiny_model(arch, seed=5, **overrides)
    with torch.no_grad():
        want = model(torch.tensor(PROMPT)[None]).logits[0].numpy()
    consumer = StateDictConsumer(model)
    if overrides.get("tie_word_embeddings"):
        del consumer.sd[("lm_head", None)]  # a store keeps a tied head once, as the embedding
    got = Engine(consumer).prefill(PROMPT, all_logits=True)
    assert np.abs(got - want).max() < _tol(want)
