"""The resident fast path: a budget that holds every expert pays no streaming cost once warm.

Under such a budget no miss ever has to evict, so an acquire whose experts
are all resident (and verified) is a table read: no hold, no policy touch,
no planner round-trip, and a layer whose experts were all resident is not
predicted until it has to read again. Results and hit counters must be those
of the general path.
"""

from __future__ import annotations

import numpy as np
import pytest

from czyx.inference.cache import ExpertCache
from czyx.inference.engine import Engine
from czyx.inference.options import EngineOptions
from czyx.inference.streaming import StreamingExpertCache
from czyx.testing.fakes import FakeConsumer, owner_value
from czyx.testing.filemodel import FileConsumer, SyntheticExperts
from czyx.testing.refmodels import StateDictConsumer, tiny_model

TOKENS = [3, 17, 99, 4, 250, 8, 8, 61, 130, 7, 7, 7, 42, 3, 17]


def _greedy(eng: Engine, n: int = 12) -> tuple[list[int], list[np.ndarray]]:
    logits = eng.prefill(TOKENS[:5])
    toks, outs = [], []
    for _ in range(n):
        tok = int(np.argmax(logits))
        toks.append(tok)
        logits = eng.decode(tok)
        outs.append(logits)
    return toks, outs


class _Counting:
    """Counts the general path's holds (``_hold_layer``) of a cache."""

    def __init__(self, cache: ExpertCache) -> None:
        self.n = 0
        hold = cache._hold_layer

        def counted(*a, **kw):
            self.n += 1
            return hold(*a, **kw)

        cache._hold_layer = counted


@pytest.mark.parametrize("arch", ["mixtral", "olmoe"])
def test_warm_full_budget_decode_is_table_reads_and_identical(arch):
    consumer = StateDictConsumer(tiny_model(arch, seed=1))
    sync = Engine(consumer, options=EngineOptions(stream=False), threads=1)
    stream = Engine(consumer, threads=1)  # as czyx run builds it: streaming, all resident
    partial = Engine(consumer, cache_fraction=0.5, threads=1)
    try:
        assert stream.cache.never_evicts and sync.cache.never_evicts
        assert not partial.cache.never_evicts
        want_toks, want = _greedy(sync)
        for eng in (stream, partial):
            toks, got = _greedy(eng)
            assert toks == want_toks
            assert all(np.array_equal(a, b) for a, b in zip(got, want))
        # The same lookups (prefetched experts count as hits, read ones as misses).
        assert stream.stats().lookups == sync.stats().lookups
        # Every expert resident and verified: decode steps take no hold, read nothing,
        # and predict nothing (the hooks run but every layer is settled).
        cfg = stream.cfg
        every = [(i, e) for i in range(cfg.n_layers) for e in range(cfg.n_experts)]
        for eng in (stream, sync):
            eng.cache.prewarm(every)
            eng.cache.acquire(0, np.arange(cfg.n_experts))  # the prewarmed slots: verified
            eng.cache.release()
        counts = [_Counting(eng.cache) for eng in (stream, sync)]
        before = stream.stats()
        prefetches = stream.cache.prefetches
        eng_toks = []
        for eng in (stream, sync):
            eng.reset()
            eng_toks.append(_greedy(eng)[0])
        assert eng_toks[0] == eng_toks[1] == want_toks
        assert [c.n for c in counts] == [0, 0]
        assert stream.cache.prefetches == prefetches
        assert stream.stats().minus(before).misses == 0
        assert not stream.cache.blocked.any()
        stream.cache.check()
        # The partial budget keeps the general path (its policy sees every use).
        c = _Counting(partial.cache)
        partial.reset()
        _greedy(partial, 3)
        assert c.n > 0
    finally:
        for eng in (sync, stream, partial):
            eng.close()


def test_a_settled_layer_is_predicted_again_after_it_reads(tmp_path):
    fc = FileConsumer(SyntheticExperts(n_layers=2, n_experts=6), tmp_path)
    slot = fc.info.expert_slot_nbytes
    cache = StreamingExpertCache(fc, 12 * slot, 2, io="pread", readers=1)
    router = np.eye(6, 6, dtype=np.float32)
    cache.set_routers([router, router], [np.ones(6, np.float32)] * 2)
    h = np.zeros((1, 6), np.float32)
    h[0, 4] = h[0, 5] = 1.0  # predicts experts 4 and 5
    n = fc.info.expert_nbytes
    try:
        assert cache.never_evicts
        cache.preroute(0, h)  # warm: predicted and read
        assert cache.prefetches == 2
        for experts in ([4, 5], [4, 5]):  # the first waits on the prefetches, then settled
            got = cache.acquire(0, np.array(experts))
            for e, s in zip(experts, got.tolist()):
                assert np.array_equal(cache.slot_bytes(s)[:n], fc.base.blobs[(0, e)])
            cache.release()
        h2 = np.zeros((1, 6), np.float32)
        h2[0, 0] = h2[0, 1] = 1.0
        cache.preroute(0, h2)  # settled: no prediction, no read
        cache.lookahead(1, h2)  # no sparse layer after 1
        assert cache.prefetches == 2 and not cache._has_prediction[0]
        cache.acquire(0, np.array([0, 1]))  # a demand read: the layer is warm again
        cache.release()
        cache.preroute(0, h)
        assert cache._has_prediction[0]
        cache.preroute(0, h2)
        assert cache.prefetches == 2  # predicted, but 0, 1, 4, 5 are all resident
        cache.check()
    finally:
        cache.close()
        fc.close()


class _Evict:
    """A policy that evicts expert (0, 0) whenever it is resident (else any unheld slot)."""

    name = "pick"

    def __init__(self, cache_ref: list) -> None:
        self.cache_ref = cache_ref

    def filled(self, slot: int, key: int) -> None:
        pass

    def touch(self, slot: int) -> None:
        pass

    def victim(self, blocked: np.ndarray) -> int:
        s = int(self.cache_ref[0].table[0, 0])
        if s >= 0:
            return -1 if blocked[s] else s
        free = np.flatnonzero(~blocked)  # (0, 0) is out: any unheld slot
        return int(free[0]) if len(free) else -1


def test_an_eviction_after_a_failed_read_leaves_no_stale_fast_path():
    fake = FakeConsumer(n_layers=2, n_experts=4, fail=(1, 3))
    ref: list = []
    cache = ExpertCache(fake, 8 * 4096, 2, policy=_Evict(ref))
    ref.append(cache)
    assert cache.never_evicts
    with pytest.raises(OSError):
        cache.acquire(1, np.array([3]))
    cache.release()
    for layer in range(2):
        for e in range(4):
            if (layer, e) != (1, 3):
                cache.acquire(layer, np.array([e]))
                cache.release()
    assert cache.misses == 7 and cache.hits == 0
    s00 = int(cache.acquire(0, np.array([0]))[0])  # the resident fast path
    assert cache.hits == 1 and owner_value(cache, s00) == 0
    fake.fail = None
    # Every slot claimed (the failed read's stays empty): this miss evicts (0, 0).
    s13 = int(cache.acquire(1, np.array([3]))[0])
    cache.release()
    assert s13 == s00 and owner_value(cache, s13) == 1003 and cache.evictions == 1
    s = int(cache.acquire(0, np.array([0]))[0])  # read again, never the stale slot's bytes
    cache.release()
    assert owner_value(cache, s) == 0 and cache.misses == 9
    cache.check()
    cache.close()


def test_pinning_a_ready_expert_blocks_its_slot():
    """A pin acquired through the resident fast path is still never a victim."""
    fake = FakeConsumer(n_layers=1, n_experts=4)
    cache = ExpertCache(fake, 4 * 4096, 2)
    assert cache.never_evicts
    cache.acquire(0, np.array([0, 1]))
    cache.release()
    cache.pin([(0, 1)])  # (0, 1) is ready: the fast path
    s = int(cache.table[0, 1])
    assert cache.pinned[s] and cache.blocked[s] and cache.n_pinned == 1
    cache.check()
    cache.close()
