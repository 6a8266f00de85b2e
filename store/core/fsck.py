"""Checking a whole store: every published space's block file and every extent.

``fsck`` answers "can every published byte still be read back exactly?": for
each sealed space it verifies the block file's identity (size, header,
generation) and, unless asked not to, reads every record's extent and checks
its XXH3-64 sum. Problems are collected, not raised one at a time, so one bad
space does not hide another.
"""

from __future__ import annotations

from dataclasses import dataclass

from czyx.space import Selector
from czyx.store.core.lmdb_store import Store
from czyx.store.errors import StoreError
from czyx.store.io.reader import aligned_empty, read_extent_verified


@dataclass(frozen=True)
class FsckReport:
    """What :func:`fsck` found.

    Attributes
    ----------
    spaces, extents, nbytes
        Published spaces checked, extents read and verified, their bytes.
    problems
        One line per fault (space, key and the error), empty when all is well.
    """

    spaces: int
    extents: int
    nbytes: int
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """Whether nothing was wrong."""
        return not self.problems


def fsck(store: Store, *, data: bool = True, direct: bool = False) -> FsckReport:
    """Verify every published space of ``store``.

    Parameters
    ----------
    store
        An open store.
    data
        Also read every extent and verify its checksum (otherwise only the
        block files' identities are checked).
    direct
        Read with ``O_DIRECT`` (does not fill the page cache).
    """
    problems: list[str] = []
    n_spaces = n_ext = n_bytes = 0
    buf = aligned_empty(0)
    for sp in store.spaces():
        n_spaces += 1
        try:
            reader = store.open_reader(sp, direct=direct)
        except StoreError as exc:
            problems.append(f"space {sp.hex()}: {exc}")
            continue
        if not data:
            reader.close()
            continue
        with reader:
            for key, rec in _extent_records(store, sp, problems):
                need = -(-rec["len"] // reader.align) * reader.align
                if len(buf) < need:
                    buf = aligned_empty(need)
                try:
                    read_extent_verified(reader, rec, buf[:need])
                except StoreError as exc:
                    problems.append(f"space {sp.hex()} key {key.hex()}: {exc}")
                    continue
                n_ext += 1
                n_bytes += rec["len"]
    return FsckReport(n_spaces, n_ext, n_bytes, tuple(problems))


def _extent_records(store: Store, sp: Selector, problems: list[str]):
    """The records of ``sp`` that locate an extent; undecodable ones become problems."""
    try:
        for key, rec in store.scan(sp):
            if {"off", "len", "sum"} <= rec.keys():
                yield key, rec
    except StoreError as exc:
        problems.append(f"space {sp.hex()}: {exc}")
