"""The native read pool: C reader threads, priorities, completion, typed failures."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from czyx.store.core.checksum import checksum
from czyx.store.errors import ShortReadError
from czyx.store.io import iopaths, readpool
from czyx.store.io.iopaths import StaleSourceError, open_source
from czyx.store.io.reader import aligned_empty

pytestmark = pytest.mark.skipif(
    not readpool.available(), reason="tests/test_native_built.py fails when the C build is missing"
)
SIZE = 64 * 4096
PATHS = [p for p, why in iopaths.available_paths().items() if why == "available"]


@pytest.fixture
def datafile(tmp_path):
    p = tmp_path / "data.bin"
    data = np.random.default_rng(3).integers(0, 255, SIZE, dtype=np.uint8)
    p.write_bytes(data.tobytes())
    return p, data


def _pool(path, kind="pread", jobs=8, threads=2):
    src = open_source(kind, path)
    pool = readpool.ReadPool(jobs, threads)
    return pool, src, pool.add_source(src)


@pytest.mark.parametrize("kind", PATHS)
@pytest.mark.parametrize("threads", [1, 2, 8])
def test_reads_land_in_their_destination(datafile, kind, threads):
    path, data = datafile
    pool, src, i = _pool(path, kind, threads=threads)
    dest = aligned_empty(8 * 8192).reshape(8, 8192)
    try:
        seqs = [pool.submit(j, i, j * 8192, 5000 + j, dest[j]) for j in range(8)]
        for j, seq in enumerate(seqs):
            pool.wait(j)
            assert pool.done(j, seq)
            t = pool.result(j)
            assert t.nbytes >= 5000 + j and t.start_ns <= t.done_ns
            assert np.array_equal(dest[j][: 5000 + j], data[j * 8192 : j * 8192 + 5000 + j])
    finally:
        pool.close()
        src.close()


def test_demand_reads_overtake_queued_prefetches(datafile):
    path, _ = datafile
    pool, src, i = _pool(path, threads=1)
    dest = aligned_empty(4 * 4096).reshape(4, 4096)
    try:
        pool.pause(True)  # everything queues
        pool.submit(0, i, 0, 4096, dest[0], priority=2, demand=False)
        pool.submit(1, i, 4096, 4096, dest[1], priority=1, demand=False)
        pool.submit(2, i, 8192, 4096, dest[2], priority=0, demand=True)
        pool.submit(3, i, 12288, 4096, dest[3], priority=1, demand=False)
        pool.pause(False)
        for j in range(4):
            while not pool.done(j, pool._jobs[j].seq):
                threading.Event().wait(0.001)  # not wait(): it would run a queued job here
        order = sorted(range(4), key=lambda j: pool.result(j).start_ns)
        assert order == [2, 1, 3, 0]  # demand; then priority, then submission order
    finally:
        pool.close()
        src.close()


def test_a_waiter_blocks_while_paused_and_a_busy_job_is_refused(datafile):
    path, data = datafile
    pool, src, i = _pool(path, jobs=2, threads=1)
    dest = aligned_empty(2 * 4096).reshape(2, 4096)
    try:
        pool.pause(True)
        seq = pool.submit(0, i, 4096, 4096, dest[0])
        assert not pool.done(0, seq)
        with pytest.raises(readpool.StoreError, match="cannot be submitted"):
            pool.submit(0, i, 0, 4096, dest[0])  # still queued
        threading.Timer(0.05, pool.pause, (False,)).start()
        pool.wait(0)
        assert pool.done(0, seq) and np.array_equal(dest[0], data[4096:8192])
        with pytest.raises(readpool.StoreError, match="never submitted"):
            pool.wait(1)
        seq2 = pool.submit(0, i, 0, 4096, dest[0])  # done: reusable
        assert pool.done(0, seq)  # the old submission was superseded
        pool.wait(0)
        assert pool.done(0, seq2) and np.array_equal(dest[0], data[:4096])
    finally:
        pool.close()
        src.close()


@pytest.mark.parametrize("kind", PATHS)
def test_short_stale_and_rewritten_sources_fail_typed(datafile, kind, tmp_path):
    path, _ = datafile
    pool, src, i = _pool(path, kind)
    dest = aligned_empty(4096)
    try:
        os.truncate(path, SIZE - 100)  # loses its tail: a short read first
        pool.submit(0, i, SIZE - 4096, 4096, dest)
        pool.wait(0)
        with pytest.raises(ShortReadError):
            pool.result(0)
        pool.submit(0, i, 0, 4096, dest)  # complete, but the file was rewritten
        pool.wait(0)
        with pytest.raises(StaleSourceError, match="rewritten"):
            pool.result(0)
        other = tmp_path / "other.bin"
        other.write_bytes(b"\x01" * SIZE)
        os.replace(other, path)  # the path now names another inode
        pool.submit(0, i, 0, 4096, dest)
        pool.wait(0)
        with pytest.raises(StaleSourceError):
            pool.result(0)
    finally:
        pool.close()
        src.close()


def test_readers_hash_what_they_read_where_asked(datafile):
    """A read submitted with a hash length is hashed by its reader (the store's checksum);
    one without, or one that failed, carries no hash."""
    path, data = datafile
    pool, src, i = _pool(path, jobs=3)
    dest = aligned_empty(3 * 8192).reshape(3, 8192)
    try:
        assert pool.hashes
        pool.submit(0, i, 4096, 5000, dest[0], hash_len=5000)
        pool.submit(1, i, 4096, 5000, dest[1])
        pool.submit(2, i, SIZE - 100, 4096, dest[2], hash_len=4096)  # short: no hash
        for j in range(3):
            pool.wait(j)
        assert pool.hashed(0) == checksum(data[4096:9096])
        assert pool.hashed(1) is None
        assert pool.hashed(2) is None
        with pytest.raises(ShortReadError):
            pool.result(2)
    finally:
        pool.close()
        src.close()


def test_a_direct_destination_must_be_aligned(datafile):
    path, data = datafile
    pool, src, i = _pool(path, "direct", jobs=3)
    try:
        buf = aligned_empty(4 * 4096)
        with pytest.raises(iopaths.AlignmentError):
            pool.submit(0, i, 0, 4096, buf[1:4097])
        # Registered destinations: the same checks, by arithmetic, at each submit.
        pool.set_buffers([buf[:8192], buf[8193 : 8193 + 4096], buf[12288 : 12288 + 100]])
        pool.submit(0, i, 4096, 5000)  # rounded up to 8192: fits
        pool.wait(0)
        pool.result(0)
        assert np.array_equal(buf[:5000], data[4096:9096])
        with pytest.raises(iopaths.AlignmentError, match="multiples"):
            pool.submit(1, i, 0, 4096)  # misaligned address
        with pytest.raises(iopaths.AlignmentError, match="multiples"):
            pool.submit(0, i, 100, 4096)  # misaligned offset
        with pytest.raises(iopaths.AlignmentError, match="does not fit"):
            pool.submit(2, i, 0, 100)  # 4096 after rounding, in 100 bytes
        with pytest.raises(ValueError, match="3 jobs"):
            pool.set_buffers([buf])
    finally:
        pool.close()
        src.close()


@given(
    reqs=st.lists(
        st.tuples(st.integers(0, SIZE - 1), st.integers(1, 3 * 4096)), min_size=1, max_size=6
    )
)
@settings(max_examples=30)
def test_for_all_requests_the_bytes_are_the_files(datafile_module, reqs):
    _path, data, pool, i = datafile_module
    dest = aligned_empty(len(reqs) * 3 * 4096).reshape(len(reqs), -1)
    for j, (off, n) in enumerate(reqs):
        pool.submit(j, i, off, n, dest[j])
    for j, (off, n) in enumerate(reqs):
        pool.wait(j)
        want = data[off : off + n]
        if len(want) < n:
            with pytest.raises(ShortReadError):
                pool.result(j)
        else:
            pool.result(j)
            assert np.array_equal(dest[j][:n], want)


@pytest.fixture(scope="module")
def datafile_module(tmp_path_factory):
    p = tmp_path_factory.mktemp("pool") / "data.bin"
    data = np.random.default_rng(4).integers(0, 255, SIZE, dtype=np.uint8)
    p.write_bytes(data.tobytes())
    src = open_source("pread", p)
    pool = readpool.ReadPool(6, 2)
    i = pool.add_source(src)
    yield p, data, pool, i
    pool.close()
    src.close()
