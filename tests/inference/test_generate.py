"""Generation: stopping, streaming text, and the statistics it reports."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from czyx.inference.engine import Engine, resolve_budget
from czyx.inference.errors import CacheBudgetError
from czyx.inference.generate import generate, generate_ids
from czyx.inference.memory import MEMORY_SHARE
from czyx.inference.options import EngineOptions
from czyx.inference.sampling import SamplingParams
from czyx.inference.tokenizer import ByteTokenizer
from czyx.testing.refmodels import StateDictConsumer, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("olmoe", seed=2)


def test_stops_on_eos_and_on_max_tokens(model):
    eng = Engine(StateDictConsumer(model))
    prompt = [5, 6, 7]
    free, st = generate_ids(eng, prompt, 12)
    assert len(free) == 12 and st.stop_reason == "max_tokens" and st.decode_steps == 11
    eos = free[4]
    first = free.index(eos)
    cut, st = generate_ids(eng, prompt, 12, eos_ids=[eos])
    assert cut == free[: first + 1] and st.stop_reason == "eos"
    none, st = generate_ids(eng, prompt, 0)
    assert none == [] and st.generated_tokens == 0


def test_sampling_is_seeded(model):
    eng = Engine(StateDictConsumer(model))
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=11)
    a, _ = generate_ids(eng, [1, 2, 3], 16, params)
    b, _ = generate_ids(eng, [1, 2, 3], 16, params)
    assert a == b


def test_streamed_text_equals_final_text_and_stats_add_up(model):
    consumer = StateDictConsumer(model)
    # No prefetch: every read is then a demand miss (misses == reads below).
    eng = Engine(consumer, cache_fraction=0.25, options=EngineOptions(prefetch=False))
    pieces: list[str] = []
    out = generate(eng, ByteTokenizer(), "héllo", 20, on_text=pieces.append)
    assert "".join(pieces) == out.text
    assert len(out.tokens) == 20
    st = out.stats
    assert st.prompt_tokens == len("héllo".encode())
    total_misses = st.prefill_cache.misses + st.decode_cache.misses
    assert total_misses == len(consumer.reads)
    assert st.decode_cache.bytes_read == st.decode_cache.misses * eng.cache.slot_nbytes
    assert st.decode_bytes_per_token == pytest.approx(st.decode_cache.bytes_read / 19)
    assert 0.0 <= st.hit_rate < 1.0 and st.io_wait_seconds >= 0
    assert "hit rate" in st.summary()


def test_budget_resolution(model):
    consumer = StateDictConsumer(model)
    eng = Engine(consumer)
    cfg, slot = eng.cfg, consumer.info.expert_slot_nbytes
    assert resolve_budget(consumer, cfg) == cfg.n_sparse_experts * slot
    assert resolve_budget(consumer, cfg, cache_fraction=0.5) == cfg.n_sparse_experts * slot // 2
    with pytest.raises(CacheBudgetError, match="top-2"):
        resolve_budget(consumer, cfg, cache_fraction=0.01)
    with pytest.raises(ValueError):
        resolve_budget(consumer, cfg, cache_bytes=1, cache_fraction=0.5)
    with pytest.raises(CacheBudgetError):
        Engine(consumer, cache_bytes=slot)


def test_hot_list_and_pinned_classes_do_not_change_outputs(model):
    base = Engine(StateDictConsumer(model)).prefill([3, 1, 4, 1, 5], all_logits=True)
    consumer = StateDictConsumer(model)
    eng = Engine(consumer, cache_fraction=0.5, hot=[(1, 3), (0, 2)], pin_classes=(0, 1))
    assert eng.cache.n_pinned == 2 and eng.cache.table[1, 3] >= 0
    got = eng.prefill([3, 1, 4, 1, 5], all_logits=True)
    assert np.array_equal(got, base)


def test_bad_tokens_are_refused(model):
    eng = Engine(StateDictConsumer(model))
    with pytest.raises(ValueError, match="out of range"):
        eng.prefill([999])
    with pytest.raises(ValueError, match="empty"):
        generate_ids(eng, [], 3)


def test_routing_profile_counts_every_choice_and_orders_the_hot_list(model, tmp_path):
    from czyx.inference.profile import ProfileError, RoutingProfile

    eng = Engine(StateDictConsumer(model))
    eng.prefill([9, 8, 7, 6, 5, 4])
    prof = eng.routing_profile()
    cfg = eng.cfg
    assert prof.counts.sum() == 6 * cfg.top_k * sum(cfg.sparse_layers)
    hot = prof.hot_list()
    counts = [prof.counts[la, e] for la, e in hot]
    assert counts == sorted(counts, reverse=True) and min(counts) > 0
    prof.save(tmp_path / "p.json")
    back = RoutingProfile.load(tmp_path / "p.json", cfg.n_layers, cfg.n_experts)
    assert np.array_equal(back.counts, prof.counts)
    with pytest.raises(ProfileError, match="layers"):
        RoutingProfile.load(tmp_path / "p.json", cfg.n_layers + 1, cfg.n_experts)
    # A prewarmed hot list turns the same prompt's cold misses into hits.
    warm = Engine(StateDictConsumer(model), cache_fraction=0.5, hot=hot)
    before = warm.stats()
    warm.prefill([9, 8, 7, 6, 5, 4])
    assert warm.stats().minus(before).hit_rate > 0


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    n_slots=st.integers(2, 16),
    prompt=st.lists(st.integers(0, 255), min_size=1, max_size=12),
    steps=st.integers(0, 6),
)
def test_for_all_budgets_tiered_equals_resident(model, n_slots, prompt, steps):
    def run(**budget):
        eng = Engine(StateDictConsumer(model), **budget)
        logits = [eng.prefill(prompt, all_logits=True)]
        tok = int(np.argmax(logits[-1][-1]))
        for _ in range(steps):
            logits.append(eng.decode(tok))
            tok = int(np.argmax(logits[-1]))
        return logits

    slot = StateDictConsumer(model).info.expert_slot_nbytes
    resident, tiered = run(), run(cache_bytes=n_slots * slot)
    assert all(np.array_equal(a, b) for a, b in zip(resident, tiered))


def test_default_budget_fits_the_memory_the_process_may_take(model, monkeypatch):
    from czyx.inference import engine as engine_mod
    from czyx.inference.cache import ExpertCache

    consumer = StateDictConsumer(model)
    probe = Engine(consumer)
    cfg = probe.cfg
    probe.close()
    slot = consumer.info.expert_slot_nbytes
    total = cfg.n_sparse_experts * slot
    share = MEMORY_SHARE
    # caches other tests left open in this process count as taken: rooms are given beyond them
    before = ExpertCache.reserved_bytes()

    def budget(room):
        return resolve_budget(
            consumer, cfg, available=lambda: None if room is None else room + before
        )

    assert budget(None) == total  # unknown memory: every expert, as before
    assert budget(10 * total) == total
    assert budget(total) == int(share * total)
    assert budget(0) == cfg.top_k * slot  # never below one layer's top-k
    assert budget(-before) == cfg.top_k * slot  # less room than the open caches hold
    assert resolve_budget(consumer, cfg, cache_fraction=1.0, available=lambda: 0) == total

    # An open cache's arena counts as taken until it closes (or is collected).
    monkeypatch.setattr(engine_mod, "available_bytes", lambda: 2 * total + before)
    first = Engine(consumer)
    assert first.budget_bytes == total and first.budget_note is None
    assert ExpertCache.reserved_bytes() == before + first.cache.n_slots * slot
    second = Engine(consumer)
    assert second.budget_bytes == max(cfg.top_k * slot, int(share * total))
    assert second.budget_note is not None and "--cache-mb" in second.budget_note
    assert second.cache.n_slots < first.cache.n_slots
    # the reduced budget streams the rest: same tokens as the resident engine
    ids, _ = generate_ids(first, [1, 2, 3], 8)
    assert generate_ids(second, [1, 2, 3], 8)[0] == ids
    first.close()
    second.close()
    assert ExpertCache.reserved_bytes() == before
    # a plain cache dropped without close gives its arena back when collected
    third = Engine(consumer, options=EngineOptions(stream=False))
    assert third.budget_bytes == total
    assert ExpertCache.reserved_bytes() == before + third.cache.n_slots * slot
    del third
    gc.collect()
    assert ExpertCache.reserved_bytes() == before
