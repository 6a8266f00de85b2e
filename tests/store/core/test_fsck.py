"""Whole-store verification (``store.fsck``) and the ``czyx store`` command."""

from __future__ import annotations

import os
import pathlib

import pytest

from czyx.cli import main
from czyx.key import Key
from czyx.space import Selector
from czyx.store import Store
from czyx.store.core.fsck import fsck


@pytest.fixture
def store_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "s"
    with Store.open(path) as s:
        for name in ("a", "b"):
            sp = Selector.from_name(name)
            with s.begin_space(sp, {"name": name}) as w:
                for i in range(3):
                    w.put(Key(i).pack(), w.write_extent(os.urandom(5000 + i)).record())
                w.put(Key(9).pack(), {"note": "no extent"})
            s.set_tag(f"{name}@1", sp)
    return path


def test_fsck_clean_store(store_dir: pathlib.Path) -> None:
    with Store.open(store_dir) as s:
        r = fsck(s)
        assert r.ok and r.spaces == 2 and r.extents == 6
        assert r.nbytes == 2 * (5000 + 5001 + 5002)
        assert fsck(s, direct=True) == r
        assert fsck(s, data=False).extents == 0


def test_fsck_reports_every_fault(store_dir: pathlib.Path) -> None:
    with Store.open(store_dir) as s:
        a, b = Selector.from_name("a"), Selector.from_name("b")
        rec = s.get(a, Key(1).pack())
        with open(s.block_path(a), "r+b") as f:  # flip one byte of one extent
            f.seek(rec["off"] + 7)
            byte = f.read(1)
            f.seek(rec["off"] + 7)
            f.write(bytes([byte[0] ^ 1]))
        s.block_path(b).unlink()
        r = fsck(s)
    assert not r.ok and r.extents == 2
    assert len(r.problems) == 2
    assert any("checksum mismatch" in p and Key(1).pack().hex() in p for p in r.problems)
    assert any("missing" in p and b.hex() in p for p in r.problems)


def test_cli_info_fsck_gc(store_dir: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["store", "info", str(store_dir)]) == 0
    out = capsys.readouterr().out
    assert "a@1" in out and "records=4" in out and "bytes=15003" in out
    assert main(["store", "fsck", str(store_dir)]) == 0
    assert "0 problems" in capsys.readouterr().out
    (store_dir / "blocks" / "x.blk.1.part").write_bytes(b"junk")  # pid 1 is alive...
    (store_dir / "blocks" / "y.blk").write_bytes(b"junk")
    assert main(["store", "gc", str(store_dir), "--grace", "0"]) == 0
    assert "removed y.blk" in capsys.readouterr().out
    with Store.open(store_dir) as s:
        os.truncate(s.block_path(Selector.from_name("a")), 4096)
    assert main(["store", "fsck", str(store_dir), "--no-data"]) == 1
    assert "truncated" in capsys.readouterr().out
    assert main(["store", "info", str(store_dir / "nothing")]) == 1
    assert "no store" in capsys.readouterr().err
