"""Qwen3-Next (hybrid gated DeltaNet + gated attention) against transformers, through the store.

Logits within 1e-5 of the logit range (transformers' own two float32 paths, its
chunked prompt and its token-by-token decode, differ by about as much as we do
from either), greedy equal at full and quarter cache, byte-identical export, in
both expert layouts. The C kernel of the DeltaNet recurrence against its numpy
reference; the hybrid cache's constant-size state and its checkpoint rollback.
"""

from __future__ import annotations

import numpy as np
import pytest

from czyx.inference.engine import Engine
from czyx.inference.errors import RecurrentStateError, UnsupportedModelError
from czyx.inference.models.deltanet import (
    DeltaNetDims,
    HybridCache,
    gdn,
    gdn_reference,
    have_gdn_kernel,
)
from czyx.inference.models.qwen3_next import layer_types
from czyx.inference.opened import OpenedModel
from czyx.store import Store
from czyx.store.models.mount import mount
from czyx.store.models.mount_errors import ConfigError
from czyx.store.models.mount_plan import validate_config
from czyx.testing.archparity import run_parity
from czyx.testing.tiny_models import make_tiny_checkpoint


@pytest.mark.parametrize(
    ("fused", "overrides"),
    [(False, {}), (True, {"mlp_only_layers": [1]})],
    ids=["per_expert", "fused_dense_layer"],
)
def test_mounted_qwen3_next_matches_transformers(tmp_path, fused, overrides):
    r = run_parity("qwen3_next", tmp_path, fused=fused, initializer_range=0.2, **overrides)
    assert r.refused is None, r.refused
    assert r.source_layout == ("fused" if fused else "per_expert")
    assert r.logit_range > 1.0 and r.max_diff <= 1e-5 * r.logit_range, r
    assert r.greedy_full and r.greedy_quarter and r.quarter_misses > 0
    assert r.export_identical and r.export_max_diff <= 1e-5 * r.logit_range


def _inputs(rng: np.random.Generator, d: DeltaNetDims, t: int):
    mixed = rng.standard_normal((t, d.conv_dim)).astype(np.float32)
    b = rng.standard_normal((t, d.n_v_heads)).astype(np.float32)
    a = (rng.standard_normal((t, d.n_v_heads)) * 3).astype(np.float32)
    a[0, 0] = 25.0  # softplus above its threshold: the identity
    conv_w = rng.standard_normal((d.conv_dim, d.conv_kernel)).astype(np.float32)
    a_log = rng.uniform(-1, 2, d.n_v_heads).astype(np.float32)
    dt_bias = rng.standard_normal(d.n_v_heads).astype(np.float32)
    return mixed, b, a, conv_w, a_log, dt_bias


@pytest.mark.skipif(not have_gdn_kernel(), reason="the C kernels are not compiled")
def test_c_recurrence_matches_the_numpy_reference() -> None:
    d = DeltaNetDims(n_k_heads=2, n_v_heads=4, k_head_dim=8, v_head_dim=6, conv_kernel=4)
    rng = np.random.default_rng(5)
    mixed, b, a, conv_w, a_log, dt_bias = _inputs(rng, d, 9)
    states = [
        (np.zeros((d.conv_kernel - 1, d.conv_dim), np.float32), np.zeros((4, 8, 6), np.float32))
        for _ in range(3)
    ]
    want = gdn_reference(mixed, b, a, conv_w, a_log, dt_bias, *states[0], d)
    got = gdn(mixed, b, a, conv_w, a_log, dt_bias, *states[1], d)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    for x, y in zip(states[0], states[1], strict=True):
        assert np.abs(x - y).max() <= 1e-5 * np.abs(x).max()
    # A prompt in one call is the same arithmetic as its tokens one call each.
    steps = np.concatenate(
        [gdn(mixed[t : t + 1], b[t : t + 1], a[t : t + 1], conv_w, a_log, dt_bias, *states[2], d)
         for t in range(9)]
    )  # fmt: skip
    assert np.array_equal(steps, got)
    assert all(np.array_equal(x, y) for x, y in zip(states[1], states[2], strict=True))


def test_the_kernel_refuses_a_state_it_would_misread() -> None:
    if not have_gdn_kernel():
        pytest.skip("the C kernels are not compiled")
    d = DeltaNetDims(2, 2, 4, 4, 3)
    mixed, b, a, conv_w, a_log, dt_bias = _inputs(np.random.default_rng(1), d, 1)
    conv = np.zeros((2, d.conv_dim), np.float32)
    with pytest.raises(RecurrentStateError, match="not f32"):
        gdn(mixed, b, a, conv_w, a_log, dt_bias, conv, np.zeros((2, 4, 4), np.float64), d)


def test_layer_types_follow_the_config() -> None:
    assert layer_types({"full_attention_interval": 2}, 4) == (
        "linear_attention", "full_attention", "linear_attention", "full_attention",
    )  # fmt: skip
    assert layer_types({}, 4)[3] == "full_attention" and layer_types({}, 4)[0] != "full_attention"
    with pytest.raises(UnsupportedModelError, match="sliding"):
        layer_types({"layer_types": ["sliding_attention"]}, 1)
    with pytest.raises(ConfigError, match="layer_types"):
        validate_config({"num_hidden_layers": 2, "layer_types": ["full_attention"]})
    with pytest.raises(ConfigError, match="linear_num_value_heads"):
        validate_config({"linear_num_key_heads": 3, "linear_num_value_heads": 4})


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("q3n")
    ckpt = make_tiny_checkpoint("qwen3_next", tmp / "ckpt", initializer_range=0.2)
    with Store.open(tmp / "store") as st:
        mount(st, ckpt, "m@1")
    with OpenedModel(str(tmp / "store"), "m@1", None) as om:
        eng = Engine(om.consumer)
        yield eng
        eng.close()


def test_decode_state_is_constant_in_the_length(engine) -> None:
    """The linear layers keep a fixed-size state (O(1) per decoded token); KV is kept for
    the attention layer only."""
    model = engine.model
    kv = model.new_kv(4)
    assert isinstance(kv, HybridCache)
    assert len(kv.k) == model.n_full == 1 and kv.n_linear_layers == model.n_linear == 3
    before = [a.shape for a in kv.recurrent_arrays()]
    model.forward(np.arange(7), kv)
    for t in range(30):
        model.forward(np.array([t % 96]), kv)
    assert [a.shape for a in kv.recurrent_arrays()] == before
    assert kv.recurrent_nbytes() == model.recurrent_nbytes
    assert kv.length == 37 and kv.capacity >= 37


def test_checkpoint_rollback_replays_bit_identically(engine) -> None:
    """Speculation's rollback: a checkpoint, some tokens, a truncate back to it, and the
    same tokens again give the very same logits and state."""
    model = engine.model
    kv = model.new_kv()
    model.forward(np.array([5, 9, 14, 2]), kv)
    snap = kv.checkpoint()
    first = [model.forward(np.array([t]), kv) for t in (7, 30, 1)]
    state = [a.copy() for a in kv.recurrent_arrays()]
    with pytest.raises(RecurrentStateError, match="checkpoint"):
        kv.truncate(5)  # no snapshot there
    kv.rollback(3)
    assert kv.length == snap.length == 4
    again = [model.forward(np.array([t]), kv) for t in (7, 30, 1)]
    assert all(np.array_equal(x, y) for x, y in zip(first, again, strict=True))
    assert all(np.array_equal(x, y) for x, y in zip(state, kv.recurrent_arrays(), strict=True))
    kv.truncate(0)
    assert kv.length == 0 and not any(a.any() for a in kv.recurrent_arrays())
    assert np.array_equal(model.forward(np.array([5, 9, 14, 2]), kv), model.forward(
        np.array([5, 9, 14, 2]), model.new_kv()))  # fmt: skip


@pytest.mark.parametrize("arch", ["qwen3_next", "jamba"])
def test_tracking_rewinds_a_verify_pass_to_any_accepted_length(arch) -> None:
    """Speculation: a verify pass over drafted tokens with ``track()`` on leaves a snapshot
    at every position, so rejecting the tail is a ``truncate`` (no recomputation)."""
    from czyx.testing.refmodels import StateDictConsumer
    from czyx.testing.tiny_models import build_tiny_model

    eng = Engine(StateDictConsumer(build_tiny_model(arch, 2, initializer_range=0.2)))
    model = eng.model
    prompt, drafts = np.array([4, 8, 15, 16, 23]), np.array([42, 7, 19, 3])
    plain, tracked = model.new_kv(), model.new_kv()
    model.forward(prompt, plain)
    model.forward(prompt, tracked)
    tracked.track()
    # Tracking runs the linear layers token by token: the very same numbers.
    assert np.array_equal(
        model.forward(drafts, tracked, all_logits=True),
        model.forward(drafts, plain, all_logits=True),
    )
    assert all(np.array_equal(x, y) for x, y in zip(
        tracked.recurrent_arrays(), plain.recurrent_arrays(), strict=True))  # fmt: skip
    tracked.track(False)
    tracked.truncate(len(prompt) + 2)  # two drafts accepted
    ref = model.new_kv()
    model.forward(np.concatenate([prompt, drafts[:2]]), ref)
    for x, y in zip(tracked.recurrent_arrays(), ref.recurrent_arrays(), strict=True):
        assert np.abs(x - y).max() <= 1e-5 * max(float(np.abs(y).max()), 1e-6)
    got, want = model.forward(np.array([11]), tracked), model.forward(np.array([11]), ref)
    assert np.abs(got - want).max() <= 1e-5 * float(want.max() - want.min())
    assert int(got.argmax()) == int(want.argmax())
    eng.close()


@pytest.mark.parametrize(("arch", "role"), [("qwen3_next", "lin_qkvz"), ("jamba", "mamba_in_proj")])
def test_a_quantized_hybrid_mount_runs_on_packed_projections(tmp_path, arch, role) -> None:
    """``--quant q4-all``: the linear layers' projections are packed (the recurrence's
    parameters stay float) and the engine runs on them."""
    from czyx.store.quant.codec import QuantCodec
    from czyx.store.quant.policy import POLICIES

    ckpt = make_tiny_checkpoint(arch, tmp_path / "ck", hidden_size=64, intermediate_size=64,
                                moe_intermediate_size=64)  # fmt: skip
    with Store.open(tmp_path / "st") as st:
        mount(st, ckpt, "m@q4", quant=QuantCodec(POLICIES["q4-all"]))
    with OpenedModel(str(tmp_path / "st"), "m@q4", None) as om:
        assert om.consumer.trunk_quantized(role, 0) is not None
        eng = Engine(om.consumer)
        logits = eng.prefill(np.arange(9))
        nxt = eng.decode(int(logits.argmax()))
        assert np.isfinite(logits).all() and np.isfinite(nxt).all()
        eng.close()


@pytest.mark.skipif(not have_gdn_kernel(), reason="the C kernels are not compiled")
@pytest.mark.parametrize("threads", [2, 3])
def test_recurrences_spread_over_threads_are_bit_identical(split_loops, threads) -> None:
    """The value heads (DeltaNet) and channels (Mamba) split over the decode kernels'
    pool: each is one thread's, so the results are those of one thread, bit for bit."""
    from czyx.inference.kernels.fused import Pool
    from czyx.inference.models.mamba import scan

    pool = Pool(threads)
    try:
        d = DeltaNetDims(2, 6, 8, 8, 4)
        rng = np.random.default_rng(9)
        mixed, b, a, conv_w, a_log, dt_bias = _inputs(rng, d, 5)
        outs, states = [], []
        for p in (None, pool.ptr):
            conv = np.zeros((3, d.conv_dim), np.float32)
            st = np.zeros((6, 8, 8), np.float32)
            outs.append(gdn(mixed, b, a, conv_w, a_log, dt_bias, conv, st, d, p))
            states.append(st)
        assert np.array_equal(outs[0], outs[1]) and np.array_equal(states[0], states[1])
        t, inner, n = 4, 40, 6
        x, dt, z = (rng.standard_normal((t, inner)).astype(np.float32) for _ in range(3))
        bb, cc = (rng.standard_normal((t, n)).astype(np.float32) for _ in range(2))
        a_log2 = -np.exp(rng.standard_normal((inner, n))).astype(np.float32)
        vecs = [rng.standard_normal(inner).astype(np.float32) for _ in range(2)]
        got = [
            scan(x, dt, vecs[0], a_log2, bb, cc, vecs[1], z, np.zeros((inner, n), np.float32), p)
            for p in (None, pool.ptr)
        ]
        assert np.array_equal(got[0], got[1])
    finally:
        pool.close()


def test_mtp_tensors_are_kept_not_run_and_export_back(tmp_path) -> None:
    """Released Qwen3-Next checkpoints carry a multi-token-prediction module under ``mtp.*``
    (transformers ignores it): mount keeps it verbatim, the engine never reads it, export
    writes the file back byte for byte."""
    from safetensors.numpy import load_file, save_file

    from czyx.store.models.export import export
    from czyx.store.models.model import ModelSpace

    ckpt = make_tiny_checkpoint("qwen3_next", tmp_path / "ckpt")
    file = ckpt / "model.safetensors"
    rng = np.random.default_rng(0)
    mtp = {
        "mtp.fc.weight": rng.standard_normal((32, 64)).astype(np.float32),
        "mtp.norm.weight": rng.standard_normal(32).astype(np.float32),
        "mtp.layers.0.input_layernorm.weight": rng.standard_normal(32).astype(np.float32),
    }
    save_file({**load_file(str(file)), **mtp}, str(file), metadata={"format": "pt"})
    with Store.open(tmp_path / "st") as st:
        mount(st, ckpt, "m@1")
        kept = [k for k in ModelSpace(st, "m@1").trunk if k[0] == "mtp"]
        assert len(kept) == len(mtp)
        export(st, "m@1", tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == file.read_bytes()
    with OpenedModel(str(tmp_path / "st"), "m@1", None) as om:
        eng = Engine(om.consumer)
        assert np.isfinite(eng.prefill(np.arange(6))).all()
        eng.close()
