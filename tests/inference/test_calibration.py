"""Importance collection, its serialised form, and that it lowers real output error."""

from __future__ import annotations

import hashlib

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from czyx.inference.calibration import ImportanceCollector, Provenance, input_key
from czyx.store.quant.errors import CalibrationError
from czyx.store.quant.formats import dequantize, quantize


def test_mean_squared_activation_per_column():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((5, 3, 16)).astype(np.float32)
    b = rng.standard_normal((7, 16)).astype(np.float32)
    col = ImportanceCollector()
    col.add("m", a)
    col.add("m", b)
    rows = np.concatenate([a.reshape(-1, 16), b]).astype(np.float64)
    assert col.count("m") == 22
    assert np.allclose(col.importance("m"), (rows**2).mean(axis=0), rtol=1e-6)
    assert col.importance("m").dtype == np.float32


@settings(max_examples=25)
@given(
    splits=st.lists(st.integers(1, 6), min_size=1, max_size=5),
    cols=st.integers(1, 40),
    seed=st.integers(0, 2**32 - 1),
)
def test_merge_and_serialise_round_trip(splits, cols, seed):
    rng = np.random.default_rng(seed)
    whole, parts = ImportanceCollector(), []
    for n in splits:
        x = rng.standard_normal((n, cols)).astype(np.float32)
        whole.add("L0.attn_in", x)
        part = ImportanceCollector()
        part.add("L0.attn_in", x)
        part.add("lm_head_in", x[:, :1])
        parts.append(part)
    merged = ImportanceCollector()
    for p in parts:
        merged.merge(p)
    assert merged.count("L0.attn_in") == whole.count("L0.attn_in") == sum(splits)
    assert np.allclose(merged.importance("L0.attn_in"), whole.importance("L0.attn_in"))
    prov = Provenance.for_text("some text", n_tokens=sum(splits), source="t.txt")
    wire = msgpack.unpackb(msgpack.packb(merged.to_dict(prov)), raw=False)
    back, prov2 = ImportanceCollector.from_dict(wire)
    assert prov2 == prov
    assert back.names() == merged.names() == ["L0.attn_in", "lm_head_in"]
    for name in back.names():
        assert back.count(name) == merged.count(name)
        assert np.array_equal(back.importance(name), merged.importance(name))


def test_provenance_hashes_the_text():
    p = Provenance.for_text("héllo", 3)
    assert p.text_sha256 == hashlib.sha256("héllo".encode()).hexdigest()
    assert Provenance.for_text(b"abc", 1).text_sha256 == hashlib.sha256(b"abc").hexdigest()


def test_errors():
    col = ImportanceCollector()
    col.add("m", np.ones((2, 4), np.float32))
    with pytest.raises(CalibrationError, match="4"):
        col.add("m", np.ones((2, 5), np.float32))
    with pytest.raises(CalibrationError):
        col.add("m", np.array([[np.inf, 0, 0, 0]], np.float32))
    with pytest.raises(CalibrationError):
        col.importance("absent")
    with pytest.raises(CalibrationError):
        ImportanceCollector.from_dict({"format": "other"})
    good = col.to_dict(Provenance("0" * 64, 2))
    good["matrices"]["m"]["sumsq"] = b"\x00" * 8
    with pytest.raises(CalibrationError, match="m"):
        ImportanceCollector.from_dict(good)


def test_input_keys():
    assert input_key(3, "q_proj") == input_key(3, "v_proj") == "L3.attn_in"
    assert input_key(3, "router") == input_key(3, "shared_up_proj") == "L3.moe_in"
    assert input_key(3, "gate_proj", 42) == input_key(3, "up_proj", 42) == "L3.E42.in"
    assert input_key(3, "down_proj", 42) == "L3.E42.down_in"
    assert input_key(None, "lm_head") == "lm_head_in"
    assert input_key(None, "embed") is None
    for bad in ((None, "q_proj", None), (1, "input_norm", None), (1, "q_proj", 4)):
        with pytest.raises(CalibrationError):
            input_key(*bad)


@pytest.mark.parametrize("fmt", ["q2", "q4"])
def test_importance_lowers_output_error_on_skewed_inputs(fmt):
    """A measurement on held-out inputs: weighting by the calibration importance of
    skewed-energy input columns lowers the error of the layer's *output*."""
    rng = np.random.default_rng(1)
    rows, cols = 96, 256
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    energy = np.exp(rng.normal(0.0, 1.0, cols)).astype(np.float32)
    calib = (rng.standard_normal((1024, cols)) * energy).astype(np.float32)
    held_out = (rng.standard_normal((1024, cols)) * energy).astype(np.float32)
    col = ImportanceCollector()
    col.add("m", calib)
    imp = col.importance("m")
    plain = dequantize(quantize(w, fmt), fmt, w.shape)
    weighted = dequantize(quantize(w, fmt, importance=imp), fmt, w.shape)
    err_plain = float(np.mean((held_out @ (w - plain).T) ** 2))
    err_weighted = float(np.mean((held_out @ (w - weighted).T) ** 2))
    assert err_weighted < 0.85 * err_plain
    # and it is a trade, not a free lunch: the unweighted weight error grows
    assert np.mean((w - weighted) ** 2) > np.mean((w - plain) ** 2)


def test_importance_map_shrinks_sparse_experts_toward_their_layer():
    rng = np.random.default_rng(4)
    col = ImportanceCollector()
    layer_x = rng.standard_normal((400, 8)).astype(np.float32)
    col.add("L0.moe_in", layer_x)
    col.add("L0.E1.in", 10 * layer_x[:2])  # two tokens, far from the layer
    col.add("L0.E2.in", 10 * layer_x[:400])  # plenty of tokens
    col.add("L0.E1.down_in", np.ones((2, 4), np.float32))
    col.add("L0.E2.down_in", 3 * np.ones((6, 4), np.float32))
    col.add("L0.attn_in", layer_x)
    m = col.importance_map(prior_tokens=32)
    layer = col.importance("L0.moe_in")
    # the rare expert moves most of the way to the layer, the busy one barely
    assert (
        np.abs(m["L0.E1.in"] - layer).mean()
        < 0.2 * np.abs(col.importance("L0.E1.in") - layer).mean()
    )
    assert np.allclose(m["L0.E2.in"], col.importance("L0.E2.in"), rtol=0.1)
    pooled = (2 * 1 + 6 * 9) / 8
    assert np.allclose(m["L0.E1.down_in"], (2 * 1 + 32 * pooled) / 34)
    assert np.array_equal(m["L0.attn_in"], col.importance("L0.attn_in"))
    assert np.array_equal(
        col.importance_map(prior_tokens=0)["L0.E1.in"], col.importance("L0.E1.in")
    )
