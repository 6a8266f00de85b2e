"""The store side of replication without a network: offers, plans, staging, publication."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from czyx.space import Selector
from czyx.store import Store
from czyx.store.core.staging import PlannedExtent, StagedSpace, StagingError
from czyx.store.models.mount import mount
from czyx.store.models.replicate import (
    Range,
    ReplicationError,
    SubsetNotAllowed,
    build_offer,
    offer_intervals,
    plan_pull,
    range_allowed,
    run_pull,
)

ASSET = Path(__file__).resolve().parents[2] / "inference" / "assets" / "czyx-moe-stdlib"


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    with Store.open(tmp_path_factory.mktemp("src") / "store") as s:
        mount(s, ASSET, "m@1")
        yield s


def _reader(store):
    def fetch(space, start, end):
        with open(store.block_path(Selector.from_hex(space)), "rb") as f:
            f.seek(start)
            return f.read(end - start)

    return fetch


def test_plan_is_deterministic_and_copies_everything(src, tmp_path):
    offer = build_offer(src, "m@1")
    with Store.open(tmp_path / "d") as dest:
        a, b = plan_pull(dest, offer), plan_pull(dest, offer)
        assert a == b
        assert a.bytes_to_fetch == a.bytes_total > 0
        seen = []
        res = run_pull(
            dest,
            a,
            _reader(src),
            tag="m@1",
            max_range=1 << 16,
            progress=lambda d, t: seen.append((d, t)),
        )
        assert res.bytes_fetched == a.bytes_total
        # progress: bytes here out of the version's, rising to all of them
        done = [d for d, _ in seen]
        assert len(seen) > 1 and done == sorted(done) and seen[-1] == (a.bytes_total,) * 2
        assert dest.resolve_tag("m@1") == src.resolve_tag("m@1")
        assert not (Path(dest.path) / "staging" / a.version.hex()).exists()


def test_tampered_manifest_is_refused(src, tmp_path):
    offer = copy.deepcopy(build_offer(src, "m@1"))
    offer["spaces"][-1]["manifest"]["experts"][0][2] = "0" * 64
    with Store.open(tmp_path / "d") as dest, pytest.raises(ReplicationError, match="hashes"):
        plan_pull(dest, offer)


def test_subset_offer_respects_allows(src):
    with pytest.raises(SubsetNotAllowed):
        build_offer(src, "m@1", allows=lambda c, z: c < 8)
    offer = build_offer(src, "m@1", classes=Range(0, 7), allows=lambda c, z: c < 8)
    assert offer["subset"] == {"classes": [0, 7], "layers": None}


def test_intervals_allow_runs_of_offered_extents_only(src):
    offer = build_offer(src, "m@1", classes=Range(0, 0), layers=Range(1, 1))
    iv = offer_intervals(offer)
    sel = offer["version"]
    ((a, b),) = iv[sel]
    assert range_allowed(iv[sel], a, b) and not range_allowed(iv[sel], a, b + 4096)
    assert not range_allowed(iv[sel], a - 1, b)
    assert not range_allowed(iv.get("f" * 64, []), 0, 1)


def test_range_parse():
    assert Range.parse("3-9", 256, "c") == Range(3, 9) and Range.parse("5", 256, "c") == Range(5, 5)
    for bad in ("9-3", "x", "1-2-3", "0-256"):
        with pytest.raises(ValueError):
            Range.parse(bad, 256, "c")


def test_staging_resumes_refuses_other_plan_and_incomplete(tmp_path):
    with Store.open(tmp_path / "d") as dest:
        align = StagedSpace.data_start_for(dest)
        sel = Selector.from_content(b'{"kind":"x"}')
        data = [np.full(100, i, np.uint8).tobytes() for i in range(3)]
        from czyx.store.core.checksum import checksum

        ext = [PlannedExtent(align * (i + 1), 100, checksum(d)) for i, d in enumerate(data)]
        recs = [
            (bytes(23) + bytes([i]), {"off": e.offset, "len": 100, "sum": e.checksum})
            for i, e in enumerate(ext)
        ]
        st = StagedSpace.open(dest, sel, {"kind": "x"}, align * 4, recs, ext)
        bad = st.receive([(ext[0].offset, data[0]), (ext[1].offset, data[0])])
        assert [e.offset for e in bad] == [ext[1].offset]  # wrong bytes refused
        with pytest.raises(StagingError, match="not arrived"):
            st.publish()
        st.close()
        journal = Path(dest.path) / "staging" / sel.hex() / "arrived"
        with open(journal, "ab") as f:
            f.write(b"\x01\x02\x03")  # a torn entry, as a crash mid-append leaves
        with pytest.raises(StagingError, match="another plan"):
            StagedSpace.open(dest, sel, {"kind": "x"}, align * 5, recs, ext)
        st = StagedSpace.open(dest, sel, {"kind": "x"}, align * 4, recs, ext)
        assert st.arrived == {ext[0].offset}  # resumed; the torn entry dropped
        assert st.receive([(e.offset, d) for e, d in zip(ext[1:], data[1:])]) == []
        st.publish()
        assert dest.has_space(sel)
        with dest.open_reader(sel) as r:
            buf = np.empty(100, np.uint8)
            r.read_into(ext[2].offset, buf)
            assert buf.tobytes() == data[2]


@settings(max_examples=60)
@given(
    st.lists(
        st.tuples(st.sampled_from(["a" * 64, "b" * 64]), st.integers(0, 40), st.integers(1, 9000)),
        min_size=1,
        max_size=30,
        unique_by=lambda t: (t[0], t[1]),
    ),
    st.integers(4096, 40000),
)
def test_coalesced_runs_cover_each_fetch_once_within_bounds(items, max_range):
    from czyx.store.models.replicate import Fetch, _coalesce

    # extents at 16 KiB slots: lengths up to 9000 leave padding, gaps of slots skip
    fetches = [Fetch(b, s * 16384, n, 0, i * 16384) for i, (b, s, n) in enumerate(items)]
    runs = _coalesce(fetches, max_range)
    flat = [f for r in runs for f in r]
    assert sorted(flat, key=id) == sorted(fetches, key=id)
    for r in runs:
        assert len({f.src_block for f in r}) == 1
        span = r[-1].src_off + r[-1].length - r[0].src_off
        assert len(r) == 1 or span <= max_range
        for p, q in itertools.pairwise(r):  # only alignment padding between neighbours
            assert p.src_off + p.length <= q.src_off < p.src_off + p.length + 4096


def test_forged_record_is_caught_by_the_content_hash(src, tmp_path):
    offer = copy.deepcopy(build_offer(src, "m@1"))
    recs = offer["spaces"][-1]["records"]
    # point the first expert at the second one's bytes, with a matching XXH3 sum:
    # the checksum passes, the manifest-anchored BLAKE3 hash does not
    recs[0][1]["off"], recs[0][1]["sum"] = recs[1][1]["off"], recs[1][1]["sum"]
    with Store.open(tmp_path / "d") as dest:
        plan = plan_pull(dest, offer)
        with pytest.raises(ReplicationError, match="3 times"):
            run_pull(dest, plan, _reader(src), retries=3)
        assert not dest.has_space(plan.version)
    trunk = copy.deepcopy(build_offer(src, "m@1"))
    trunk["spaces"][0]["records"][0][1]["hash"] = "0" * 64
    with Store.open(tmp_path / "e") as dest, pytest.raises(ReplicationError, match="trunk"):
        plan_pull(dest, trunk)
