"""LMDB-backend specifics: map growth, processes and fork, chunked scans, garbage."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import threading
import time

import pytest

import czyx.store.core.lmdb_store as lmdb_store_mod
import czyx.store.core.snapshot as snapshot_mod
from czyx.key import Key
from czyx.space import Selector
from czyx.store import (
    ReservedSpaceError,
    SealedSpaceError,
    SpaceNotEmptyError,
    Store,
    StoreError,
    StoreForkError,
    StoreMapFullError,
    collect_garbage,
)

ROOT = pathlib.Path(__file__).resolve().parents[3]


def records(n: int, pad: int = 200) -> list[tuple[bytes, dict]]:
    return [(Key(i % 256, i).pack(), {"i": i, "pad": b"x" * pad}) for i in range(n)]


def test_map_grows_on_demand(tmp_path: pathlib.Path) -> None:
    s = Store.open(tmp_path / "s", map_size=64 << 10)
    start = s.map_size()
    sp = Selector.from_name("g")
    items = records(3000)
    assert s.put_many(sp, items) == 3000  # ~700 KiB: needs several doublings
    for k, r in items[:10]:
        s.put(Selector.from_name("h"), k, r)  # single puts after growth still fine
    assert s.map_size() > start
    assert dict(s.scan(sp)) == dict(items)
    s.close()
    s = Store.open(tmp_path / "s", map_size=64 << 10)  # reopening with a small size is fine
    assert s.aggregate(sp)[0] == 3000
    s.close()


def test_map_full_at_the_limit_writes_nothing(tmp_path: pathlib.Path) -> None:
    s = Store.open(tmp_path / "s", map_size=64 << 10, max_map_size=256 << 10)
    sp = Selector.from_name("g")
    s.put(sp, Key(1).pack(), {"before": True})
    with pytest.raises(StoreMapFullError, match="limit"):
        s.put_many(sp, records(5000))
    assert list(s.scan(sp)) == [(Key(1).pack(), {"before": True})]
    s.close()


def test_map_full_during_publication_leaves_old_state(tmp_path: pathlib.Path) -> None:
    s = Store.open(tmp_path / "s", map_size=64 << 10, max_map_size=128 << 10)
    sp = Selector.from_name("m")
    w = s.begin_space(sp, {})
    ext = w.write_extent(b"abc")
    for k, _ in records(4000):
        w.put(k, {**ext.record(), "pad": b"y" * 100})
    with pytest.raises(StoreMapFullError):
        w.commit()
    assert not s.has_space(sp)
    assert list((tmp_path / "s" / "blocks").iterdir()) == []
    s.close()


def test_map_resized_by_another_process(tmp_path: pathlib.Path) -> None:
    """A second process grows the map; this one adopts the new size on its next txn."""
    path = tmp_path / "s"
    s = Store.open(path, map_size=64 << 10)
    sp = Selector.from_name("g")
    s.put(sp, Key(1).pack(), {"parent": 1})
    code = (
        "import sys; from store import Store; from czyx.space import Selector;"
        "from czyx.key import Key\n"
        "s = Store.open(sys.argv[1], map_size=64 << 10)\n"
        "sp = Selector.from_name('g')\n"
        "s.put_many(sp, [(Key(2, i).pack(), {'p': b'z' * 300}) for i in range(3000)])\n"
        "s.close()\n"
    )
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, cwd=ROOT)
    assert s.get(sp, Key(2, 2999).pack()) == {"p": b"z" * 300}
    assert s.aggregate(sp)[0] == 3001
    s.put(sp, Key(3).pack(), {"parent": 2})
    assert s.get(sp, Key(3).pack()) == {"parent": 2}
    s.close()


def test_env_is_not_used_across_fork(tmp_path: pathlib.Path) -> None:
    s = Store.open(tmp_path / "s")
    sp = Selector.from_name("g")
    s.put(sp, Key(1).pack(), {"v": 1})
    pid = os.fork()
    if pid == 0:  # child: every use must refuse; a fresh open must work
        code = 1
        try:
            try:
                s.get(sp, Key(1).pack())
            except StoreForkError:
                t = Store.open(tmp_path / "s")  # the inherited env was closed at fork
                code = 0 if t.get(sp, Key(1).pack()) == {"v": 1} else 2
                t.close()
                s.close()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert s.get(sp, Key(1).pack()) == {"v": 1}  # the parent's handle is intact
    s.close()


def test_readonly_and_missing(tmp_path: pathlib.Path) -> None:
    with pytest.raises(StoreError, match="no store"):
        Store.open(tmp_path / "nothing", readonly=True)
    with pytest.raises(StoreError, match="no store"):
        Store.open(tmp_path / "nothing", create=False)
    Store.open(tmp_path / "s").close()
    ro = Store.open(tmp_path / "s", readonly=True)
    assert ro.get(Selector.from_name("g"), Key(1).pack()) is None
    with pytest.raises(StoreError, match="read-only"):
        ro.put(Selector.from_name("g"), Key(1).pack(), {})
    ro.close()
    with pytest.raises(StoreError, match="closed"):
        ro.get(Selector.from_name("g"), Key(1).pack())


def test_scan_across_chunk_boundaries(tmp_path: pathlib.Path, monkeypatch) -> None:
    monkeypatch.setattr(lmdb_store_mod, "_SCAN_CHUNK", 3)
    monkeypatch.setattr(snapshot_mod, "SCAN_CHUNK", 3)
    s = Store.open(tmp_path / "s")
    sp = Selector.from_name("g")
    items = [(Key(c, i).pack(), {"c": c, "i": i}) for c in (1, 2, 3) for i in range(7)]
    s.put_many(sp, items)
    s.put_many(Selector.from_name("h"), items)
    assert list(s.scan(sp)) == sorted(items)
    assert [r["c"] for _, r in s.scan(sp, 2, 2)] == [2] * 7
    with s.snapshot() as snap:  # 21 rows: the last chunk is full, then an empty read
        assert list(snap.scan(sp)) == sorted(items)
        assert list(snap.scan(sp, 2, 3)) == sorted(i for i in items if i[0][0] >= 2)
        assert list(snap.scan(sp, 4, 9)) == []
    assert list(s.keys(sp, 3, 3)) == sorted(k for k, _ in items if k[0] == 3)
    for i in range(10):
        s.audit("e", i=i)
    assert [e["i"] for e in s.audit_log()] == list(range(10))
    assert [e["i"] for e in s.audit_log(since=7)] == [7, 8, 9]
    s.close()


def test_second_publisher_of_a_space_loses_cleanly(tmp_path: pathlib.Path) -> None:
    s = Store.open(tmp_path / "s")
    sp = Selector.from_name("m")
    a, b = s.begin_space(sp, {"who": "a"}), s.begin_space(sp, {"who": "b"})
    a.put(Key(1).pack(), a.write_extent(b"A" * 100).record())
    b.put(Key(2).pack(), b.write_extent(b"B" * 100).record())
    a.commit()
    with pytest.raises(SealedSpaceError, match="another writer"):
        b.commit()
    assert s.manifest(sp) == {"who": "a"}
    assert [k for k, _ in s.scan(sp)] == [Key(1).pack()]
    assert [p.name for p in (tmp_path / "s" / "blocks").iterdir()] == [s.block_path(sp).name]
    s.close()


def test_failed_publication_keeps_the_block_unless_surely_unpublished(
    tmp_path: pathlib.Path, monkeypatch
) -> None:
    s = Store.open(tmp_path / "s")
    blocks = tmp_path / "s" / "blocks"
    sp = Selector.from_name("u")

    def broken(*_a, **_k):
        raise StoreError("lmdb went away")

    w = s.begin_space(sp, {})
    w.put(Key(1).pack(), w.write_extent(b"U" * 100).record())
    monkeypatch.setattr(s, "_write", broken)
    monkeypatch.setattr(s, "block_identity", broken)  # cannot tell whether it was published
    with pytest.raises(StoreError, match="went away"):
        w.commit()
    kept = [p.name for p in blocks.iterdir()]
    assert len(kept) == 1 and kept[0].endswith(".blk")  # left for collect_garbage
    monkeypatch.undo()
    (blocks / kept[0]).unlink()

    w = s.begin_space(sp, {})  # the space is plainly unpublished: the block goes
    w.put(Key(1).pack(), w.write_extent(b"U" * 100).record())
    monkeypatch.setattr(s, "_write", broken)
    with pytest.raises(StoreError, match="went away"):
        w.commit()
    assert list(blocks.iterdir()) == []
    monkeypatch.undo()
    s.close()


def test_space_with_loose_records_cannot_be_published(tmp_path: pathlib.Path) -> None:
    s = Store.open(tmp_path / "s")
    sp = Selector.from_name("m")
    s.put(sp, Key(9).pack(), {"loose": True})
    with pytest.raises(SpaceNotEmptyError), s.begin_space(sp, {}) as w:
        w.put(Key(1).pack(), w.write_extent(b"x").record())
    assert not s.has_space(sp)
    s.close()


def test_reserved_selectors_are_refused(tmp_path: pathlib.Path) -> None:
    s = Store.open(tmp_path / "s")
    for prefix in (0xFE, 0xFF):
        sel = Selector.reserved_space(prefix, "x")
        with pytest.raises(ReservedSpaceError):
            s.put(sel, Key(1).pack(), {})
        with pytest.raises(ReservedSpaceError):
            s.begin_space(sel, {})
    s.close()


def test_hole_in_block_file(tmp_path: pathlib.Path) -> None:
    s = Store.open(tmp_path / "s")
    sp = Selector.from_name("m")
    with s.begin_space(sp, {}) as w:
        assert w.data_start == w.alignment >= 4096
        w.skip_to(w.data_start + 3 * w.alignment)
        e = w.write_extent(b"late")
        assert e.offset == w.data_start + 3 * w.alignment
        with pytest.raises(ValueError):
            w.skip_to(w.data_start)
        w.put(Key(1).pack(), e.record())
    with s.open_reader(sp) as rd:
        buf = bytearray(4)
        rd.read_into(e.offset, buf)
    assert bytes(buf) == b"late"
    s.close()


def test_collect_garbage(tmp_path: pathlib.Path) -> None:
    s = Store.open(tmp_path / "s")
    sp = Selector.from_name("m")
    with s.begin_space(sp, {}) as w:
        w.put(Key(1).pack(), w.write_extent(b"x").record())
    blocks = tmp_path / "s" / "blocks"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    orphan_part = blocks / f"aa-bb.blk.{int(dead.stdout)}.part"
    live_part = blocks / f"aa-cc.blk.{os.getpid()}.part"
    old_blk, new_blk = blocks / "aa-dd.blk", blocks / "aa-ee.blk"
    for p in (orphan_part, live_part, old_blk, new_blk):
        p.write_bytes(b"junk")
    past = time.time() - 7200
    os.utime(old_blk, (past, past))
    removed = collect_garbage(s)
    assert sorted(removed) == sorted([orphan_part.name, old_blk.name])
    assert live_part.exists() and new_blk.exists() and s.block_path(sp).exists()
    s.verify_space(sp)
    s.close()


def test_snapshot_and_get_many(tmp_path: pathlib.Path) -> None:
    s = Store.open(tmp_path / "s")
    sp = Selector.from_name("g")
    items = [(Key(c, i).pack(), {"c": c, "i": i}) for c in (4, 5) for i in range(5)]
    s.put_many(sp, items)
    with s.snapshot() as snap:
        s.put(sp, Key(4, 99).pack(), {"late": True})  # not visible in the snapshot
        assert snap.get(sp, Key(4, 99).pack()) is None
        assert all(snap.get(sp, k) == r for k, r in items)
        assert list(snap.scan(sp, 5, 5)) == sorted(i for i in items if i[0][0] == 5)
    with pytest.raises(StoreError):
        snap.get(sp, items[0][0])
    got = s.get_many(sp, [k for k, _ in items] + [Key(9).pack()])
    assert got == [r for _, r in items] + [None]
    assert s.get(sp, Key(4, 99).pack()) == {"late": True}
    s.close()


def test_map_growth_waits_for_open_readers(tmp_path: pathlib.Path) -> None:
    """A resize never remaps under a live read transaction of this process."""
    s = Store.open(tmp_path / "s", map_size=64 << 10)
    sp = Selector.from_name("g")
    s.put(sp, Key(255, 2**40).pack(), {"first": True})
    items = records(3000)
    errors: list[BaseException] = []

    def grow() -> None:
        try:
            s.put_many(sp, items)
        except BaseException as exc:
            errors.append(exc)

    with s.snapshot() as snap:
        t = threading.Thread(target=grow)
        t.start()
        for _ in range(200):  # the snapshot stays valid while the writer wants to grow
            assert snap.get(sp, Key(255, 2**40).pack()) == {"first": True}
            assert s.get(sp, Key(255, 2**40).pack()) == {"first": True}
    t.join()
    assert errors == []
    assert s.aggregate(sp)[0] == 3001
    s.close()


def test_growth_under_own_snapshot_fails_fast(tmp_path: pathlib.Path) -> None:
    s = Store.open(tmp_path / "s", map_size=64 << 10)
    sp = Selector.from_name("g")
    with s.snapshot(), pytest.raises(StoreMapFullError, match="snapshot"):
        s.put_many(sp, records(3000))
    assert s.put_many(sp, records(3000)) == 3000  # fine once the snapshot is closed
    s.close()


def test_catalog_extras(tmp_path: pathlib.Path) -> None:
    s = Store.open(tmp_path / "s")
    sp = Selector.from_name("m")
    with s.begin_space(sp, {"v": 1}) as w:
        w.put(Key(3, 1).pack(), w.write_extent(b"abc").record())
    info = s.space_info(sp)
    assert info["manifest"] == {"v": 1} and info["count"] == 1 and info["checksum"] == "xxh3_64"
    assert info["block"]["size"] == s.block_path(sp).stat().st_size
    assert list(s.keys(sp)) == [Key(3, 1).pack()]
    s.set_tag("m@1", sp)
    assert s.remove_tag("m@1") and not s.remove_tag("m@1")
    s.set_tag("m@1", Selector.from_name("other"))  # re-pointing after an explicit removal
    s.put_edge(b"e1", {"w": 1})
    assert s.get_edge(b"e1") == {"w": 1}
    assert s.delete_edge(b"e1") and s.get_edge(b"e1") is None
    for bad in (b"", b"x" * 512, "str"):
        with pytest.raises(ValueError):
            s.put_edge(bad, {})  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        s.set_tag("", sp)
    with pytest.raises(ValueError):
        s.audit("")
    events = [e["event"] for e in s.audit_log()]
    assert events == ["space.publish", "tag.set", "tag.remove", "tag.set"]
    s.close()


def test_threads_write_and_read_while_the_map_grows(tmp_path: pathlib.Path) -> None:
    s = Store.open(tmp_path / "s", map_size=64 << 10)
    sp = Selector.from_name("g")
    errors: list[BaseException] = []
    done = threading.Event()

    def writer(t: int) -> None:
        try:
            for b in range(5):
                s.put_many(sp, [(Key(t, b, i).pack(), {"pad": b"p" * 400}) for i in range(50)])
        except BaseException as exc:
            errors.append(exc)

    def reader() -> None:
        try:
            while not done.is_set():
                s.get(sp, Key(0, 0, 0).pack())
                sum(1 for _ in s.scan(sp, 1, 1))
                time.sleep(0.0005)  # leave the writers some GIL
        except BaseException as exc:
            errors.append(exc)

    writers = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
    readers = [threading.Thread(target=reader) for _ in range(2)]
    for th in writers + readers:
        th.start()
    for th in writers:
        th.join()
    done.set()
    for th in readers:
        th.join()
    assert errors == []
    assert s.aggregate(sp)[0] == 4 * 5 * 50
    assert s.map_size() > 64 << 10
    s.close()


def test_fork_during_a_snapshot_keeps_the_parents_reader_slot(tmp_path: pathlib.Path) -> None:
    """The child must not release (through its copy) a read txn the parent still uses."""
    s = Store.open(tmp_path / "s")
    sp = Selector.from_name("g")
    s.put(sp, Key(1).pack(), {"v": 1})
    with s.snapshot() as snap:
        before = s._env.readers()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                try:
                    snap.get(sp, Key(1).pack())
                except StoreForkError:
                    try:
                        Store.open(tmp_path / "s")
                    except StoreError as exc:
                        code = 0 if "spawned process" in str(exc) else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert s._env.readers() == before  # our slot is still registered
        assert str(os.getpid()) in before
        assert snap.get(sp, Key(1).pack()) == {"v": 1}
    s.close()


def test_fork_child_exiting_normally_keeps_the_parents_reader_slot(tmp_path: pathlib.Path) -> None:
    """Interpreter shutdown in the child must not abort its copy of the parent's txn."""
    code = (
        "import os, sys\n"
        "from store import Store\n"
        "from czyx.space import Selector\n"
        "from czyx.key import Key\n"
        "s = Store.open(sys.argv[1])\n"
        "sp = Selector.from_name('g')\n"
        "s.put(sp, Key(1).pack(), {'v': 1})\n"
        "with s.snapshot() as snap:\n"
        "    before = s._env.readers()\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        sys.exit(0)\n"
        "    os.waitpid(pid, 0)\n"
        "    assert s._env.readers() == before, (before, s._env.readers())\n"
        "    assert snap.get(sp, Key(1).pack()) == {'v': 1}\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "s")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "ok"
