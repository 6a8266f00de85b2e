"""For all key sets, class ranges and chunk sizes: chunked scans equal a sorted filter.

``Store.scan``/``keys`` and ``Snapshot.scan`` cut rows into chunks (each cut at
the range's end by bisection); these properties pin the chunk edges, the
range edges and the selector boundary (a neighbouring space's rows).
"""

from __future__ import annotations

import pathlib
import tempfile

from hypothesis import given, settings
from hypothesis import strategies as st

import czyx.store.core.lmdb_store as lmdb_store_mod
import czyx.store.core.snapshot as snapshot_mod
from czyx.key import KEY_SIZE
from czyx.space import Selector
from czyx.store import Store

# The space under test and its two nearest neighbours in selector order.
SPACE, BEFORE, AFTER = (Selector(b"\x10" * 31 + bytes([x])) for x in (0x80, 0x7F, 0x81))
keys_st = st.sets(st.binary(min_size=KEY_SIZE, max_size=KEY_SIZE), max_size=40)
cls_st = st.integers(0, 255)


@settings(max_examples=40, deadline=None)
@given(keys=keys_st, a=cls_st, b=cls_st, chunk=st.integers(1, 7))
def test_scans_equal_a_sorted_filter(keys: set[bytes], a: int, b: int, chunk: int) -> None:
    lo, hi = min(a, b), max(a, b)
    saved = lmdb_store_mod._SCAN_CHUNK, snapshot_mod.SCAN_CHUNK
    lmdb_store_mod._SCAN_CHUNK = snapshot_mod.SCAN_CHUNK = chunk
    try:
        with tempfile.TemporaryDirectory() as d:
            s = Store.open(pathlib.Path(d) / "s")
            sp = SPACE
            items = [(k, {"k": k}) for k in keys]
            s.put_many(sp, items)
            for other in (BEFORE, AFTER):  # their rows must never leak into the scan
                s.put_many(other, items)
            want = sorted((k, r) for k, r in items if lo <= k[0] <= hi)
            assert list(s.scan(sp, lo, hi)) == want
            assert list(s.keys(sp, lo, hi)) == [k for k, _ in want]
            with s.snapshot() as snap:
                assert list(snap.scan(sp, lo, hi)) == want
            s.close()
    finally:
        lmdb_store_mod._SCAN_CHUNK, snapshot_mod.SCAN_CHUNK = saved
