"""The quantizing mount's pipelined hash pass (MountSource.expert_hashes).

Reading, quantizing and hashing run in three threads; the result must be the
one of the serial pass key by key (same hashes, same spooled bytes, in the same
order), an error in any stage must reach the caller, and no stage thread may
outlive the pass, whether it ends, fails or is abandoned.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from czyx.store.models.checkpoint import Checkpoint
from czyx.store.models.mount_plan import plan_checkpoint
from czyx.store.models.mount_source import MountSource
from czyx.store.quant.codec import QuantCodec
from czyx.store.quant.policy import POLICIES
from czyx.testing.tiny_models import make_tiny_checkpoint

SIZES = dict(hidden_size=64, intermediate_size=64, vocab_size=256)


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ck") / "m"
    return make_tiny_checkpoint("mixtral", path, dtype="bfloat16", **SIZES)


def _source(path, tmp_path) -> tuple[Checkpoint, MountSource, list[tuple[int, int]]]:
    ck = Checkpoint(path)
    plan = plan_checkpoint(ck)
    src = MountSource(ck, plan, QuantCodec(POLICIES["q4-all"]), spool_dir=tmp_path)
    return ck, src, sorted(plan.experts)


def _stage_threads() -> int:
    return threading.active_count()


def test_pipelined_hashes_and_spool_are_the_serial_ones(bf16_ckpt, tmp_path):
    ck, serial, keys = _source(bf16_ckpt, tmp_path)
    with ck, serial:
        want = {k: serial.expert_hash(k) for k in keys}
        want_bytes = {}
        for k in keys:
            serial.assemble(k, serial.buf)
            want_bytes[k] = serial.buf.copy()
    ck, piped, _ = _source(bf16_ckpt, tmp_path)
    before = _stage_threads()
    with ck, piped:
        got = list(piped.expert_hashes(keys))
        assert [k for k, _ in got] == keys
        assert dict(got) == want
        for k in keys:  # the write pass reads the spool: the same bytes
            piped.assemble(k, piped.buf)
            np.testing.assert_array_equal(piped.buf, want_bytes[k])
    assert _stage_threads() == before


def test_a_failing_stage_reaches_the_caller_and_stops_the_others(bf16_ckpt, tmp_path, monkeypatch):
    ck, src, keys = _source(bf16_ckpt, tmp_path)
    real = QuantCodec.encode_expert_raw

    def fail_on_third(self, layout, layer, expert, *a, **k):
        if (layer, expert) == keys[2]:
            raise RuntimeError("injected quantizer failure")
        return real(self, layout, layer, expert, *a, **k)

    monkeypatch.setattr(QuantCodec, "encode_expert_raw", fail_on_third)
    before = _stage_threads()
    with ck, src:
        seen = []
        with pytest.raises(RuntimeError, match="injected"):
            for k, _ in src.expert_hashes(keys):
                seen.append(k)
        assert seen == keys[:2]
    assert _stage_threads() == before


def test_a_read_error_reaches_the_caller(bf16_ckpt, tmp_path, monkeypatch):
    ck, src, keys = _source(bf16_ckpt, tmp_path)

    def broken(self, key, raw):
        raise OSError("injected read failure")

    monkeypatch.setattr(MountSource, "_read_source", broken)
    before = _stage_threads()
    with ck, src, pytest.raises(OSError, match="injected read"):
        list(src.expert_hashes(keys))
    assert _stage_threads() == before


def test_an_abandoned_pass_stops_its_threads(bf16_ckpt, tmp_path):
    ck, src, keys = _source(bf16_ckpt, tmp_path)
    before = _stage_threads()
    with ck, src:
        it = src.expert_hashes(keys)
        next(it)
        it.close()
    assert _stage_threads() == before


@pytest.mark.parametrize("chunk", [4096, 1 << 20])
def test_spool_entries_read_back_exactly(tmp_path, chunk):
    """Odd sizes, entries larger than the bounce buffer, empty ones: the bytes come back."""
    from czyx.store.models.mount_source import Spool

    rng = np.random.default_rng(4)
    sizes = [1, 4095, 4096, 4097, 3 * chunk + 17, 0, 12345]
    entries = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    sp = Spool(tmp_path, chunk=chunk)
    try:
        offs = [sp.append(e) for e in entries]
        assert all(o % sp.align == 0 for o in offs)
        for o, e in reversed(list(zip(offs, entries))):
            got = np.full(e.size, 7, np.uint8)
            sp.read(o, got)
            np.testing.assert_array_equal(got, e)
    finally:
        sp.close()


def test_spool_falls_back_to_buffered_io(tmp_path, monkeypatch):
    """A file system that refuses O_DIRECT at open leaves an ordinary buffered spool."""
    import os

    from czyx.store.models import mount_source

    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(mount_source.os, "open", no_direct)
    sp = mount_source.Spool(tmp_path)
    try:
        assert not sp.direct
        data = np.arange(10000, dtype=np.uint32).view(np.uint8)
        off = sp.append(data)
        got = np.empty_like(data)
        sp.read(off, got)
        np.testing.assert_array_equal(got, data)
    finally:
        sp.close()
