"""The raw reader: C and Python backends give identical bytes; faults raise typed errors."""

from __future__ import annotations

import errno
import os
import pathlib
import threading
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import czyx.store.io.reader as reader_mod
from czyx.store.core.checksum import checksum
from czyx.store.core.records import Extent
from czyx.store.errors import ChecksumError, ReadIOError, ShortReadError, StoreError
from czyx.store.io.reader import RawReader, aligned_empty, c_available, read_extent_verified

BACKENDS = [
    "python",
    pytest.param(
        "c",
        marks=pytest.mark.skipif(
            not c_available(), reason="C reader not built (python setup.py build_ext --inplace)"
        ),
    ),
]
FILE_SIZE = 5 * 4096 + 123  # deliberately not aligned: exercises the direct-I/O tail


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, bytes]:
    p = tmp_path_factory.mktemp("reader") / "blob"
    data = np.random.default_rng(0).integers(0, 256, FILE_SIZE, dtype=np.uint8).tobytes()
    p.write_bytes(data)
    return p, data


def test_c_reader_is_built() -> None:
    # The package build compiles it; a missing build must be visible, not silently slow.
    assert c_available(), f"store._reader missing: {reader_mod._C_IMPORT_ERROR}"


MODES = {"buffered": {}, "direct": {"direct": True}, "mapped": {"mapped": True}}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", list(MODES))
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    off=st.integers(0, FILE_SIZE),
    n=st.integers(0, 3 * 4096 + 7),
    aligned_off=st.booleans(),
    buf_shift=st.sampled_from([0, 1, 512]),
)
def test_read_into_matches_file(
    data_file, backend: str, mode: str, off: int, n: int, aligned_off: bool, buf_shift: int
) -> None:
    path, data = data_file
    if aligned_off:
        off = off // 4096 * 4096
    arena = aligned_empty(n + buf_shift)
    buf = arena[buf_shift : buf_shift + n]
    with RawReader(path, backend=backend, **MODES[mode]) as rd:
        if off + n <= len(data):
            rd.read_into(off, buf)
            assert buf.tobytes() == data[off : off + n]
        else:
            with pytest.raises(ShortReadError) as ei:
                rd.read_into(off, buf)
            assert ei.value.offset == off and ei.value.got == len(data) - off
            assert str(path) in str(ei.value)


@pytest.mark.parametrize("mode", list(MODES))
def test_backends_agree_on_read_many(data_file, mode: str) -> None:
    path, data = data_file
    rng = np.random.default_rng(1)
    reqs = [
        (int(o), int(n)) for o, n in zip(rng.integers(0, 4 * 4096, 40), rng.integers(0, 5000, 40))
    ]
    reqs += [(4096, 4096), (0, 8192), (8192, 3 * 4096)]  # whole aligned blocks: pure O_DIRECT
    outs = {}
    for backend in ("python", "c") if c_available() else ("python",):
        bufs = [aligned_empty(n) for _, n in reqs]
        with RawReader(path, backend=backend, **MODES[mode]) as rd:
            rd.read_many([(o, n, b) for (o, n), b in zip(reqs, bufs)])
        outs[backend] = [b.tobytes() for b in bufs]
        assert outs[backend] == [data[o : o + n] for o, n in reqs]
    assert len(set(map(tuple, outs.values()))) == 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", list(MODES))
def test_read_many_stops_at_first_bad_extent(data_file, backend: str, mode: str) -> None:
    path, data = data_file
    good, bad = bytearray(10), bytearray(100)
    rd = RawReader(path, backend=backend, **MODES[mode])
    with rd, pytest.raises(ShortReadError) as ei:
        rd.read_many([(0, 10, good), (len(data) - 50, 100, bad)])
    assert bytes(good) == data[:10]
    assert ei.value.offset == len(data) - 50 and ei.value.got == 50
    with RawReader(path, backend=backend) as rd, pytest.raises(ValueError):
        rd.read_many([(0, 11, good)])  # longer than its buffer


@pytest.mark.parametrize("backend", BACKENDS)
def test_os_error_names_file_offset_errno(tmp_path: pathlib.Path, backend: str) -> None:
    # A directory opens fine but read() gives EISDIR.
    with RawReader(tmp_path, backend=backend) as rd, pytest.raises(ReadIOError) as ei:
        rd.read_into(8192, bytearray(16))
    e = ei.value
    assert e.errno == errno.EISDIR and e.offset == 8192 and e.filename == str(tmp_path)
    assert isinstance(e, OSError) and isinstance(e, StoreError)
    assert "8192" in str(e) and str(tmp_path) in str(e)


def test_missing_file_is_typed(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ReadIOError) as ei:
        RawReader(tmp_path / "nope")
    assert ei.value.errno == errno.ENOENT


@pytest.mark.parametrize("backend", BACKENDS)
def test_rejects_readonly_and_closed(data_file, backend: str) -> None:
    path, _ = data_file
    rd = RawReader(path, backend=backend)
    with pytest.raises(ValueError):
        rd.read_into(0, bytes(4))
    with pytest.raises(ValueError):
        rd.read_into(0, np.zeros((4, 4), np.uint8)[:, ::2])  # not contiguous
    rd.close()
    rd.close()
    with pytest.raises(StoreError):
        rd.read_into(0, bytearray(4))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", list(MODES))
def test_threads_share_a_reader(data_file, backend: str, mode: str) -> None:
    path, data = data_file
    errors = []
    with RawReader(path, backend=backend, **MODES[mode]) as rd:

        def work(seed: int) -> None:
            rng = np.random.default_rng(seed)
            for _ in range(200):
                o = int(rng.integers(0, len(data) - 4096))
                b = aligned_empty(4096)
                rd.read_into(o, b)
                if b.tobytes() != data[o : o + 4096]:
                    errors.append(o)

        ts = [threading.Thread(target=work, args=(s,)) for s in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    assert errors == []


@pytest.mark.parametrize("mode", list(MODES))
def test_read_extent_verified(tmp_path: pathlib.Path, mode: str) -> None:
    payload = os.urandom(5000)
    p = tmp_path / "f"
    p.write_bytes(bytes(4096) + payload + bytes(8192 - 5000))
    rec = Extent(4096, 5000, checksum(payload)).record()
    with RawReader(p, **MODES[mode]) as rd:
        slot = aligned_empty(8192)  # room for the rounded-up O_DIRECT read
        read_extent_verified(rd, rec, slot)
        assert slot[:5000].tobytes() == payload
        exact = aligned_empty(5000)
        read_extent_verified(rd, rec, exact)
        assert exact.tobytes() == payload
        with pytest.raises(ChecksumError, match="offset 4096"):
            read_extent_verified(rd, {**rec, "sum": rec["sum"] ^ 1}, slot)
        with pytest.raises(ValueError):
            read_extent_verified(rd, rec, aligned_empty(4999))
        with pytest.raises(ShortReadError):
            read_extent_verified(rd, {**rec, "off": 8192}, aligned_empty(5000))


@pytest.mark.parametrize("hugepage", [False, True])
@pytest.mark.parametrize("align", [64, 4096, 1 << 16])
def test_aligned_empty(align: int, hugepage: bool) -> None:
    for n in (0, 1, 4096, 3 * (1 << 20) + 5):
        a = aligned_empty(n, align, hugepage=hugepage)
        assert a.dtype == np.uint8 and a.shape == (n,) and a.flags.writeable
        if n:
            addr = a.__array_interface__["data"][0]
            assert addr % align == 0
            if hugepage:
                assert addr % (2 << 20) == 0
            a[:] = 7
            assert int(a.sum()) == 7 * n
    with pytest.raises(ValueError):
        aligned_empty(10, 3000)
    with pytest.raises(ValueError):
        aligned_empty(-1)


def test_fallback_warns_once_and_matches(monkeypatch: pytest.MonkeyPatch, data_file) -> None:
    path, data = data_file
    monkeypatch.setattr(reader_mod, "_c", None)
    monkeypatch.setattr(reader_mod, "_warned", False)
    with pytest.warns(RuntimeWarning, match="os.preadv fallback"):
        rd = RawReader(path)
    assert rd.backend == "python"
    buf = bytearray(100)
    rd.read_into(7, buf)
    assert bytes(buf) == data[7:107]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RawReader(path).close()  # second time: silent
    rd.close()
    with pytest.raises(StoreError):
        RawReader(path, backend="c")


def test_bad_arguments(data_file) -> None:
    path, _ = data_file
    with pytest.raises(ValueError):
        RawReader(path, backend="rust")
    with pytest.raises(ValueError):
        RawReader(path, align=1000)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mapped_reader_edge_cases(tmp_path: pathlib.Path, backend: str) -> None:
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    with RawReader(empty, mapped=True, backend=backend) as rd:
        rd.read_into(0, bytearray(0))
        with pytest.raises(ShortReadError):
            rd.read_into(0, bytearray(1))
    with pytest.raises(ValueError):
        RawReader(empty, mapped=True, direct=True)
    (tmp_path / "f").write_bytes(b"abc")
    with RawReader(tmp_path / "f", mapped=True, backend=backend) as rd:
        with pytest.raises(ReadIOError) as ei:
            rd.read_into(-1, bytearray(1))
        assert ei.value.errno == errno.EINVAL
        with pytest.raises(ShortReadError):
            rd.read_many([(1, 2, bytearray(2)), (2, 5, bytearray(5))])


def test_verified_read_of_an_unpadded_file_in_direct_mode(tmp_path: pathlib.Path) -> None:
    """Rounding the read up to the alignment must not fail on a file that ends unaligned."""
    payload = os.urandom(5000)
    p = tmp_path / "f"
    p.write_bytes(bytes(4096) + payload)  # no padding after the extent
    rec = Extent(4096, 5000, checksum(payload)).record()
    with RawReader(p, direct=True) as rd:
        slot = aligned_empty(8192)
        read_extent_verified(rd, rec, slot)
        assert slot[:5000].tobytes() == payload
        with pytest.raises(ShortReadError):
            read_extent_verified(rd, {**rec, "len": 5001}, slot)


@pytest.mark.parametrize("advice", ["kernel", "refused"])
def test_mapped_reader_with_and_without_huge_page_advice(
    tmp_path: pathlib.Path, monkeypatch, advice: str
) -> None:
    """The populated huge-page mapping and its MAP_POPULATE fallback give the same bytes."""
    if advice == "refused":  # an advice value no kernel accepts: madvise fails with EINVAL
        monkeypatch.setattr(reader_mod, "_MADV_POPULATE_READ", 0x7FFF)
    payload = os.urandom(3 * 4096 + 17)
    p = tmp_path / "f"
    p.write_bytes(payload)
    with RawReader(p, mapped=True) as rd:
        buf = bytearray(len(payload) - 5)
        rd.read_into(5, buf)
        assert bytes(buf) == payload[5:]
        with pytest.raises(ShortReadError):
            rd.read_into(6, bytearray(len(payload)))
