"""Bad input and on-disk faults: each raises a typed store error; nothing half-published."""

from __future__ import annotations

import os
import pathlib

import msgpack
import numpy as np
import pytest

from czyx.key import Key
from czyx.space import Selector
from czyx.store import (
    BlockFileError,
    ChecksumError,
    KeyLengthError,
    RecordDecodeError,
    SealedSpaceError,
    ShortReadError,
    Store,
    aligned_empty,
    read_extent_verified,
)


@pytest.fixture
def store(tmp_path: pathlib.Path):
    s = Store.open(tmp_path / "s")
    yield s
    s.close()


def publish(store: Store, name: str = "m", n: int = 4) -> tuple[Selector, dict[bytes, bytes]]:
    sp = Selector.from_name(name)
    rng = np.random.default_rng(len(name))
    out = {}
    with store.begin_space(sp, {"name": name}) as w:
        for i in range(n):
            data = rng.integers(0, 256, 3000 + 4096 * i, dtype=np.uint8).tobytes()
            k = Key(i, 0, 0, i).pack()
            w.put(k, w.write_extent(data).record())
            out[k] = data
    return sp, out


def test_missing_block_file(store: Store) -> None:
    sp, _ = publish(store)
    store.block_path(sp).unlink()
    with pytest.raises(BlockFileError, match="missing"):
        store.open_reader(sp)


def test_truncated_block_file(store: Store) -> None:
    sp, _ = publish(store)
    p = store.block_path(sp)
    os.truncate(p, p.stat().st_size - 4096)
    with pytest.raises(BlockFileError, match="truncated"):
        store.open_reader(sp)
    os.truncate(p, 100)  # even the header is cut
    with pytest.raises(BlockFileError):
        store.verify_space(sp)


def test_replaced_block_file_is_stale(store: Store) -> None:
    """Same name, same size, same selector: only the generation tells them apart."""
    sp, _ = publish(store, "a")
    p = store.block_path(sp)
    original = p.read_bytes()
    store.verify_space(sp)
    # A second publication of the same content gets its own generation.
    other = Store.open(store.path.parent / "other")
    sp2, _ = publish(other, "a")
    replacement = other.block_path(sp2).read_bytes()
    other.close()
    assert sp2 == sp and len(replacement) == len(original) and replacement != original
    p.write_bytes(replacement)
    with pytest.raises(BlockFileError, match="stale"):
        store.open_reader(sp)
    p.write_bytes(original + bytes(4096))  # grown after sealing
    with pytest.raises(BlockFileError, match="stale"):
        store.open_reader(sp)
    p.write_bytes(b"\x00" * len(original))  # not a block file at all
    with pytest.raises(BlockFileError, match="not a czyx block file"):
        store.open_reader(sp)


def test_corrupt_header_checksum(store: Store) -> None:
    sp, _ = publish(store)
    p = store.block_path(sp)
    raw = bytearray(p.read_bytes())
    raw[60] ^= 0x01  # inside the generation field
    p.write_bytes(bytes(raw))
    with pytest.raises(BlockFileError, match="header checksum"):
        store.verify_space(sp)


def test_extent_past_end_of_file(store: Store) -> None:
    sp, payloads = publish(store)
    k = sorted(payloads)[-1]
    rec = store.get(sp, k)
    with store.open_reader(sp) as rd:  # verified, then the file shrinks under us
        os.truncate(store.block_path(sp), rec["off"] + 10)
        with pytest.raises(ShortReadError) as ei:
            read_extent_verified(rd, rec, aligned_empty(rec["len"]))
    assert ei.value.offset == rec["off"] and ei.value.got == 10


def test_checksum_mismatch(store: Store) -> None:
    sp, payloads = publish(store)
    k = sorted(payloads)[1]
    rec = store.get(sp, k)
    with open(store.block_path(sp), "r+b") as f:
        f.seek(rec["off"] + rec["len"] // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x80]))
    store.verify_space(sp)  # size and header are intact: only the checksum can tell
    with store.open_reader(sp) as rd, pytest.raises(ChecksumError, match=str(rec["off"])):
        read_extent_verified(rd, rec, aligned_empty(rec["len"]))
    for other in sorted(payloads)[:1] + sorted(payloads)[2:]:  # neighbours unaffected
        r = store.get(sp, other)
        buf = aligned_empty(r["len"])
        with store.open_reader(sp) as rd:
            read_extent_verified(rd, r, buf)
        assert buf.tobytes() == payloads[other]


@pytest.mark.parametrize(
    "raw", [b"\xc1", b"\x92\x01", msgpack.packb(7), msgpack.packb({"a": 1})[:-1]]
)
def test_undecodable_record(store: Store, raw: bytes) -> None:
    sp = Selector.from_name("g")
    k = Key(5).pack()
    store.put(sp, Key(4).pack(), {"ok": True})
    with store._env.begin(write=True) as txn:  # corrupt the value behind the API's back
        txn.put(sp.raw + k, raw, db=store._records)
    with pytest.raises(RecordDecodeError, match=(sp.raw + k).hex()):
        store.get(sp, k)
    with pytest.raises(RecordDecodeError, match=(sp.raw + k).hex()):
        list(store.scan(sp))
    with store.snapshot() as snap, pytest.raises(RecordDecodeError, match=(sp.raw + k).hex()):
        list(snap.scan(sp))
    assert store.get(sp, Key(4).pack()) == {"ok": True}


def test_undecodable_manifest_entry(store: Store) -> None:
    sp, _ = publish(store)
    with store._env.begin(write=True) as txn:
        txn.put(sp.raw, b"\xc1", db=store._spaces)
    with pytest.raises(RecordDecodeError):
        store.manifest(sp)


def test_unencodable_record_is_refused_before_writing(store: Store) -> None:
    sp = Selector.from_name("g")
    with pytest.raises(TypeError):
        store.put(sp, Key(1).pack(), {"x": object()})
    with pytest.raises(TypeError):
        store.put_many(sp, [(Key(1).pack(), {"a": 1}), (Key(2).pack(), {"x": object()})])
    assert list(store.scan(sp)) == []
    with pytest.raises(TypeError):
        store.begin_space(sp, {"x": object()})


def test_writer_key_length_and_extent_bounds(store: Store) -> None:
    sp = Selector.from_name("w")
    with store.begin_space(sp, {}) as w:
        ext = w.write_extent(b"x" * 10)
        with pytest.raises(KeyLengthError):
            w.put(b"short", ext.record())
        with pytest.raises(ValueError, match="past"):
            w.put(Key(1).pack(), {"off": ext.offset, "len": 5000})
        w.put(Key(1).pack(), ext.record())
    assert store.aggregate(sp) == (1, 10)


def test_writer_refuses_use_after_commit(store: Store) -> None:
    sp = Selector.from_name("w")
    w = store.begin_space(sp, {})
    w.commit()
    with pytest.raises(Exception, match="committed"):
        w.write_extent(b"late")
    with pytest.raises(SealedSpaceError):
        store.begin_space(sp, {})


def test_numpy_values_in_records(store: Store) -> None:
    sp = Selector.from_name("np")
    arr = np.arange(3)
    store.put(
        sp, Key(1).pack(), {"shape": arr.shape, "n": np.int64(5), "v": arr, "f": np.float32(2)}
    )
    assert store.get(sp, Key(1).pack()) == {"shape": [3], "n": 5, "v": [0, 1, 2], "f": 2.0}
