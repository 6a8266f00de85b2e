"""Importance maps as records at the weights' coordinates, and back."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from czyx.inference.calibration import ImportanceCollector, Provenance
from czyx.key import Key
from czyx.store.quant.errors import CalibrationError
from czyx.store.quant.importance import importance_from_records, importance_records

ROLES = {"q_proj": 3, "o_proj": 6, "router": 11, "lm_head": 2, "shared_down_proj": 14}


def _collector() -> ImportanceCollector:
    rng = np.random.default_rng(0)
    col = ImportanceCollector()
    for name, cols in (
        ("L0.attn_in", 8),
        ("L0.o_in", 8),
        ("L1.moe_in", 8),
        ("L1.E5.in", 8),
        ("L1.E5.down_in", 4),
        ("L1.E7.in", 8),
        ("L1.shared.down_in", 6),
        ("lm_head_in", 8),
    ):
        col.add(name, rng.standard_normal((3, cols)).astype(np.float32))
    return col


def test_records_sit_at_the_weights_coordinates_and_round_trip():
    col = _collector()
    prov = Provenance.for_text("calibration text", 99)
    data = col.to_dict(prov)
    perm = lambda layer, byte: (byte * 7 + layer) % 256  # noqa: E731 - a class permutation
    recs = importance_records(data, perm, ROLES)
    keys = {Key.unpack(k): r for k, r in recs}
    assert len(keys) == len(recs) == 5 + 2  # 5 trunk inputs, 2 experts
    e5 = keys[Key(perm(1, 5), 1, 0, 0)]
    assert set(e5["inputs"]) == {"in", "down_in"} and e5["expert"] == 5
    assert keys[Key(ROLES["q_proj"], 0, 1, 0)]["name"] == "L0.attn_in"
    assert keys[Key(ROLES["lm_head"], 0, 1, 0)]["name"] == "lm_head_in"
    wire = [msgpack.unpackb(msgpack.packb(r), raw=False) for _, r in recs]
    back, prov2 = ImportanceCollector.from_dict(importance_from_records(wire, data["provenance"]))
    assert prov2 == prov and back.names() == col.names()
    for name in col.names():
        assert back.count(name) == col.count(name)
        assert np.array_equal(back.importance(name), col.importance(name))


def test_bad_names_and_records_fail_closed():
    data = _collector().to_dict(Provenance("0" * 64, 1))
    with pytest.raises(CalibrationError, match="router"):
        importance_records(data, lambda layer, b: b, {"q_proj": 1, "o_proj": 2})
    data["matrices"]["L0.weird"] = data["matrices"]["L0.o_in"]
    with pytest.raises(CalibrationError, match=r"L0\.weird"):
        importance_records(data, lambda layer, b: b, ROLES)
    with pytest.raises(CalibrationError):
        importance_records({"format": "nope"}, lambda layer, b: b, ROLES)
    with pytest.raises(CalibrationError):
        importance_from_records([{"foo": 1}], {})


def test_publish_and_load_through_a_store(tmp_path):
    from czyx.space import Selector
    from czyx.store.core.lmdb_store import Store
    from czyx.store.quant.importance import load_importance, publish_importance

    col = _collector()
    data = col.to_dict(Provenance.for_text("text", 24))
    model = Selector.from_name("some-model")
    with Store.open(tmp_path / "s") as store:
        sel = publish_importance(store, model, data, lambda layer, b: b, ROLES, tag="m-imp@1")
        assert publish_importance(store, model, data, lambda layer, b: b, ROLES) == sel
        assert store.resolve_tag("m-imp@1") == sel
        back, model_hex = load_importance(store, sel)
        assert model_hex == model.hex()
        loaded, prov = ImportanceCollector.from_dict(back)
        assert prov.n_tokens == 24 and loaded.names() == col.names()
        assert np.array_equal(loaded.importance("L1.E5.down_in"), col.importance("L1.E5.down_in"))
        other = Selector.from_name("not-importance")
        with store.begin_space(other, {"kind": "something-else"}):
            pass
        with pytest.raises(CalibrationError, match="not an importance map"):
            load_importance(store, other)
