"""A reusable conformance suite for :class:`store.interfaces.StoreInterface` backends.

In the manner of zarr-python's ``StoreTests``: a backend's test module
subclasses :class:`StoreConformance` and implements :meth:`open_store`; every
test below then runs against that backend. The suite checks the contract in
``STORE_API.md``: records and their key checks, class-range scans in packed-key
order, aggregates, atomic publication and sealing, tags, portal descriptors,
edges and the audit log, and persistence across reopen.
"""

from __future__ import annotations

import itertools
import os
import pathlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from czyx.key import KEY_SIZE, Key
from czyx.space import Selector
from czyx.store.errors import (
    BlockFileError,
    KeyLengthError,
    SealedSpaceError,
    SpaceInUseError,
    SpaceNotFoundError,
    TagConflictError,
    TagNotFoundError,
)
from czyx.store.interfaces import StoreInterface
from czyx.store.io.reader import aligned_empty, read_extent_verified

_counter = itertools.count()


def fresh_space() -> Selector:
    """A selector no other test uses (hypothesis examples share one store)."""
    return Selector.from_name(f"conformance-{next(_counter)}")


keys_st = st.lists(
    st.tuples(
        st.integers(0, 255),
        st.integers(0, 2**61 - 1),
        st.integers(0, 2**61 - 1),
        st.integers(0, 2**61 - 1),
    ),
    min_size=0,
    max_size=40,
    unique=True,
)
record_st = st.dictionaries(
    st.text(max_size=8),
    st.one_of(st.integers(-(2**63), 2**64 - 1), st.binary(max_size=16), st.text(max_size=16)),
    max_size=4,
)
_hyp = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


class StoreConformance:
    """Subclass and implement :meth:`open_store` to check a backend."""

    def open_store(self, path: pathlib.Path) -> StoreInterface:
        """Create or open the backend's store at ``path``."""
        raise NotImplementedError

    def block_files(self, store: StoreInterface) -> list[str]:
        """Names of the backend's block files (override for a backend without ``blocks/``)."""
        blocks = store.path / "blocks"
        return sorted(p.name for p in blocks.iterdir()) if blocks.is_dir() else []

    @pytest.fixture
    def store_path(self, tmp_path: pathlib.Path) -> pathlib.Path:
        return tmp_path / "store"

    @pytest.fixture
    def store(self, store_path: pathlib.Path):
        s = self.open_store(store_path)
        yield s
        s.close()

    # -- records -----------------------------------------------------------------------
    def test_put_get_delete(self, store: StoreInterface) -> None:
        sp, k = fresh_space(), Key(3, 1, 2, 3).pack()
        assert store.get(sp, k) is None
        store.put(sp, k, {"a": 1, "b": b"\x00\xff"})
        assert store.get(sp, k) == {"a": 1, "b": b"\x00\xff"}
        store.put(sp, k, {"a": 2})
        assert store.get(sp, k) == {"a": 2}
        assert store.delete(sp, k) is True
        assert store.delete(sp, k) is False
        assert store.get(sp, k) is None

    @_hyp
    @given(rec=record_st)
    def test_record_roundtrip(self, store: StoreInterface, rec: dict) -> None:
        sp, k = fresh_space(), Key(0).pack()
        store.put(sp, k, rec)
        assert store.get(sp, k) == rec

    def test_put_many_is_counted_and_visible(self, store: StoreInterface) -> None:
        sp = fresh_space()
        items = [(Key(c, c).pack(), {"i": c}) for c in range(50)]
        assert store.put_many(sp, items) == 50
        assert all(store.get(sp, k) == r for k, r in items)

    @pytest.mark.parametrize("bad", [b"", b"\x00" * (KEY_SIZE - 1), b"\x00" * (KEY_SIZE + 1)])
    def test_wrong_key_length(self, store: StoreInterface, bad: bytes) -> None:
        sp = fresh_space()
        with pytest.raises(KeyLengthError):
            store.put(sp, bad, {})
        with pytest.raises(KeyLengthError):
            store.get(sp, bad)
        with pytest.raises(KeyLengthError):
            store.delete(sp, bad)
        with pytest.raises(KeyLengthError):
            store.put_many(sp, [(Key(1).pack(), {}), (bad, {})])
        assert store.get(sp, Key(1).pack()) is None  # the batch was all-or-nothing

    def test_key_must_be_bytes(self, store: StoreInterface) -> None:
        with pytest.raises(KeyLengthError):
            store.get(fresh_space(), "x" * KEY_SIZE)  # type: ignore[arg-type]

    def test_wrong_selector(self, store: StoreInterface) -> None:
        with pytest.raises(KeyLengthError):
            store.get(b"\x01" * 31, Key(0).pack())  # type: ignore[arg-type]

    # -- scans -------------------------------------------------------------------------
    @_hyp
    @given(coords=keys_st, lo=st.integers(0, 255), span=st.integers(0, 255))
    def test_scan_is_class_range_in_key_order(
        self, store: StoreInterface, coords: list, lo: int, span: int
    ) -> None:
        hi = min(255, lo + span)
        sp, other = fresh_space(), fresh_space()
        keys = [Key(*c).pack() for c in coords]
        store.put_many(sp, [(k, {"len": i}) for i, k in enumerate(keys)])
        store.put_many(other, [(k, {"len": 1}) for k in keys])  # must never leak into sp
        want = sorted(k for k in keys if lo <= k[0] <= hi)
        got = list(store.scan(sp, lo, hi))
        assert [k for k, _ in got] == want
        assert all(r == {"len": keys.index(k)} for k, r in got)
        assert store.aggregate(sp, lo, hi) == (len(want), sum(keys.index(k) for k in want))

    def test_scan_one_class_excludes_neighbours(self, store: StoreInterface) -> None:
        sp = fresh_space()
        for c in (0x2A - 1, 0x2A, 0x2B):
            store.put(sp, Key(c, 5, 5, 5).pack(), {"c": c})
        assert [r["c"] for _, r in store.scan(sp, 0x2A, 0x2A)] == [0x2A]
        assert [r["c"] for _, r in store.scan(sp)] == [0x29, 0x2A, 0x2B]

    def test_scan_rejects_bad_class_range(self, store: StoreInterface) -> None:
        with pytest.raises(ValueError):
            list(store.scan(fresh_space(), 5, 4))
        with pytest.raises(ValueError):
            list(store.scan(fresh_space(), 0, 256))

    def test_aggregate_ignores_records_without_len(self, store: StoreInterface) -> None:
        sp = fresh_space()
        store.put_many(sp, [(Key(1, i).pack(), {"len": 10}) for i in range(5)])
        store.put(sp, Key(1, 99).pack(), {"note": "no extent"})
        assert store.aggregate(sp) == (6, 50)
        assert store.aggregate(sp, 2, 255) == (0, 0)

    # -- spaces ------------------------------------------------------------------------
    def _publish(self, store: StoreInterface, n: int = 5) -> tuple[Selector, dict]:
        sp = fresh_space()
        rng = np.random.default_rng(n)
        payloads = {}
        with store.begin_space(sp, {"arch": "test", "n": n}) as w:
            for i in range(n):
                data = rng.integers(0, 256, size=1000 + 3000 * i, dtype=np.uint8)
                ext = w.write_extent(data)
                k = Key(i, i).pack()
                w.put(k, {**ext.record(), "fmt": "u8"})
                payloads[k] = data.tobytes()
        return sp, payloads

    def test_publish_and_read_back(self, store: StoreInterface) -> None:
        sp, payloads = self._publish(store)
        assert store.has_space(sp)
        assert sp in store.spaces()
        assert store.manifest(sp) == {"arch": "test", "n": 5}
        assert store.block_path(sp).exists()
        with store.open_reader(sp) as rd:
            for k, want in payloads.items():
                rec = store.get(sp, k)
                assert rec["off"] % 4096 == 0
                buf = aligned_empty(rec["len"])
                read_extent_verified(rd, rec, buf)
                assert buf.tobytes() == want
        assert store.aggregate(sp) == (5, sum(len(v) for v in payloads.values()))

    @pytest.mark.parametrize("mode", [{}, {"direct": True}, {"mapped": True}])
    def test_reader_modes_agree(self, store: StoreInterface, mode: dict) -> None:
        sp, payloads = self._publish(store, 3)
        with store.open_reader(sp, **mode) as rd:
            for k, want in payloads.items():
                rec = store.get(sp, k)
                buf = aligned_empty(-(-rec["len"] // 4096) * 4096)
                read_extent_verified(rd, rec, buf)
                assert buf[: rec["len"]].tobytes() == want

    def test_open_reader_refuses_a_damaged_block_file(self, store: StoreInterface) -> None:
        sp, _ = self._publish(store, 2)
        store.verify_space(sp)
        path = store.block_path(sp)
        os.truncate(path, path.stat().st_size - 1)
        with pytest.raises(BlockFileError):
            store.open_reader(sp)
        with pytest.raises(SpaceNotFoundError):
            store.open_reader(fresh_space())

    def test_failed_publication_leaves_nothing(self, store: StoreInterface) -> None:
        sp = fresh_space()
        before = self.block_files(store)
        with pytest.raises(RuntimeError), store.begin_space(sp, {"x": 1}) as w:
            w.put(Key(1).pack(), w.write_extent(b"abc").record())
            raise RuntimeError("boom")
        assert not store.has_space(sp)
        assert list(store.scan(sp)) == []
        with pytest.raises(SpaceNotFoundError):
            store.manifest(sp)
        assert self.block_files(store) == before

    def test_sealed_space_refuses_writes(self, store: StoreInterface) -> None:
        sp, payloads = self._publish(store, 2)
        k = next(iter(payloads))
        with pytest.raises(SealedSpaceError):
            store.begin_space(sp, {})
        with pytest.raises(SealedSpaceError):
            store.put(sp, Key(200).pack(), {})
        with pytest.raises(SealedSpaceError):
            store.put_many(sp, [(Key(200).pack(), {})])
        with pytest.raises(SealedSpaceError):
            store.delete(sp, k)
        assert store.get(sp, Key(200).pack()) is None
        assert store.get(sp, k) is not None

    def test_remove_space(self, store: StoreInterface) -> None:
        sp, payloads = self._publish(store, 3)
        keep, _ = self._publish(store, 2)
        block = store.block_path(sp)
        store.set_tag("m@1", sp)
        store.set_tag("m@2", sp)
        store.remove_tag("m@1")
        with pytest.raises(SpaceInUseError, match="m@2"):
            store.remove_space(sp)  # still tagged: nothing changes
        assert store.has_space(sp) and block.exists()
        store.remove_tag("m@2")
        assert store.remove_space(sp) == block
        assert not block.exists()
        assert not store.has_space(sp) and sp not in store.spaces()
        assert list(store.scan(sp)) == []
        assert all(store.get(sp, k) is None for k in payloads)
        assert store.remove_space(sp) is None  # idempotent
        assert store.has_space(keep) and len(list(store.scan(keep))) == 2
        store.put(sp, Key(1).pack(), {"v": 1})  # the selector is writable again

    def test_unknown_space(self, store: StoreInterface) -> None:
        sp = fresh_space()
        assert not store.has_space(sp)
        with pytest.raises(SpaceNotFoundError):
            store.manifest(sp)
        with pytest.raises(SpaceNotFoundError):
            store.block_path(sp)

    def test_reopen_keeps_everything(self, store_path: pathlib.Path) -> None:
        s = self.open_store(store_path)
        sp, payloads = self._publish(s, 3)
        gen = fresh_space()
        s.put(gen, Key(7).pack(), {"v": 7})
        s.set_tag("m@1", sp)
        s.close()
        s = self.open_store(store_path)
        try:
            assert s.manifest(sp)["n"] == 3
            assert s.get(gen, Key(7).pack()) == {"v": 7}
            assert s.resolve_tag("m@1") == sp
            assert [k for k, _ in s.scan(sp)] == sorted(payloads)
        finally:
            s.close()

    # -- tags --------------------------------------------------------------------------
    def test_tags(self, store: StoreInterface) -> None:
        a, b = fresh_space(), fresh_space()
        with pytest.raises(TagNotFoundError):
            store.resolve_tag("m@1")
        store.set_tag("m@1", a)
        store.set_tag("m@1", a)  # idempotent
        with pytest.raises(TagConflictError):
            store.set_tag("m@1", b)
        store.set_tag("m@2", b)
        assert store.resolve_tag("m@1") == a
        assert store.tags() == {"m@1": a, "m@2": b}

    # -- portals, edges, audit ---------------------------------------------------------
    def test_portal_descriptors(self, store: StoreInterface) -> None:
        assert store.get_portal_descriptor(b"p1") is None
        store.put_portal_descriptor(b"p2", {"rights": ["read"]})
        store.put_portal_descriptor(b"p1", {"rights": ["infer"], "parent": None})
        assert store.get_portal_descriptor(b"p1") == {"rights": ["infer"], "parent": None}
        assert [k for k, _ in store.portal_descriptors()] == [b"p1", b"p2"]

    def test_edges_by_prefix(self, store: StoreInterface) -> None:
        for k in (b"ab1", b"ab2", b"ac1", b"b"):
            store.put_edge(k, {"k": k})
        assert [k for k, _ in store.edges(b"ab")] == [b"ab1", b"ab2"]
        assert [k for k, _ in store.edges()] == [b"ab1", b"ab2", b"ac1", b"b"]
        assert list(store.edges(b"zz")) == []

    def test_audit_log_is_ordered_and_append_only(self, store: StoreInterface) -> None:
        start = len(list(store.audit_log()))
        for i in range(5):
            store.audit("grant", portal=f"p{i}", n=i)
        log = list(store.audit_log())[start:]
        assert [e["n"] for e in log] == list(range(5))
        seqs = [e["seq"] for e in store.audit_log()]
        assert seqs == sorted(set(seqs))
        assert all(e["event"] == "grant" and isinstance(e["time"], float) for e in log)
