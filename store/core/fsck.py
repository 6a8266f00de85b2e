"""Checking a whole store: every published space's block file and every extent.

``fsck`` answers "can every published byte still be read back exactly?": for
each sealed space it verifies the block file's identity (size, header,
generation) and, unless asked not to, reads every record's extent and checks
its XXH3-64 sum. Before that it checks the index itself: every value of every
LMDB database against its seal (see :func:`store.core.records.seal`), and that
each space still holds as many records as it was published with (a lost or
renamed record is as wrong as a flipped one). Problems are collected, not
raised one at a time, so one bad space does not hide another.
"""

from __future__ import annotations

from dataclasses import dataclass

from czyx.space import SELECTOR_SIZE, Selector
from czyx.store.core.lmdb_store import Store
from czyx.store.core.records import SEEDS, decode, unseal
from czyx.store.errors import StoreError
from czyx.store.io.reader import aligned_empty, read_extent_verified

MAX_LISTED = 50  # problems listed per database; the rest are counted


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
    counts = _check_index(store, problems)
    good_spaces = []
    for k, v in store._scan_raw(store._db["spaces"], b"", None):
        try:
            decode(unseal(SEEDS["spaces"], k, v, "space entry"), "space entry", k)
        except StoreError:
            continue  # already listed by _check_index
        if len(k) == SELECTOR_SIZE:
            good_spaces.append(Selector(k))
    for sp in good_spaces:
        n_spaces += 1
        try:
            info = store.space_info(sp)
            reader = store.open_reader(sp, direct=direct)
        except StoreError as exc:
            problems.append(f"space {sp.hex()}: {exc}")
            continue
        want, have = info.get("count"), counts.get(sp.raw, 0)
        if want != have:
            problems.append(f"space {sp.hex()}: holds {have} records, published with {want}")
        block_size = store.block_identity(sp).size
        if not data:
            reader.close()
            continue
        with reader:
            for key, rec in _extent_records(store, sp, problems):
                if rec["off"] + rec["len"] > block_size:
                    problems.append(
                        f"space {sp.hex()} key {key.hex()}: extent [{rec['off']}, "
                        f"+{rec['len']}) past the block file's {block_size} bytes"
                    )
                    continue
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


def _check_index(store: Store, problems: list[str]) -> dict[bytes, int]:
    """Check every sealed value of the index; return the record count per selector."""
    counts: dict[bytes, int] = {}
    for name, seed in SEEDS.items():
        bad = 0
        for k, v in store._scan_raw(store._db[name], b"", None):
            if name == "records":
                counts[k[:SELECTOR_SIZE]] = counts.get(k[:SELECTOR_SIZE], 0) + 1
            try:
                unseal(seed, k, v, f"{name} value")
            except StoreError as exc:
                bad += 1
                if bad <= MAX_LISTED:
                    problems.append(f"index {name}: {exc}")
        if bad > MAX_LISTED:
            problems.append(f"index {name}: {bad - MAX_LISTED} more corrupt values")
    return counts


def _extent_records(store: Store, sp: Selector, problems: list[str]):
    """The records of ``sp`` that locate an extent; undecodable ones become problems."""
    try:
        for key, rec in store.scan(sp):
            if {"off", "len", "sum"} <= rec.keys():
                if not all(
                    isinstance(rec[f], int) and not isinstance(rec[f], bool) and rec[f] >= 0
                    for f in ("off", "len", "sum")
                ):
                    problems.append(f"space {sp.hex()} key {key.hex()}: bad extent fields")
                    continue
                yield key, rec
    except StoreError as exc:
        problems.append(f"space {sp.hex()}: {exc}")
