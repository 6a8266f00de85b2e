"""The synthetic file-backed Mixtral: a real block file the engine and planner can run on."""

from __future__ import annotations

import numpy as np
import pytest

from czyx.inference import synthetic
from czyx.inference.engine import Engine
from czyx.inference.streaming import StreamingExpertCache
from czyx.store.errors import ChecksumError


def test_synthetic_model_runs_and_verifies(tmp_path):
    m = synthetic.create(tmp_path, hidden=32, inter=48, layers=2, experts=4, vocab=64)
    try:
        assert m.expert_file_bytes == 2 * 4 * 3 * 32 * 48 * 4
        sums = {int(m.sums[la, e]) for la in range(2) for e in range(4)}
        assert len(sums) == 8  # every extent differs
        eng = Engine(m)
        logits = eng.prefill([1, 2, 3])
        assert logits.shape == (64,) and np.isfinite(logits).all()
        slot = np.zeros(m.info.expert_slot_nbytes, np.uint8)
        m.read_expert(1, 3, slot)
        with open(m.path, "r+b") as f:
            f.seek(int(m.off[1, 3]))
            f.write(b"\xff\xff\xff\xff")
        with pytest.raises(ChecksumError):
            m.read_expert(1, 3, slot)
        eng.close()
    finally:
        m.close()


def test_streaming_cache_reads_the_block_file_directly(tmp_path):
    m = synthetic.create(tmp_path, hidden=32, inter=48, layers=2, experts=4, vocab=64)
    cache = StreamingExpertCache(m, 4 * m.info.expert_slot_nbytes, 2, io="direct", readers=2)
    try:
        assert not cache.planner.reads.opened_sources()  # extents resolve on first use
        s = cache.acquire(1, np.array([2]))[0]
        assert [src.name for src in cache.planner.reads.opened_sources()] == ["direct"]
        want = np.zeros(m.info.expert_slot_nbytes, np.uint8)
        m.read_expert(1, 2, want)
        n = m.info.expert_nbytes
        assert np.array_equal(cache.slot_bytes(int(s))[:n], want[:n])
        cache.release()
    finally:
        cache.close()
        m.close()


def test_float16_experts_stream_bit_identically_to_resident(tmp_path):
    m = synthetic.create(tmp_path, hidden=32, inter=48, layers=2, experts=4, vocab=64, dtype="f16")
    try:
        assert m.info.expert_format == "f16" and m.expert_file_bytes == 2 * 4 * 3 * 32 * 48 * 2
        gate, up, down = m.expert_views(np.zeros(m.info.expert_slot_nbytes, np.uint8))
        assert gate.dtype == up.dtype == np.float16 and down.shape == (32, 48)
        full = Engine(m)
        want = full.prefill([1, 2, 3])
        full.close()
        tight = Engine(m, cache_bytes=2 * m.info.expert_slot_nbytes)
        assert np.array_equal(tight.prefill([1, 2, 3]), want) and np.isfinite(want).all()
        tight.close()
        with pytest.raises(ValueError, match="dtype"):
            synthetic.create(tmp_path / "x", dtype="f8")
    finally:
        m.close()
