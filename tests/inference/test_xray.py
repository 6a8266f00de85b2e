"""X-Ray: the report of a real streamed run validates against its schema and adds up."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from czyx.inference import xray as xr
from czyx.inference.streaming import StreamingExpertCache
from czyx.testing.filemodel import FileConsumer, SyntheticExperts


@pytest.fixture
def run(tmp_path):
    fc = FileConsumer(SyntheticExperts(n_layers=3, n_experts=8), tmp_path)
    x = xr.XRay(io_path="pread", readers=2, device_baseline=1e9)
    slot = fc.info.expert_slot_nbytes
    cache = StreamingExpertCache(fc, 5 * slot, 2, io="pread", readers=2, xray=x)
    cache.set_routers([np.eye(8, 6, dtype=np.float32)] * 3)
    rng = np.random.default_rng(0)
    for _ in range(6):  # six "tokens": route, predict the next layer, acquire
        for layer in range(3):
            h = rng.standard_normal((1, 6)).astype(np.float32)
            cache.lookahead(layer, h)
            cache.acquire(layer, rng.choice(8, 2, replace=False))
            cache.release()
    cache.planner.drain()
    report = x.report(cache, tokens=6, trunk_bytes=1000, extra={"model": "synthetic"})
    yield x, cache, report
    cache.close()
    fc.close()


def test_report_validates_against_the_schema(run, tmp_path):
    x, _, report = run
    schema = xr.load_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    path = x.write_json(tmp_path / "xray.json", report)
    jsonschema.validate(json.loads(path.read_text()), schema)


def test_schema_rejects_a_malformed_report(run):
    _, _, report = run
    bad = json.loads(json.dumps(report))
    bad["transfers"][0]["outcome"] = "substituted"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, xr.load_schema())
    del bad["run"]["hit_rate"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, xr.load_schema())


def test_the_run_adds_up(run):
    _, cache, report = run
    r, recs = report["run"], report["transfers"]
    assert r["transfers"] == len(recs) == sum(r["outcomes"].values())
    assert r["bytes_read"] == sum(t["completed_bytes"] for t in recs)
    assert r["hits"] + sum(t["kind"] == "demand" for t in recs) == r["lookups"] == 6 * 3 * 2
    assert r["model_bytes_resident"] == 1000 + 5 * cache.slot_nbytes
    assert r["prefetch_issued"] == cache.prefetches > 0
    assert r["prefetch_wasted"] == r["outcomes"]["wasted"]
    assert 0.0 <= r["prefetch_recall"] <= 1.0
    assert r["bytes_read_per_token"] == r["bytes_read"] / 6
    for t in recs:
        # Verified before use; a wasted native prefetch never was (nor needed to be).
        want = ("ok", "pending") if t["outcome"] == "wasted" else ("ok",)
        assert t["checksum"] in want and t["completed_bytes"] == t["requested_bytes"]
        assert t["t_request_us"] <= t["t_start_us"] <= t["t_complete_us"]
        if t["t_first_use_us"] is not None:
            assert t["t_first_use_us"] >= t["t_request_us"]
        if t["kind"] == "demand":
            assert t["outcome"] in ("demand", "failed") and t["prefetch_lead_us"] is None
    assert r["useful_bytes"] <= r["bytes_read"]
    assert r["staging_copy_bytes"] == r["bytes_read"]  # pread: through the page cache


def test_table_names_the_key_figures(run):
    _, _, report = run
    text = xr.table(report)
    for label in ("hit rate", "hidden / exposed", "prefetch recall", "useful bandwidth"):
        assert label in text


@given(st.lists(st.tuples(st.integers(0, 100), st.integers(0, 50)), max_size=20))
def test_busy_time_is_the_union_of_intervals(spans):
    intervals = [(s, s + d) for s, d in spans]
    covered = set()
    for s, e in intervals:
        covered.update(range(s, e))
    assert xr._busy_ns(intervals) == len(covered)


def test_since_mark_reports_only_the_window(run):
    x, cache, _ = run
    x.mark(cache)
    n_before = len(x.transfers)
    cache.acquire(0, np.array([6, 7]))
    cache.release()
    cache.planner.drain()
    r = x.report(cache, tokens=1, since_mark=True)
    assert r["run"]["lookups"] == 2
    assert r["run"]["transfers"] == len(x.transfers) - n_before <= 2
    jsonschema.validate(r, xr.load_schema())
