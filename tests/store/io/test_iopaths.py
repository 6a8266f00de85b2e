"""Transfer sources: same bytes on every path, typed failures, staleness, the io_uring probe."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from czyx.store.errors import ShortReadError, StoreError
from czyx.store.io import iopaths as io
from czyx.store.io.reader import aligned_empty

SIZE = 64 * 4096
PATHS = [p for p, why in io.available_paths().items() if why == "available"]


@pytest.fixture(scope="module")
def datafile(tmp_path_factory):
    p = tmp_path_factory.mktemp("io") / "data.bin"
    data = np.random.default_rng(1).integers(0, 255, SIZE, dtype=np.uint8)
    p.write_bytes(data.tobytes())
    return p, data


def test_the_three_portable_paths_are_available():
    assert {"pread", "mmap", "direct"} <= set(PATHS)


@pytest.mark.parametrize("kind", PATHS)
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(block=st.integers(0, 63), length=st.integers(1, 5 * 4096))
def test_every_path_reads_exactly_the_files_bytes(datafile, kind, block, length):
    path, data = datafile
    offset = block * 4096
    length = min(length, SIZE - offset)
    with io.open_source(kind, path) as src:
        dest = aligned_empty(-(-length // 4096) * 4096)
        dest[:] = 0xAB
        t = src.read_into(offset, length, dest)
        assert np.array_equal(dest[:length], data[offset : offset + length])
        assert t.nbytes >= length and t.done_ns >= t.start_ns
        assert t.first_ns is None or t.start_ns <= t.first_ns <= t.done_ns


@pytest.mark.parametrize("kind", PATHS)
def test_reading_past_end_of_file_is_a_short_read(datafile, kind):
    path, _ = datafile
    with io.open_source(kind, path) as src:
        dest = aligned_empty(3 * 4096)
        with pytest.raises(ShortReadError) as ei:
            src.read_into(SIZE - 4096, 3 * 4096, dest)
        assert ei.value.offset == SIZE - 4096 and ei.value.got == 4096


@pytest.mark.parametrize("kind", [p for p in PATHS if p in ("direct", "io_uring")])
def test_direct_paths_refuse_misalignment_and_small_destinations(datafile, kind):
    path, _ = datafile
    with io.open_source(kind, path) as src:
        buf = aligned_empty(3 * 4096)
        with pytest.raises(io.AlignmentError, match="multiples of 4096"):
            src.read_into(100, 4096, buf)
        with pytest.raises(io.AlignmentError, match="multiples of 4096"):
            src.read_into(0, 4096, buf[8 : 8 + 4096])
        with pytest.raises(io.AlignmentError, match="does not fit"):
            src.read_into(0, 4097, buf[:4096])


@pytest.mark.parametrize("kind", PATHS)
@pytest.mark.parametrize("fault", ["replaced", "rewritten", "truncated", "removed"])
def test_a_changed_file_is_stale(tmp_path, kind, fault):
    p = tmp_path / "f.bin"
    p.write_bytes(os.urandom(8 * 4096))
    with io.open_source(kind, p) as src:
        src.check_identity()
        if fault == "replaced":
            q = tmp_path / "g.bin"
            q.write_bytes(os.urandom(8 * 4096))
            os.replace(q, p)
        elif fault == "rewritten":
            time.sleep(0.01)
            with open(p, "r+b") as f:
                f.write(b"generation changed")
            st = os.stat(p)
            os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
        elif fault == "truncated":
            os.truncate(p, 4 * 4096)
        else:
            p.unlink()
        with pytest.raises(io.StaleSourceError, match="stale"):
            src.check_identity()


def test_mmap_of_a_truncated_file_is_a_short_read_not_a_crash(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(os.urandom(8 * 4096))
    with io.open_source("mmap", p) as src:
        os.truncate(p, 2 * 4096)
        with pytest.raises(ShortReadError):
            src.read_into(4 * 4096, 4096, aligned_empty(4096))


def test_io_uring_probe_reports_why_it_is_unavailable():
    ok, why = io.probe_io_uring(0)  # io_uring_setup refuses zero entries: EINVAL
    assert not ok and "errno 22" in why
    ok, why = io.probe_io_uring()
    assert ok == ("io_uring" in PATHS)
    assert why


@pytest.mark.skipif("io_uring" not in PATHS, reason="io_uring refused by this kernel")
def test_io_uring_batch_reads_at_queue_depth(datafile):
    path, data = datafile
    with io.open_source("io_uring", path, queue_depth=4) as src:
        bufs = [aligned_empty(2 * 4096) for _ in range(10)]
        reqs = [(i * 5 * 4096, 2 * 4096 - 7 * (i % 2), bufs[i]) for i in range(10)]
        out = src.read_many(reqs)
        assert len(out) == 10
        for off, n, b in reqs:
            assert np.array_equal(b[:n], data[off : off + n])
        with pytest.raises(ShortReadError):
            src.read_many([(0, 4096, bufs[0]), (SIZE, 4096, bufs[1])])


def test_python_fallbacks_read_the_same_bytes(datafile, monkeypatch):
    path, data = datafile
    monkeypatch.setattr(io, "_c", None)
    monkeypatch.setattr(io, "_warned", False)
    with pytest.warns(RuntimeWarning, match="C transfer kernels unavailable"):
        io.open_source("pread", path).close()
    assert not io.probe_io_uring()[0]
    with pytest.raises(io.IOPathUnavailableError, match="not built"):
        io.open_source("io_uring", path)
    for kind in ("pread", "mmap", "direct"):
        with io.open_source(kind, path) as src:
            dest = aligned_empty(2 * 4096)
            src.read_into(4096, 5000, dest)
            assert np.array_equal(dest[:5000], data[4096:9096])
            with pytest.raises(ShortReadError):
                src.read_into(SIZE - 4096, 8192, dest)


def test_config_round_trip_and_fail_closed(tmp_path, monkeypatch):
    cfg_path = tmp_path / "io.json"
    monkeypatch.setenv(io.CONFIG_ENV, str(cfg_path))
    assert io.load_io_config() is None and io.default_io_path() == "pread"
    cfg = io.IOConfig("direct", 2.5e9, 1 << 20, {"direct": 2.5e9}, {}, "test machine")
    io.save_io_config(cfg)
    assert io.load_io_config() == cfg and io.default_io_path() == "direct"
    cfg_path.write_text('{"path": "warp"}')
    with pytest.raises(StoreError, match="malformed"):
        io.load_io_config()
    with pytest.raises(ValueError, match="not one of"):
        io.open_source("warp", cfg_path)


def test_default_path_without_a_recorded_one(tmp_path, monkeypatch):
    """O_DIRECT only where the caller prefers it and the file opens with it; a recorded
    winner still decides; a missing file never opens direct."""
    monkeypatch.setenv(io.CONFIG_ENV, str(tmp_path / "io.json"))
    f = tmp_path / "block"
    f.write_bytes(bytes(2 * 4096))
    direct = io.accepts_direct(f)
    assert io.default_io_path(prefer_direct=True, probe=f) == ("direct" if direct else "pread")
    assert io.default_io_path(prefer_direct=False, probe=f) == "pread"
    assert io.default_io_path(prefer_direct=True) == "pread"  # nothing to probe
    assert not io.accepts_direct(tmp_path / "missing")
    monkeypatch.setattr(io, "accepts_direct", lambda path: False)  # a filesystem that refuses
    assert io.default_io_path(prefer_direct=True, probe=f) == "pread"
    io.save_io_config(io.IOConfig("mmap", 1e9, 1 << 20, {"mmap": 1e9}, {}, "test machine"))
    assert io.default_io_path(prefer_direct=True, probe=f) == "mmap"
    assert io.default_io_path() == "mmap"
