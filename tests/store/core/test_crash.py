"""Crash safety: a writer SIGKILLed at any instant leaves the old state or the new one.

A forked child publishes a run of spaces (each one block file of many
extents plus its records) and, between them, batches of loose records; the
parent kills it with SIGKILL, reopens the store and checks:

- published spaces form a prefix of the run (publication is ordered), each
  one complete: its manifest, every record, and every extent bit-exact and
  checksum-verified, its block file's identity intact;
- the first unpublished space shows nothing at all: no manifest, no record;
- every batch of loose records is all there or not at all;
- after garbage collection the blocks directory holds exactly the files of
  published spaces, and the interrupted space can be published afresh.

Random kill times cover the long extent-writing phase; deterministic kill
points (by patching the child's own functions) hit each step of the commit:
after the block file's fsync, after its rename, inside the LMDB transaction,
and just after the commit.
"""

from __future__ import annotations

import os
import pathlib
import random
import signal
import time

import numpy as np
import pytest

import czyx.store.core.writer as writer_mod
from czyx.key import Key
from czyx.space import Selector
from czyx.store import Store, aligned_empty, collect_garbage, read_extent_verified

N_SPACES = 5
EXTENTS = 24
BATCH = 50
LOOSE = Selector.from_name("crash-loose")


def space(j: int) -> Selector:
    return Selector.from_name(f"crash-{j}")


def payload(j: int, i: int) -> bytes:
    rng = np.random.default_rng([j, i])
    return rng.bytes(int(rng.integers(1, 160 << 10)))


def writer_child(path: pathlib.Path, crash_at: str | None) -> None:
    """The child's whole life: publish spaces, optionally kill itself at a named step."""
    s = Store.open(path, map_size=256 << 10)  # small map: growth happens mid-run too

    def die(*_a, **_k):
        os.kill(os.getpid(), signal.SIGKILL)

    if crash_at == "after_fsync":
        writer_mod.os = _OsWithout("rename", die)
    elif crash_at == "after_rename":
        writer_mod.fsync_dir = die
    elif crash_at == "in_txn":
        s._audit_in = die
    elif crash_at == "after_commit":
        orig = s._write

        def write_then_die(fn):
            orig(fn)
            die()

        s._write = write_then_die  # the first write is the first publication
    for j in range(N_SPACES):
        with s.begin_space(space(j), {"j": j}) as w:
            for i in range(EXTENTS):
                ext = w.write_extent(payload(j, i))
                w.put(Key(i % 7, i, j).pack(), {**ext.record(), "j": j, "i": i})
        s.put_many(LOOSE, [(Key(j, b).pack(), {"batch": j, "b": b}) for b in range(BATCH)])


class _OsWithout:
    """``os`` with one function replaced (patched into the writer module of the child)."""

    def __init__(self, name: str, fn) -> None:
        self._name, self._fn = name, fn

    def __getattr__(self, attr: str):
        return self._fn if attr == self._name else getattr(os, attr)


def run_child(path: pathlib.Path, crash_at: str | None = None, kill_after: float | None = None):
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            writer_child(path, crash_at)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 3
        finally:
            os._exit(code)
    if kill_after is not None:
        time.sleep(kill_after)
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return status


def check(path: pathlib.Path) -> int:
    """Verify the store after a crash; return how many spaces are published."""
    s = Store.open(path)
    try:
        visible = [s.has_space(space(j)) for j in range(N_SPACES)]
        k = visible.index(False) if False in visible else N_SPACES
        assert not any(visible[k:]), f"publication out of order: {visible}"
        for j in range(N_SPACES):
            recs = list(s.scan(space(j)))
            if j >= k:
                assert recs == [], f"space {j} unpublished but has records"
                continue
            assert s.manifest(space(j)) == {"j": j}
            assert len(recs) == EXTENTS
            with s.open_reader(space(j)) as rd:  # checks the block file identity
                for _, rec in recs:
                    want = payload(j, rec["i"])
                    buf = aligned_empty(rec["len"])
                    read_extent_verified(rd, rec, buf)
                    assert buf.tobytes() == want
        batches: dict[int, int] = {}
        for _, r in s.scan(LOOSE):
            batches[r["batch"]] = batches.get(r["batch"], 0) + 1
        assert all(n == BATCH for n in batches.values()), f"torn batch: {batches}"
        assert set(batches) <= set(range(k)), "a batch outlived its space's order"
        collect_garbage(s, grace_s=0)
        live = {s.block_path(space(j)).name for j in range(k)}
        assert {p.name for p in (path / "blocks").iterdir()} == live
        return k
    finally:
        s.close()


def test_uninterrupted_run_publishes_everything(tmp_path: pathlib.Path) -> None:
    status = run_child(tmp_path / "s")
    assert os.waitstatus_to_exitcode(status) == 0
    assert check(tmp_path / "s") == N_SPACES


@pytest.mark.parametrize(
    ("crash_at", "published"),
    [("after_fsync", 0), ("after_rename", 0), ("in_txn", 0), ("after_commit", 1)],
)
def test_kill_at_each_commit_step(tmp_path: pathlib.Path, crash_at: str, published: int) -> None:
    status = run_child(tmp_path / "s", crash_at)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert check(tmp_path / "s") == published
    # The store is still writable: republish what the crash interrupted.
    s = Store.open(tmp_path / "s")
    with s.begin_space(space(published), {"j": published}) as w:
        w.put(Key(0).pack(), w.write_extent(b"again").record())
    assert s.aggregate(space(published)) == (1, 5)
    s.close()


def test_sigkill_at_random_instants(tmp_path: pathlib.Path) -> None:
    t0 = time.perf_counter()
    run_child(tmp_path / "calibrate")
    full = time.perf_counter() - t0
    rng = random.Random(1234)
    seen = set()
    for run in range(16):
        path = tmp_path / f"run{run}"
        status = run_child(path, kill_after=rng.uniform(0.0, full))
        assert os.waitstatus_to_exitcode(status) in (0, -signal.SIGKILL)
        seen.add(check(path))
    # Kills landed at different stages (not all before the first commit).
    assert len(seen) >= 2, seen
