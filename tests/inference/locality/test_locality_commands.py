"""``czyx locality`` end to end on a small synthetic trace."""

from __future__ import annotations

import json

import numpy as np

from czyx.cli import main
from czyx.inference.locality.ordering import check_class_order, class_order_from_trace

from .conftest import random_trace


def test_locality_cli_writes_report_and_class_order(tmp_path, capsys) -> None:
    tr = random_trace(200, 2, 8, 2, seed=5)
    path = tr.save(tmp_path / "trace.npz")
    out = tmp_path / "out"
    assert main(["locality", str(path), "--out", str(out), "--budgets", "2,4,8"]) == 0
    text = capsys.readouterr().out
    assert "Cache hit rate by policy" in text and "identity/layer-major" in text
    res = json.loads((out / "report.json").read_text())
    assert res["budgets"] == [2, 4, 8]
    assert set(res["hit_rates"]) == {"lru", "hotness", "slru", "pinned", "belady"}
    for p, rates in res["hit_rates"].items():
        assert all(r <= b + 1e-12 for r, b in zip(rates, res["hit_rates"]["belady"])), p
    order = class_order_from_trace(out / "class_order.npy")
    check_class_order(order, 2, 8, "cli")
    assert np.array_equal(order, class_order_from_trace(path))


def test_locality_cli_one_line_error(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"nope")
    assert main(["locality", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("czyx: error:") and "bad.npz" in err and err.count("\n") == 1
