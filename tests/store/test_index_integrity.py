"""Index integrity: every LMDB value sealed and checked, truncation typed, repair.

The bit-flip and truncation cases come from :mod:`czyx.testing.attacks`, the same
list ``bench/adversarial.py`` counts for ``bench/HARDENING.md``.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import lmdb
import pytest

from czyx.key import Key
from czyx.space import Selector
from czyx.store import Store
from czyx.store.core.fsck import fsck
from czyx.store.core.records import SEEDS, unseal
from czyx.store.errors import IndexChecksumError, IndexCorruptError, StoreError
from czyx.testing.attacks import build_index_store, index_bitflips, index_truncations


@pytest.fixture(scope="module")
def index_store(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return build_index_store(tmp_path_factory.mktemp("idx"))


def test_every_index_bitflip_is_refused_and_found_by_fsck(index_store: pathlib.Path) -> None:
    outcomes = [(a.name, a.run()) for a in index_bitflips(index_store, per_value=3)]
    assert len(outcomes) > 50
    bad = [(n, o) for n, o in outcomes if o.kind != "refused"]
    assert not bad, bad[:5]
    with Store.open(index_store) as st:  # restored exactly
        assert fsck(st).ok


def test_truncated_index_is_a_typed_error_never_sigbus(index_store: pathlib.Path) -> None:
    outcomes = [(a.name, a.run()) for a in index_truncations(index_store)]
    assert len(outcomes) >= 3
    bad = [(n, o) for n, o in outcomes if o.kind != "refused"]
    assert not bad, bad


def test_cli_on_truncated_index_exits_1_not_signal(index_store: pathlib.Path, tmp_path) -> None:
    import shutil

    work = tmp_path / "t"
    shutil.copytree(index_store, work)
    data = work / "index" / "data.mdb"
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    for argv in (["store", "fsck", str(work)], ["ls", "--store", str(work)]):
        r = subprocess.run(
            [sys.executable, "-m", "czyx", *argv], capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 1, (argv, r.returncode, r.stderr)
        assert "truncated" in r.stderr and "Traceback" not in r.stderr


def test_flipped_config_value_is_refused_on_read(index_store: pathlib.Path) -> None:
    """The issue's case: one bit of rope_theta in a manifest's stored config."""
    from czyx.store.models.mount import resolve

    with Store.open(index_store) as st:
        sel = resolve(st, "m@1")
    env = lmdb.open(str(index_store / "index"), max_dbs=16)
    with env.begin(write=True) as txn:
        db = env.open_db(b"spaces", txn=txn)
        v = txn.get(sel.raw, db=db)
        i = v.index(b"rope_theta") + len(b"rope_theta") + 3
        txn.put(sel.raw, v[:i] + bytes([v[i] ^ 1]) + v[i + 1 :], db=db)
    env.close()
    try:
        with Store.open(index_store, readonly=True) as st, pytest.raises(IndexChecksumError):
            st.manifest(sel)
        with Store.open(index_store) as st:
            assert any("checksum" in p for p in fsck(st, data=False).problems)
    finally:
        env = lmdb.open(str(index_store / "index"), max_dbs=16)
        with env.begin(write=True) as txn:
            txn.put(sel.raw, v, db=env.open_db(b"spaces", txn=txn))
        env.close()


def test_record_count_mismatch_is_a_fsck_problem(tmp_path: pathlib.Path) -> None:
    sp = Selector.from_name("a")
    with Store.open(tmp_path / "s") as st, st.begin_space(sp, {}) as w:
        for i in range(3):
            w.put(Key(i).pack(), w.write_extent(b"x" * 10).record())
    env = lmdb.open(str(tmp_path / "s" / "index"), max_dbs=16)
    with env.begin(write=True) as txn:
        txn.delete(sp.raw + Key(1).pack(), db=env.open_db(b"records", txn=txn))
    env.close()
    with Store.open(tmp_path / "s") as st:
        r = fsck(st)
    assert any("holds 2 records, published with 3" in p for p in r.problems)


def _make_legacy(path: pathlib.Path) -> None:
    """Turn a store into the pre-checksum format: bare values, no meta database."""
    env = lmdb.open(str(path / "index"), max_dbs=16)
    with env.begin(write=True) as txn:
        for name in ("records", "spaces", "tags", "portals", "edges", "audit"):
            db = env.open_db(name.encode(), txn=txn)
            rows = [(k, unseal(SEEDS[name], k, v)) for k, v in txn.cursor(db=db)]
            with txn.cursor(db=db) as cur:
                cur.putmulti(rows)
        txn.drop(env.open_db(b"meta", txn=txn), delete=True)
    env.close()


def test_legacy_store_readonly_refused_then_migrated(tmp_path: pathlib.Path) -> None:
    sp = Selector.from_name("a")
    with Store.open(tmp_path / "s") as st:
        with st.begin_space(sp, {"cfg": {"rope_theta": 1e4}}) as w:
            w.put(Key(1).pack(), w.write_extent(b"abc").record())
        st.set_tag("a@1", sp)
    _make_legacy(tmp_path / "s")
    with pytest.raises(StoreError, match=r"predates index checksums.*migrate"):
        Store.open(tmp_path / "s", readonly=True)
    with Store.open(tmp_path / "s") as st:  # writable open migrates
        assert st.manifest(sp) == {"cfg": {"rope_theta": 1e4}}
    with Store.open(tmp_path / "s", readonly=True) as st:
        assert st.resolve_tag("a@1") == sp and fsck(st).ok


def test_killed_creation_opens(tmp_path: pathlib.Path) -> None:
    # 1: data.mdb created empty (killed before LMDB wrote its meta pages)
    (tmp_path / "a" / "index").mkdir(parents=True)
    (tmp_path / "a" / "index" / "data.mdb").write_bytes(b"")
    with Store.open(tmp_path / "a", readonly=True) as st:
        assert st.spaces() == []
    # 2: LMDB initialised, databases never created
    (tmp_path / "b" / "index").mkdir(parents=True)
    lmdb.open(str(tmp_path / "b" / "index"), max_dbs=16).close()
    with Store.open(tmp_path / "b", readonly=True) as st:
        assert st.tags() == {}
    with Store.open(tmp_path / "b") as st:
        st.set_tag("x@1", Selector.from_name("x"))
    # 3: an empty index beside block files is not silently re-created
    (tmp_path / "c" / "index").mkdir(parents=True)
    (tmp_path / "c" / "blocks").mkdir()
    (tmp_path / "c" / "blocks" / "x.blk").write_bytes(b"y")
    (tmp_path / "c" / "index" / "data.mdb").write_bytes(b"")
    with pytest.raises(IndexCorruptError, match="block files exist"):
        Store.open(tmp_path / "c")


def test_stale_reader_slots_are_reclaimed(tmp_path: pathlib.Path) -> None:
    """Readers killed while this process keeps the lock table alive are cleared by
    the next open (in another process)."""
    path = tmp_path / "s"
    code = (
        "import os, signal, sys\n"
        "from czyx.store import Store\n"
        "st = Store.open(sys.argv[1], readonly=True)\n"
        "snap = st.snapshot()\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    with Store.open(path) as st:
        for _ in range(3):
            r = subprocess.run([sys.executable, "-c", code, str(path)], timeout=60)
            assert r.returncode == -signal.SIGKILL

        def dead() -> list[int]:
            pids = []
            for line in st._env.readers().splitlines()[1:]:
                f = line.split()
                if f and f[0].isdigit() and int(f[0]) != os.getpid():
                    pids.append(int(f[0]))
            return pids

        assert dead()  # the last killed reader still holds its slot
        opener = "import sys\nfrom czyx.store import Store\nStore.open(sys.argv[1]).close()\n"
        subprocess.run([sys.executable, "-c", opener, str(path)], timeout=60, check=True)
        assert dead() == []


def _reseal(path: pathlib.Path, db_name: str, edit) -> None:
    """Rewrite values of ``db_name`` through ``edit(key, dict) -> dict | None`` with a
    valid seal: a crafted store (or a writer bug), not bit rot."""
    import msgpack

    from czyx.store.core.records import seal

    env = lmdb.open(str(path / "index"), max_dbs=16)
    with env.begin(write=True) as txn:
        db = env.open_db(db_name.encode(), txn=txn)
        for k, v in list(txn.cursor(db=db)):
            rec = msgpack.unpackb(unseal(SEEDS[db_name], k, v), raw=False)
            new = edit(k, rec)
            if new is not None:
                txn.put(k, seal(SEEDS[db_name], k, msgpack.packb(new, use_bin_type=True)), db=db)
    env.close()


@pytest.mark.parametrize(
    ("db_name", "edit", "match"),
    [
        ("records", lambda k, r: {kk: v for kk, v in r.items() if kk != "len"}, "len"),
        ("records", lambda k, r: {**r, "len": 1 << 50}, "len"),
        ("records", lambda k, r: {**r, "sum": -1}, "sum"),
        ("records", lambda k, r: {**r, "expert": "x"}, "malformed"),
        (
            "spaces",
            lambda k, r: (
                {**r, "manifest": {**r["manifest"], "expert": {"n_layers": 10**9}}}
                if r["manifest"].get("kind") == "czyx.model"
                else None
            ),
            "n_layers",
        ),
        (
            "spaces",
            lambda k, r: (
                {
                    **r,
                    "manifest": {
                        **r["manifest"],
                        "config": {**r["manifest"]["config"], "rms_norm_eps": -1.0},
                    },
                }
                if r["manifest"].get("kind") == "czyx.model"
                else None
            ),
            "rms_norm_eps",
        ),
    ],
    ids=["no-len", "huge-len", "negative-sum", "expert-str", "layers-1e9", "negative-eps"],
)
def test_crafted_records_are_typed_at_open(tmp_path, db_name, edit, match) -> None:
    from czyx.errors import CzyxError
    from czyx.store.models.model import ModelSpace
    from czyx.store.models.mount import mount
    from czyx.testing.tiny_models import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint("mixtral", tmp_path / "c", num_hidden_layers=1)
    with Store.open(tmp_path / "s") as st:
        sel = mount(st, ckpt, "m@1").selector
    _reseal(tmp_path / "s", db_name, edit)
    with Store.open(tmp_path / "s") as st, pytest.raises(CzyxError, match=match):
        ModelSpace(st, sel)
