"""gc with grace 0 in a tight loop beside publications: no published file is lost.

A second process runs ``collect_garbage(grace_s=0)`` as fast as it can while this
one publishes spaces; every publication that reports success must stay readable
(its block file present and exact), and every one that fails must fail typed.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

from czyx.key import Key
from czyx.space import Selector
from czyx.store import Store
from czyx.store.core.fsck import fsck
from czyx.store.errors import StoreError

GC_LOOP = """
import pathlib, sys, time
from czyx.store import Store, collect_garbage
path, stop = sys.argv[1], pathlib.Path(sys.argv[2])
deadline = time.monotonic() + 60
n = 0
with Store.open(path, create=False) as st:
    while not stop.exists() and time.monotonic() < deadline:
        collect_garbage(st, grace_s=0.0)
        n += 1
print(n)
"""


def test_gc_in_a_tight_loop_beside_publications(tmp_path: pathlib.Path) -> None:
    path, stop = tmp_path / "s", tmp_path / "stop"
    Store.open(path).close()
    gc = subprocess.Popen(
        [sys.executable, "-c", GC_LOOP, str(path), str(stop)], stdout=subprocess.PIPE, text=True
    )
    published, refused = [], 0
    try:
        time.sleep(0.5)  # let the loop start
        with Store.open(path) as st:
            for i in range(40):
                sp = Selector.from_name(f"race-{i}")
                try:
                    with st.begin_space(sp, {"i": i}) as w:
                        for j in range(3):
                            w.put(Key(j).pack(), w.write_extent(os.urandom(3000)).record())
                except StoreError:
                    refused += 1
                    continue
                published.append(sp)
    finally:
        stop.touch()
        out, _ = gc.communicate(timeout=120)
    assert int(out.strip()) > 10  # gc really ran beside the publications
    with Store.open(path) as st:
        for sp in published:
            st.verify_space(sp)
        report = fsck(st)
    assert report.ok, report.problems
    assert len(published) + refused == 40 and published


def test_publication_rechecks_its_file_under_the_commit(tmp_path, monkeypatch) -> None:
    """A block file lost between its rename and the index commit is never published."""
    import czyx.store.core.writer as writer
    from czyx.store.errors import BlockFileError, SpaceNotFoundError

    real = writer.fsync_dir
    sp = Selector.from_name("lost")
    with Store.open(tmp_path / "s") as st:
        w = st.begin_space(sp, {})
        w.put(Key(1).pack(), w.write_extent(b"abc").record())

        def lose(d):  # the rename happened: remove the file as a racing gc would have
            real(d)
            pathlib.Path(w.block_path).unlink()

        monkeypatch.setattr(writer, "fsync_dir", lose)
        import pytest

        with pytest.raises(BlockFileError, match="vanished"):
            w.commit()
        with pytest.raises(SpaceNotFoundError):
            st.manifest(sp)


def test_gc_never_removes_a_locked_unpublished_file(tmp_path) -> None:
    from czyx.store import collect_garbage

    sp = Selector.from_name("held")
    with Store.open(tmp_path / "s") as st:
        w = st.begin_space(sp, {})
        w.put(Key(1).pack(), w.write_extent(b"abc").record())
        assert collect_garbage(st, grace_s=0.0) == []  # the .part is held
        w.commit()
        st.verify_space(sp)
