"""The store's expert-read interface (submit / wait / check) on both reader kinds."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest

from czyx.store.errors import ChecksumError
from czyx.store.io import readpool
from czyx.store.io.experts import ExpertExtentError, ExpertReads, open_expert_reads
from czyx.store.io.reader import aligned_empty
from czyx.testing.filemodel import FileConsumer, SyntheticExperts


@pytest.fixture
def fc(tmp_path):
    with contextlib.closing(FileConsumer(SyntheticExperts(), tmp_path)) as c:
        yield c


def _slots(consumer, n):
    return list(aligned_empty(n * consumer.info.expert_slot_nbytes).reshape(n, -1))


@pytest.mark.parametrize("native", [True, False])
def test_submit_wait_check_lands_verified_bytes(fc, native):
    if native and not readpool.available():
        pytest.fail("store._iopaths is not built: the native read pool cannot run")
    slots = _slots(fc, 3)
    with open_expert_reads(fc, slots, readers=2, native=native, io="pread") as er:
        assert er.kind == ("native" if native else "threads")
        reads = [er.submit(2, e, e, priority=e, demand=e == 0) for e in range(3)]
        for e, r in enumerate(reads):
            er.wait(r)
            assert er.done(r)
            er.check(r)
            n = fc.info.expert_nbytes
            assert np.array_equal(slots[e][:n], fc.base.blobs[(2, e)])
            assert r.checksum_result == "ok" and r.source == "pread" and r.completed_bytes == n
            assert (r.read_hash is not None) == native  # the C readers hash what they read
        assert [s.name for s in er.opened_sources()] == ["pread"]


@pytest.mark.parametrize(("native", "in_readers"), [(True, True), (True, False), (False, True)])
def test_a_rotten_extent_is_a_checksum_error_at_check(fc, native, in_readers, monkeypatch):
    monkeypatch.setattr(ExpertReads, "hash_in_readers", in_readers)
    if native and not readpool.available():
        pytest.fail("store._iopaths is not built: the native read pool cannot run")
    st = os.stat(fc.path)
    with open(fc.path, "r+b") as f:
        f.seek(int(fc.off[1, 3]) + 5)
        f.write(b"\x00\xff")
    os.utime(fc.path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with open_expert_reads(fc, _slots(fc, 1), readers=1, native=native, io="pread") as er:
        r = er.submit(1, 3, 0)
        er.wait(r)
        assert (r.read_hash is not None) == (native and in_readers)
        with pytest.raises(ChecksumError, match="checksum"):
            er.check(r)
        assert r.checksum_result == "mismatch"


def test_extents_that_do_not_exist_or_fit_are_refused(fc):
    small = [s[:4096] for s in _slots(fc, 1)]
    with (
        open_expert_reads(fc, small, io="pread") as er,
        pytest.raises(ExpertExtentError, match="does not fit"),
    ):
        er.submit(0, 0, 0)  # a 12 KiB extent, a 4 KiB slot
    fc.off[0, 1] = -1
    with (
        open_expert_reads(fc, _slots(fc, 1), io="pread") as er,
        pytest.raises(ExpertExtentError, match="no extent"),
    ):
        er.submit(0, 1, 0)


def test_a_consumer_without_files_is_read_through_read_expert(fc):
    class Plain:  # a wrapper: no open_expert_reads, so no block files handed over
        info = fc.info

        def expert_extent(self, layer, cls):
            return fc.expert_extent(layer, cls)  # block 0 of fc's, which Plain does not own

        def read_expert(self, layer, cls, slot):
            fc.read_expert(layer, cls, slot)

    slots = _slots(fc, 1)
    er = open_expert_reads(Plain(), slots)
    try:
        assert isinstance(er, ExpertReads) and er.kind == "threads"
        r = er.submit(0, 4, 0)
        er.wait(r)
        er.check(r)
        assert r.checksum_result == "consumer" and r.source == "consumer"
        assert np.array_equal(slots[0][: fc.info.expert_nbytes], fc.base.blobs[(0, 4)])
    finally:
        er.close()
