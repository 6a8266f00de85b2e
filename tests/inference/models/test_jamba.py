"""Jamba (Mamba layers beside attention, MoE every other layer) against transformers.

Through the store, in both expert layouts: logits within 1e-5, greedy equal at
full and quarter cache, byte-identical export. The C convolution and selective
scan against their numpy references; the Mamba state constant in the length.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from czyx.inference.engine import Engine
from czyx.inference.errors import UnsupportedModelError
from czyx.inference.models.jamba import JambaDecoder, block_types
from czyx.inference.models.mamba import (
    conv_silu,
    conv_silu_reference,
    have_mamba_kernels,
    neg_a_of,
    scan,
    scan_reference,
)
from czyx.store import Store
from czyx.store.models.mount import mount
from czyx.store.models.mount_errors import UnexpectedTensorError
from czyx.testing.archparity import run_parity
from czyx.testing.refmodels import StateDictConsumer
from czyx.testing.tiny_models import build_tiny_model, make_tiny_checkpoint


@pytest.mark.parametrize(
    ("fused", "overrides"),
    [(False, {}), (True, {"attn_layer_offset": 1, "mamba_conv_bias": False})],
    ids=["per_expert", "fused_moe_attention_no_conv_bias"],
)
def test_mounted_jamba_matches_transformers(tmp_path, fused, overrides):
    r = run_parity("jamba", tmp_path, fused=fused, initializer_range=0.2, **overrides)
    assert r.refused is None, r.refused
    assert r.source_layout == ("fused" if fused else "per_expert")
    assert r.logit_range > 1.0 and r.max_diff <= 1e-5, r
    assert r.greedy_full and r.greedy_quarter and r.quarter_misses > 0
    assert r.export_identical and r.export_max_diff <= 1e-5


@pytest.mark.skipif(not have_mamba_kernels(), reason="the C kernels are not compiled")
def test_c_conv_and_scan_match_their_numpy_references() -> None:
    rng = np.random.default_rng(2)
    t, inner, n, k = 7, 24, 5, 4
    x = rng.standard_normal((t, inner)).astype(np.float32)
    w = rng.standard_normal((inner, k)).astype(np.float32)
    bias = rng.standard_normal(inner).astype(np.float32)
    cs = [np.zeros((k - 1, inner), np.float32) for _ in range(2)]
    want, got = conv_silu_reference(x, w, bias, cs[0]), conv_silu(x, w, bias, cs[1])
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()
    assert np.array_equal(cs[0], cs[1])  # the state is the inputs themselves
    dt = rng.standard_normal((t, inner)).astype(np.float32)
    dt[0, 0] = 30.0  # softplus above its threshold
    dt_bias = rng.standard_normal(inner).astype(np.float32)
    a_log = np.log(rng.uniform(0.5, 8, (inner, n))).astype(np.float32)
    neg_a = neg_a_of(a_log)
    b, c = (rng.standard_normal((t, n)).astype(np.float32) for _ in range(2))
    d_skip = rng.standard_normal(inner).astype(np.float32)
    z = rng.standard_normal((t, inner)).astype(np.float32)
    st = [np.zeros((inner, n), np.float32) for _ in range(3)]
    want = scan_reference(want, dt, dt_bias, neg_a, b, c, d_skip, z, st[0])
    got = scan(got, dt, dt_bias, neg_a, b, c, d_skip, z, st[1])
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert np.abs(st[1] - st[0]).max() <= 1e-5 * np.abs(st[0]).max()
    one = np.concatenate(
        [scan(x[i : i + 1], dt[i : i + 1], dt_bias, neg_a, b[i : i + 1], c[i : i + 1], d_skip,
              z[i : i + 1], st[2]) for i in range(t)]
    )  # fmt: skip
    assert np.array_equal(one, scan(x, dt, dt_bias, neg_a, b, c, d_skip, z,
                                    np.zeros((inner, n), np.float32)))  # fmt: skip


def test_block_types_and_refusals(tmp_path) -> None:
    assert block_types({"attn_layer_period": 4, "attn_layer_offset": 2}, 5) == (
        "mamba", "mamba", "attention", "mamba", "mamba",
    )  # fmt: skip
    assert block_types({}, 9)[4] == "attention"  # transformers' defaults: 8 and 4
    # Projection biases in the Mamba layers: refused at mount (no role) and by the engine.
    ckpt = make_tiny_checkpoint("jamba", tmp_path / "ckpt", mamba_proj_bias=True)
    with Store.open(tmp_path / "st") as st, pytest.raises(UnexpectedTensorError, match="in_proj"):
        mount(st, ckpt, "j@1")
    info = StateDictConsumer(build_tiny_model("jamba", 0)).info
    info = dataclasses.replace(info, config={**info.config, "mamba_proj_bias": True})
    with pytest.raises(UnsupportedModelError, match="mamba_proj_bias"):
        JambaDecoder.parse_config(info)


def test_mamba_state_is_constant_in_the_length() -> None:
    eng = Engine(StateDictConsumer(build_tiny_model("jamba", 1, initializer_range=0.2)))
    model = eng.model
    assert isinstance(model, JambaDecoder) and model.n_full == 1 and model.n_linear == 3
    kv = model.new_kv(2)
    shapes = [a.shape for a in kv.recurrent_arrays()]
    model.forward(np.arange(5), kv)
    snap = kv.checkpoint()
    first = [model.forward(np.array([t]), kv) for t in range(20)]
    assert [a.shape for a in kv.recurrent_arrays()] == shapes and len(kv.k) == 1
    assert kv.recurrent_nbytes() == model.recurrent_nbytes
    kv.restore(snap)
    again = [model.forward(np.array([t]), kv) for t in range(20)]
    assert all(np.array_equal(x, y) for x, y in zip(first, again, strict=True))
    eng.close()
