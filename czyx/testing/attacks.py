"""Adversarial inputs shared by the hardening tests and ``bench/adversarial.py``.

Each generator yields :class:`Attack` cases: a name and a function that runs the
attack and returns its :class:`Outcome`. An outcome is ``refused`` (a
:class:`czyx.errors.CzyxError` subclass was raised, the one acceptable result),
``crashed`` (any other exception: an untyped failure) or ``silent`` (the attack
was accepted: the damaged input was computed with or exported). The tests assert
every case is refused; the bench script counts them per class for
``bench/HARDENING.md``. Keeping both on one list means the report counts exactly
what the tests check.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from czyx.errors import CzyxError


@dataclass(frozen=True)
class Outcome:
    """How one attack ended: ``kind`` is ``refused``, ``crashed`` or ``silent``."""

    kind: str
    detail: str


@dataclass(frozen=True)
class Attack:
    """One adversarial case: ``run()`` performs it and classifies the result."""

    name: str
    run: Callable[[], Outcome]


def classify(fn: Callable[[], object]) -> Outcome:
    """Run ``fn``: a typed czyx error is ``refused``, another exception ``crashed``,
    a normal return ``silent``."""
    try:
        fn()
    except CzyxError as exc:
        return Outcome("refused", f"{type(exc).__name__}: {exc}"[:200])
    except Exception as exc:
        return Outcome("crashed", f"{type(exc).__name__}: {exc}"[:200])
    return Outcome("silent", "accepted")


# -- the index (LMDB) -----------------------------------------------------------------

INDEX_DBS = ("records", "spaces", "tags", "portals", "edges", "audit", "meta")


def build_index_store(root: pathlib.Path) -> pathlib.Path:
    """A small store holding every kind of index value: a mounted tiny model (manifests
    with its config, extents, tags), a portal with its audit trail, and an edge."""
    from czyx.portals.model import grant_model
    from czyx.store import Store
    from czyx.store.models.mount import mount
    from czyx.testing.tiny_models import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint("mixtral", root / "ckpt", num_hidden_layers=1)
    path = root / "store"
    with Store.open(path) as st:
        res = mount(st, ckpt, "m@1")
        grant_model(st, res.selector, tenant="alice", classes="0-1", rights="infer")
        st.put_edge(b"\xff" + b"e" * 8, {"to": "m@1"})
    return path


def read_everything(path: pathlib.Path) -> None:
    """Read every index value through the public API, as a consumer and export would."""
    from czyx.store import Store

    with Store.open(path, readonly=True) as st:
        for sp in st.spaces():
            st.space_info(sp)
            list(st.scan(sp))
        st.tags()
        list(st.portal_descriptors())
        list(st.edges())
        list(st.audit_log())


def _raw_items(path: pathlib.Path) -> list[tuple[str, bytes, bytes]]:
    import lmdb

    env = lmdb.open(str(path / "index"), max_dbs=16, readonly=True, lock=False)
    try:
        out = []
        with env.begin() as txn:
            for name in INDEX_DBS:
                db = env.open_db(name.encode(), txn=txn, create=False)
                out += [(name, k, v) for k, v in txn.cursor(db=db)]
        return out
    finally:
        env.close()


def _raw_replace(path: pathlib.Path, name: str, old: tuple, new: tuple) -> None:
    import lmdb

    env = lmdb.open(str(path / "index"), max_dbs=16)
    try:
        with env.begin(write=True) as txn:
            db = env.open_db(name.encode(), txn=txn, create=False)
            txn.delete(old[0], db=db)
            txn.put(new[0], new[1], db=db)
    finally:
        env.close()


def index_bitflips(path: pathlib.Path, per_value: int = 6) -> Iterator[Attack]:
    """One bit flipped in index values (several positions each) and in their keys.

    Each attack damages the store at ``path``, checks that reading it through the
    public API is refused *and* that ``fsck`` reports it, then restores the value.
    """
    from czyx.store import Store
    from czyx.store.core.fsck import fsck

    for name, key, value in _raw_items(path):
        positions = sorted({0, 1, 8, 9, len(value) // 2, len(value) - 1})[:per_value]
        variants = [(key, _flip(value, p), f"value byte {p}") for p in positions]
        if name != "meta":
            variants.append((_flip(key, len(key) - 1), value, "key last byte"))
        for new_key, new_value, what in variants:

            def run(name=name, key=key, value=value, nk=new_key, nv=new_value) -> Outcome:
                _raw_replace(path, name, (key, value), (nk, nv))
                try:
                    out = classify(lambda: read_everything(path))
                    if out.kind == "refused":
                        found = []

                        def check() -> None:
                            with Store.open(path) as st:
                                found.append(not fsck(st, data=False).ok)

                        after = classify(check)
                        if after.kind == "crashed":
                            out = after
                        elif after.kind == "silent" and not found[0]:
                            out = Outcome("silent", "read refused but fsck found nothing")
                    return out
                finally:
                    _raw_replace(path, name, (nk, nv), (key, value))

            yield Attack(f"index {name} {key[:6].hex()}.. {what}", run)


def _flip(b: bytes, pos: int) -> bytes:
    return b[:pos] + bytes([b[pos] ^ 0x10]) + b[pos + 1 :]


def index_truncations(path: pathlib.Path) -> Iterator[Attack]:
    """``data.mdb`` cut at several lengths: opening must be refused, never SIGBUS.

    Runs each read in a child process, so a SIGBUS would be seen (as a signal exit)
    instead of killing the caller.
    """
    import shutil
    import subprocess
    import sys

    data = path / "index" / "data.mdb"
    size = data.stat().st_size
    for cut in sorted({4096, 8192, size // 2, size - 4096, size - 1}):
        if not 0 < cut < size:
            continue

        def run(cut=cut) -> Outcome:
            work = path.parent / f"trunc-{cut}"
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(path, work)
            with open(work / "index" / "data.mdb", "r+b") as f:
                f.truncate(cut)
            code = (
                "import sys, pathlib\n"
                "from czyx.testing.attacks import classify, read_everything\n"
                "o = classify(lambda: read_everything(pathlib.Path(sys.argv[1])))\n"
                "print(o.kind); print(o.detail)\n"
            )
            r = subprocess.run(
                [sys.executable, "-c", code, str(work)],
                capture_output=True,
                text=True,
                timeout=120,
            )
            shutil.rmtree(work, ignore_errors=True)
            if r.returncode != 0:
                return Outcome("crashed", f"exit {r.returncode}: {r.stderr[-200:]}")
            kind, _, detail = r.stdout.partition("\n")
            return Outcome(kind.strip(), detail.strip())

        yield Attack(f"index data.mdb truncated to {cut} of {size} bytes", run)


def remove_tree(path: pathlib.Path) -> None:
    """Remove a directory tree, ignoring errors (attack scratch space)."""
    import shutil

    shutil.rmtree(path, ignore_errors=True)
    os.sync()
