"""The transfer planner and the streaming cache: verified transfers, fault injection, parity."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from czyx.inference.cache import ExpertCache
from czyx.inference.errors import CacheBudgetError, SlotInUseError
from czyx.inference.models import decoder_class
from czyx.inference.planner import (
    DEMAND,
    PREFETCH,
    DeadlineMissedError,
    InvalidExtentError,
    SlotLiveError,
    TransferPlanner,
)
from czyx.inference.streaming import StreamingExpertCache, attach
from czyx.store.errors import ChecksumError, ShortReadError
from czyx.store.io import iopaths, readpool
from czyx.store.io.reader import aligned_empty
from czyx.testing.filemodel import FileConsumer, SyntheticExperts

IO_PATHS = [p for p, why in iopaths.available_paths().items() if why == "available"]


@pytest.fixture
def synth(tmp_path):
    fc = FileConsumer(SyntheticExperts(), tmp_path)
    yield fc
    fc.close()


def _arena(consumer, n):
    a = aligned_empty(n * consumer.info.expert_slot_nbytes).reshape(n, -1)
    return [a[i] for i in range(n)], np.zeros(n, bool)


def _planner(consumer, n=4, **kw):
    slots, live = _arena(consumer, n)
    return TransferPlanner(consumer, slots, live, **kw), slots, live


@pytest.fixture(autouse=True, params=["native", "python"])
def readers(request, monkeypatch):
    """Every test runs on both reader kinds: the native C pool and Python threads."""
    if request.param == "python":
        monkeypatch.setattr(readpool, "available", lambda: False)
    elif not readpool.available():
        pytest.fail("store._iopaths is not built: the native read pool cannot run")
    return request.param


class Gate:
    """A slow device: reads wait until :meth:`set` (Python readers block in the
    source, native pools are paused)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.pools: list[readpool.ReadPool] = []

    def hook(self, pool: readpool.ReadPool) -> None:
        self.pools.append(pool)
        pool.pause(not self.event.is_set())

    def set(self) -> None:
        self.event.set()
        for p in self.pools:
            p.pause(False)

    def clear(self) -> None:
        self.event.clear()
        for p in self.pools:
            p.pause(True)


@pytest.fixture
def gate(monkeypatch):
    """Every transfer blocks until ``gate.set()``."""
    go = Gate()
    read = iopaths.TransferSource.read_into

    def slow(self, off, n, dest):
        go.event.wait(10)
        return read(self, off, n, dest)

    monkeypatch.setattr(iopaths.TransferSource, "read_into", slow)
    monkeypatch.setattr(readpool, "on_new_pool", [go.hook])
    yield go
    go.set()


@pytest.mark.parametrize("io", IO_PATHS)
@pytest.mark.parametrize("threads", [1, 2, 8])
def test_transfers_land_verified_in_their_final_slot(synth, io, threads, readers):
    p, slots, _ = _planner(synth, io=io, readers=threads)
    try:
        assert p.reads.kind == ("native" if readers == "native" else "threads")
        ts = [p.submit(1, e, e, kind=DEMAND) for e in range(4)]
        for e, t in enumerate(ts):
            p.wait(t)
            n = synth.info.expert_nbytes
            assert np.array_equal(slots[e][:n], synth.base.blobs[(1, e)])
            assert t.checksum_result == "ok" and t.used and t.source == io
            assert t.native == (readers == "native")
            direct = io in ("direct", "io_uring")
            assert t.staging_copy_bytes == (0 if direct else t.completed_bytes)
            assert t.t_request <= t.t_start <= t.t_complete <= t.t_first_use + t.exposed_ns
        assert p.inflight == [None] * 4
        assert not p.reads.python_threads or readers == "python"  # native: no Python thread
    finally:
        p.close()


def test_a_slot_may_be_a_destination_only_when_its_owner_is_dead(synth, gate):
    p, _, live = _planner(synth, io="pread")
    try:
        t = p.submit(0, 0, 0)
        with pytest.raises(SlotLiveError, match="in flight"):
            p.submit(0, 1, 0)  # reuse while a transfer is in flight into it
        live[1] = True
        with pytest.raises(SlotLiveError, match="still live"):
            p.submit(0, 2, 1)  # held by the current layer or pinned
        with pytest.raises(InvalidExtentError):
            p.submit(0, 3, 99)  # outside the arena
        with pytest.raises(InvalidExtentError):
            p.submit(7, 0, 2)  # no such expert
        synth.off[2, 5] = -1  # the consumer has no extent for it (a dense layer)
        with pytest.raises(InvalidExtentError, match="no extent"):
            p.submit(2, 5, 2)
        gate.set()
        p.wait(t)
        p.submit(0, 1, 0)  # dead now: allowed
    finally:
        gate.set()
        p.close()


def test_an_extent_larger_than_the_slot_is_refused(tmp_path):
    fc = FileConsumer(SyntheticExperts(nbytes=4096 + 1), tmp_path)
    slots, live = _arena(fc, 2)
    p = TransferPlanner(fc, [s[:4096] for s in slots], live, io="pread")
    try:
        with pytest.raises(InvalidExtentError, match="does not fit"):
            p.submit(0, 0, 0)
    finally:
        p.close()
        fc.close()


@pytest.mark.parametrize("io", IO_PATHS)
def test_forced_short_read_is_a_typed_error_and_the_slot_is_unmapped(synth, io):
    cache = StreamingExpertCache(synth, 4 * 4096 * 3, 2, io=io, readers=2, prefetch=False)
    try:
        cache.acquire(0, np.array([0, 1]))
        cache.release()
        os.truncate(synth.path, int(synth.off[2, 0]) + 100)  # the block file loses its tail
        with pytest.raises(ShortReadError):
            cache.acquire(2, np.array([0]))
        assert cache.table[2, 0] == -1 and not cache.blocked.any()
        cache.check()
    finally:
        cache.close()


@pytest.mark.parametrize("io", IO_PATHS)
@pytest.mark.parametrize("first_use", ["before", "after"])
def test_stale_block_file_is_refused(synth, io, first_use, tmp_path):
    """The block file is replaced after mount, before or after the planner first reads it."""
    p, _, _ = _planner(synth, io=io)
    fresh = FileConsumer(SyntheticExperts(seed=9), tmp_path / "..")  # same size, other bytes
    try:
        if first_use == "before":
            p.wait(p.submit(0, 0, 0))
        os.replace(fresh.path, synth.path)
        with pytest.raises(iopaths.StaleSourceError, match="replaced"):
            p.wait(p.submit(0, 1, 1))
    finally:
        fresh.close()
        p.close()


def test_checksum_failure_is_a_typed_error_never_the_bytes(synth):
    st = os.stat(synth.path)
    with open(synth.path, "r+b") as f:  # silent bit rot: content changes, metadata does not
        f.seek(int(synth.off[1, 3]) + 17)
        f.write(b"\xff\x00")
    os.utime(synth.path, ns=(st.st_atime_ns, st.st_mtime_ns))
    cache = StreamingExpertCache(synth, 6 * 4096 * 3, 2, io="pread", readers=2)
    try:
        with pytest.raises(ChecksumError, match="checksum"):
            cache.acquire(1, np.array([2, 3]))
        assert cache.table[1, 3] == -1 and cache.table[1, 2] >= 0
    finally:
        cache.close()


def test_late_transfer_is_a_counted_stall_or_a_typed_error(synth, gate):
    for strict in (False, True):
        gate.clear()
        p, slots, _ = _planner(synth, io="pread", strict_deadlines=strict)
        try:
            t = p.submit(0, 4, 0, kind=PREFETCH, deadline_ns=0)  # deadline already passed
            wait = p.reads.wait

            def opened_on_wait(read, wait=wait):
                # The device answers once the consumer waits: the read completes after
                # its first use, however loaded the machine (a timer could fire first).
                threading.Timer(0.02, gate.set).start()
                return wait(read)

            p.reads.wait = opened_on_wait
            if strict:
                with pytest.raises(DeadlineMissedError, match="after its deadline"):
                    p.wait(t)
            else:
                p.wait(t)
                n = synth.info.expert_nbytes
                assert t.stalled and p.stalls == 1 and t.exposed_ns > 0
                assert np.array_equal(slots[0][:n], synth.base.blobs[(0, 4)])
        finally:
            gate.set()
            p.close()


def test_in_flight_and_held_slots_are_never_victims(synth, gate):
    # 4 slots, top-2: two held by layer 0, two prefetched for layer 1 while the device stalls.
    cache = StreamingExpertCache(
        synth, 4 * 4096 * 3, 2, io="pread", prefetch_evicts=True, readers=1
    )
    cache.set_routers([np.eye(8, 5, dtype=np.float32)] * 3)
    n = synth.info.expert_nbytes
    try:
        gate.set()
        cache.acquire(0, np.array([0, 1]))
        cache.release()
        gate.clear()
        x = np.zeros((1, 5), np.float32)
        x[0, 2] = x[0, 3] = 1.0  # predicts experts 2 and 3 of layer 1
        cache.lookahead(0, x)
        held = cache.acquire(0, np.array([0, 1])).tolist()
        pre = [cache._xfer[s] for s in range(4) if cache.inflight[s]]
        assert cache.prefetches == 2 and len(pre) == 2 and not any(t.done for t in pre)
        # Every unheld slot is in flight: a miss waits for them; it never overwrites one.
        threading.Timer(0.05, gate.set).start()
        s5 = int(cache.acquire(2, np.array([5]))[0])
        # Complete; a native read is verified at its first use, a Python one by its reader.
        assert all(t.done and t.error is None for t in pre)
        assert all(t.checksum_result in ("ok", "pending") for t in pre)
        assert s5 in [t.slot for t in pre] and s5 not in held
        # Three slots held now, one free: two more misses cannot both be placed.
        with pytest.raises(SlotInUseError, match="pinned or held"):
            cache.acquire(2, np.array([6, 7]))
        assert not cache.blocked.any()  # the failed acquire released its holds
        assert np.array_equal(cache.slot_bytes(s5)[:n], synth.base.blobs[(2, 5)])
        got = cache.acquire(1, np.array([3, 2]))
        for e, s in zip((3, 2), got.tolist()):
            assert np.array_equal(cache.slot_bytes(s)[:n], synth.base.blobs[(1, e)])
            assert cache._xfer[s].checksum_result == "ok"  # verified before this use
        assert cache.predicted_correct == 2
        cache.release()
        cache.check()
    finally:
        cache.close()


def test_early_routing_reads_the_layer_predicted_from_the_residual_stream(synth):
    """preroute: the layer's own router, its norm folded in, on the stream entering it."""
    cache = StreamingExpertCache(
        synth, 4 * 4096 * 3, 2, io="pread", prefetch_evicts=True, readers=1
    )
    router = np.eye(8, 5, dtype=np.float32)  # expert e < 5 responds to coordinate e
    norm = np.array([0.1, 0.1, 1, 1, 1], np.float32)
    cache.set_routers([router] * 3, [norm] * 3)
    h = np.array([[3, 3, 1, 1, 0]], np.float32)  # raw top-2: {0, 1}; normed: {2, 3}
    try:
        for layer, experts in ((1, [2]), (0, [0, 1]), (2, [4])):  # (1, 2) used first
            cache.acquire(layer, np.array(experts))
            cache.release()
        cache._reap()
        cache.planner.drain()
        victim = int(cache.table[0, 0])
        cache.preroute(1, h)
        # Expert 3 was read now; expert 2, resident and least recently used, was held
        # while the victim was chosen: one prediction never evicts another.
        assert cache.prefetches == 1 and cache.table[1, 2] >= 0
        assert cache.table[1, 3] == victim and cache.table[0, 0] == -1
        got = cache.acquire(1, np.array([3, 2]))
        n = synth.info.expert_nbytes
        for e, s in zip((3, 2), got.tolist()):
            assert np.array_equal(cache.slot_bytes(s)[:n], synth.base.blobs[(1, e)])
        assert cache.predicted_total == 2 and cache.predicted_correct == 2
        cache.release()
        off = StreamingExpertCache(synth, 4 * 4096 * 3, 2, io="pread", early=False)
        off.set_routers([router] * 3, [norm] * 3)
        off.preroute(1, h)
        assert off.prefetches == 0 and (off.table < 0).all()
        off.close()
    finally:
        cache.close()


def _decode(model, kv, tokens):
    out = [model.forward(np.array(tokens[:4]), kv)]
    for tok in tokens[4:]:
        out.append(model.forward(np.array([tok]), kv))
    return np.stack(out)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_streamed_runs_are_bit_identical_to_resident_for_any_thread_count(arch, tmp_path):
    from czyx.testing.refmodels import StateDictConsumer, tiny_model

    base = StateDictConsumer(tiny_model(arch))
    fc = FileConsumer(base, tmp_path)
    cls = decoder_class(arch)
    cfg = cls.parse_config(fc.info)
    slot = fc.info.expert_slot_nbytes
    tokens = [3, 17, 99, 4, 250, 8, 8, 61, 130, 7]
    resident = ExpertCache(fc, cfg.n_sparse_experts * slot, cfg.top_k, cfg.n_sparse_experts)
    model = cls(fc, resident)
    want = _decode(model, model.new_kv(), tokens)
    budget = max(cfg.n_sparse_experts * slot // 4, cfg.top_k * slot)
    try:
        tight = (cfg.top_k + 1) * slot  # one slot beyond a layer's top-k
        runs = [(io, 2, True, budget, 1, None) for io in IO_PATHS]
        runs += [("pread", t, p, budget, 1, None) for t in (1, 8) for p in (False, True)]
        runs += [("pread", 2, True, tight, 2, None), ("pread", 8, True, budget, 2, 1)]
        runs = [(*r, "lru", True) for r in runs] + [
            ("pread", 2, True, budget, 1, None, "lru", False),  # look-ahead alone
            ("pread", 2, True, budget, 0, None, "lru", True),  # early routing alone
        ]
        # The other eviction policies, with prefetch (whose reads also touch the policy).
        runs += [
            ("pread", 2, True, b, 1, None, p, True)
            for p in ("decay", "slru")
            for b in (budget, tight)
        ]
        runs = [(*r, True, 0) for r in runs] + [  # predictions that only fill free slots
            ("pread", 2, True, b, 1, None, "lru", True, False, 0) for b in (budget, tight)
        ]
        runs += [  # predictions into slots set aside for them
            ("pread", 2, True, budget, 1, None, p, True, False, k)
            for p in ("lru", "nextuse")
            for k in (1, cfg.top_k)
        ]
        for io, threads, prefetch, nbytes, depth, width, policy, early, evicts, stage in runs:
            cache = StreamingExpertCache(
                fc,
                nbytes,
                cfg.top_k,
                cfg.n_sparse_experts,
                policy,
                io=io,
                readers=threads,
                prefetch=prefetch,
                prefetch_evicts=evicts,
                prefetch_slots=stage,
                lookahead=depth,
                width=width,
                early=early,
            )
            m = cls(fc, cache)
            attach(m, cache)
            kv = m.new_kv()
            got = [m.forward(np.array(tokens[:4]), kv)]
            before = cache.predicted_total, cache.hits + cache.misses
            got += [m.forward(np.array([tok]), kv) for tok in tokens[4:]]
            run = (io, threads, prefetch, nbytes, depth, width, policy, early, evicts, stage)
            assert np.array_equal(np.stack(got), want), run
            if stage:  # full, the cache still predicts, and the slots set aside stay so
                assert cache.staged.sum() == stage and cache.prefetches > 0, run
                assert cache.promotions > 0 and cache.max_acquire == cache.n_slots - stage
            elif not evicts:
                # Full, the cache predicts nothing more: no product, no read.
                assert cache._n_filled == cache.n_slots
                p0 = cache.predicted_total, cache.prefetches
                m.forward(np.array([5]), kv)
                assert (cache.predicted_total, cache.prefetches) == p0, run
                cache.check()
                cache.close()
                continue
            assert cache.misses > 0 and (cache.prefetches > 0) == prefetch
            # Decoding, early routing predicts every sparse layer, the first one of each
            # token too; look-ahead alone never predicts the first.
            predicted = cache.predicted_total - before[0]
            lookups = cache.hits + cache.misses - before[1]
            if prefetch:
                assert (predicted == lookups) == early, (run, predicted, lookups)
            cache.check()
            cache.close()
    finally:
        fc.close()


def test_a_demand_read_is_exposed_but_not_a_deadline_stall(synth, gate):
    p, _, _ = _planner(synth, io="pread")
    try:
        threading.Timer(0.02, gate.set).start()
        t = p.submit(0, 2, 0)  # demand, no deadline: requested at its first use
        p.wait(t)
        assert t.exposed_ns > 0 and not t.stalled and p.stalls == 0
        gate.clear()
        threading.Timer(0.02, gate.set).start()
        t = p.submit(0, 3, 1, deadline_ns=t.t_complete)  # an explicit deadline, missed
        p.wait(t)
        assert t.stalled and p.stalls == 1
    finally:
        gate.set()
        p.close()


def test_predictions_fill_free_slots_and_stop_when_none_is_left(synth):
    """Without prefetch_evicts a prediction never evicts: it warms a cache up, then stops."""
    cache = StreamingExpertCache(synth, 3 * 4096 * 3, 2, io="pread", readers=1)
    router = np.eye(8, 5, dtype=np.float32)  # expert e < 5 responds to coordinate e
    cache.set_routers([router] * 3, [np.ones(5, np.float32)] * 3)
    try:
        cache.acquire(0, np.array([0]))
        cache.release()
        cache.preroute(1, np.array([[0, 0, 3, 2, 0]], np.float32))  # predicts {2, 3}
        # Two free slots: both predictions are read, nothing is evicted.
        assert cache.prefetches == 2 and cache.evictions == 0
        assert cache.table[1, 2] >= 0 and cache.table[1, 3] >= 0 and cache.table[0, 0] >= 0
        cache.acquire(1, np.array([2, 3]))
        cache.release()
        predicted = cache.predicted_total
        cache.preroute(2, np.array([[3, 2, 0, 0, 0]], np.float32))  # full: no prediction
        cache.lookahead(1, np.array([[3, 2, 0, 0, 0]], np.float32))
        assert cache.prefetches == 2 and not cache._has_prediction.any()
        got = cache.acquire(2, np.array([0, 1]))  # demand reads evict as ever
        n = synth.info.expert_nbytes
        for e, s in zip((0, 1), got.tolist()):
            assert np.array_equal(cache.slot_bytes(s)[:n], synth.base.blobs[(2, e)])
        assert cache.predicted_total == predicted and cache.evictions == 2
        cache.release()
        cache.check()
    finally:
        cache.close()


def test_predictions_in_prefetch_slots_evict_nothing_the_cache_keeps(synth):
    """With prefetch slots a full cache still predicts: into the slot of the oldest unused
    prediction; a used one joins the cache, the policy's victim becomes the slot."""
    cache = StreamingExpertCache(synth, 4 * 4096 * 3, 2, policy="lru", io="pread", prefetch_slots=1)
    router = np.eye(8, 5, dtype=np.float32)  # expert e < 5 responds to coordinate e
    cache.set_routers([router] * 3, [np.ones(5, np.float32)] * 3)
    n = synth.info.expert_nbytes

    settle = cache._settle  # every read in flight done and retired

    try:
        assert cache.max_acquire == 3
        for layer, e in ((0, 0), (0, 1), (2, 0)):  # the three other slots, oldest first
            cache.acquire(layer, np.array([e]))
            cache.release()
        cache.preroute(1, np.array([[0, 0, 3, 2, 0]], np.float32))  # predicts {2, 3}
        # One prediction slot: (1, 2) is read into it, nothing the cache keeps is evicted,
        # and (1, 3) finds no slot (the one there is in flight).
        assert cache.prefetches == 1 and cache.evictions == 0
        assert cache.table[1, 2] >= 0 and cache.table[1, 3] < 0
        assert (cache.table[[0, 0, 2], [0, 1, 0]] >= 0).all()
        staged = int(cache.table[1, 2])
        assert cache.staged[staged] and cache.staged.sum() == 1
        got = cache.acquire(1, np.array([2, 4]))  # the prediction used, and a miss
        for e, s in zip((2, 4), got.tolist()):
            assert np.array_equal(cache.slot_bytes(s)[:n], synth.base.blobs[(1, e)])
        cache.release()
        # The miss evicted (0, 0), the least recently used; the prediction joined the cache
        # and (0, 1), the next victim, gave up its slot to be the prediction slot.
        assert cache.promotions == 1 and cache.evictions == 2
        assert cache.table[0, 0] < 0 and cache.table[0, 1] < 0
        assert not cache.staged[staged] and cache.staged.sum() == 1
        assert cache.prefetch_hits == 1
        settle()
        cache.preroute(2, np.array([[0, 0, 0, 3, 0]], np.float32))  # predicts {3, 0}: 0 is in
        assert cache.table[2, 3] >= 0 and cache.prefetches == 2
        settle()
        cache.acquire(2, np.array([0]))  # (2, 3) was not used
        cache.release()
        cache.preroute(0, np.array([[0, 0, 0, 2, 3]], np.float32))  # predicts {3, 4}
        # The unused prediction's slot takes (0, 3) (in expert order); (0, 4) finds none.
        assert cache.table[2, 3] < 0 and cache.table[0, 3] >= 0 and cache.table[0, 4] < 0
        assert cache.stage_dropped == 1 and cache.evictions == 2 and cache.prefetches == 3
        assert (cache.table[[1, 1, 2], [2, 4, 0]] >= 0).all()  # the cache kept its experts
        got = cache.acquire(0, np.array([3]))
        assert np.array_equal(cache.slot_bytes(int(got[0]))[:n], synth.base.blobs[(0, 3)])
        cache.release()
        cache.check()
    finally:
        cache.close()


def test_prefetch_slots_leave_a_layer_its_top_k(synth):
    with pytest.raises(ValueError, match="prefetch_slots"):
        StreamingExpertCache(synth, 4 * 4096 * 3, 2, prefetch_slots=3)
    cache = StreamingExpertCache(synth, 4 * 4096 * 3, 2, io="pread", prefetch_slots=1)
    try:
        cache.pin([(0, 0)])  # 4 slots, 1 set aside: one may be pinned beside a layer's top-2
        with pytest.raises(CacheBudgetError, match="fewer than top-2"):
            cache.pin([(0, 1)])
        assert cache.max_acquire == 2
    finally:
        cache.close()
    every = synth.info.n_layers * synth.info.n_experts * synth.info.expert_slot_nbytes
    cache = StreamingExpertCache(synth, every, 2, prefetch_slots=2)
    assert cache.prefetch_slots == 0  # the budget holds every expert: nothing to evict
    cache.close()


def test_prefetch_width_is_validated(synth):
    with pytest.raises(ValueError, match="width"):
        StreamingExpertCache(synth, 4 * 4096 * 3, 2, width=3)


def test_lookahead_depth_zero_needs_early_routing(synth):
    for depth, early in ((-1, True), (0, False)):
        with pytest.raises(ValueError, match="lookahead"):
            StreamingExpertCache(synth, 4 * 4096 * 3, 2, lookahead=depth, early=early)
    cache = StreamingExpertCache(synth, 4 * 4096 * 3, 2, lookahead=0)
    try:
        cache.set_routers([np.eye(8, 5, dtype=np.float32)] * 3, [np.ones(5, np.float32)] * 3)
        cache.lookahead(0, np.ones((1, 5), np.float32))
        assert not cache._pending and cache.prefetches == 0  # no look-ahead at depth 0
    finally:
        cache.close()


def test_a_prefill_batch_too_wide_for_the_budget_does_not_prefetch(synth):
    """Its predictions would evict one another and the layer's own experts before use."""
    cache = StreamingExpertCache(synth, 4 * 4096 * 3, 2, io="pread", prefetch_evicts=True)
    cache.set_routers([np.eye(8, 5, dtype=np.float32)] * 3, [np.ones(5, np.float32)] * 3)
    try:
        batch = np.eye(3, 5, dtype=np.float32)  # three tokens: up to 6 predictions, 4 slots
        cache.preroute(1, batch)
        cache.lookahead(0, batch)
        assert cache.prefetches == 0 and not cache._pending
        cache.preroute(1, batch[:1])  # one token: its top-2 are read
        assert cache.prefetches == 2
    finally:
        cache.close()


def test_the_cache_names_its_io_path(synth, tmp_path, monkeypatch):
    """No path named and none recorded: buffered pread (the engine names O_DIRECT for a
    model bigger than memory); X-Ray records the path the cache chose."""
    from czyx.inference.xray import XRay

    monkeypatch.setenv(iopaths.CONFIG_ENV, str(tmp_path / "no-config.json"))
    xray = XRay()
    slot = synth.info.expert_slot_nbytes
    cache = StreamingExpertCache(synth, 4 * slot, 2, xray=xray)
    try:
        assert cache.io == "pread" and xray.io_path == "pread"
    finally:
        cache.close()
    named = StreamingExpertCache(synth, 4 * slot, 2, io="mmap", xray=XRay(io_path="mmap"))
    assert named.io == "mmap"
    named.close()
