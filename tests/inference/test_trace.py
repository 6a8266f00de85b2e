"""Routing trace codec: round trip, validation, and the transformers builder."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from czyx.inference.locality.errors import TraceError
from czyx.inference.trace import RoutingTrace, trace_from_router_logits, trace_hf_model


@st.composite
def traces(draw: st.DrawFn) -> RoutingTrace:
    t = draw(st.integers(0, 12))
    n_layers = draw(st.integers(1, 4))
    e = draw(st.integers(1, 256))
    k = draw(st.integers(1, min(e, 4)))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    experts = np.stack([rng.permutation(e)[:k] for _ in range(t * n_layers)] or [np.zeros(k, int)])[
        : t * n_layers
    ].reshape(t, n_layers, k)
    weights = rng.random((t, n_layers, k)).astype(np.float32)
    segments = np.sort(rng.integers(0, 3, t)).astype(np.int32)
    return RoutingTrace(
        experts=experts.astype(np.uint8),
        weights=weights,
        segments=segments,
        model_id=draw(st.text(max_size=20)),
        text_sha256=draw(st.text("0123456789abcdef", min_size=0, max_size=64)),
        n_experts=e,
        moe_layers=tuple(draw(st.lists(st.integers(0, 99), min_size=n_layers, max_size=n_layers))),
        weights_kind=draw(st.sampled_from(["topk_renormalized", "softmax"])),
    )


@settings(max_examples=40, deadline=None)
@given(traces())
def test_save_load_round_trip(tmp_path_factory: pytest.TempPathFactory, tr: RoutingTrace) -> None:
    path = tmp_path_factory.mktemp("t") / "trace.npz"
    tr.save(path)
    back = RoutingTrace.load(path)
    assert np.array_equal(back.experts, tr.experts)
    assert np.array_equal(back.weights, tr.weights)
    assert np.array_equal(back.segments, tr.segments)
    assert back.meta() == tr.meta()


def _good(**kw: object) -> dict:
    base = dict(
        experts=np.array([[[0, 1]], [[2, 3]]], np.uint8),
        weights=np.full((2, 1, 2), 0.5, np.float32),
        segments=np.array([0, 0], np.int32),
        model_id="m",
        text_sha256="",
        n_experts=4,
    )
    base.update(kw)
    return base


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"experts": np.array([[[0, 1]], [[2, 4]]], np.uint8)}, "experts[1, 0, 1]"),
        ({"experts": np.array([[[0, 0]], [[2, 3]]], np.uint8)}, "repeats"),
        ({"experts": np.zeros((2, 1, 2), np.int64)}, "'experts'"),
        ({"weights": np.zeros((2, 1, 2), np.float64)}, "'weights'"),
        ({"weights": np.array([[[0.5, np.nan]], [[1, 0]]], np.float32)}, "not finite"),
        ({"segments": np.array([1, 0], np.int32)}, "decrease at token 1"),
        ({"n_experts": 70000}, "n_experts"),
        ({"n_experts": 300}, "must be uint16"),  # above 256 experts the indices are wider
        ({"moe_layers": (0, 1)}, "moe_layers"),
    ],
)
def test_validate_names_the_field(change: dict, needle: str) -> None:
    with pytest.raises(TraceError) as info:
        RoutingTrace(**_good(**change))
    assert needle in str(info.value)


def test_load_rejects_foreign_and_broken_files(tmp_path) -> None:
    tr = RoutingTrace(**_good())
    p = tmp_path / "t.npz"
    tr.save(p)
    with np.load(p) as z:
        members = {k: z[k] for k in z.files}
    meta = json.loads(str(members["meta"]))
    meta["version"] = 99
    members["meta"] = np.array(json.dumps(meta))
    bad = tmp_path / "bad.npz"
    np.savez(bad, **members)
    with pytest.raises(TraceError, match="version 99"):
        RoutingTrace.load(bad)
    del members["weights"]
    np.savez(bad, **members)
    with pytest.raises(TraceError, match="missing member 'weights'"):
        RoutingTrace.load(bad)
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip")
    with pytest.raises(TraceError, match=r"junk\.npz"):
        RoutingTrace.load(junk)


def test_split_is_on_a_segment_boundary() -> None:
    seg = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 3], np.int32)
    t = len(seg)
    tr = RoutingTrace(
        experts=np.zeros((t, 1, 1), np.uint8),
        weights=np.ones((t, 1, 1), np.float32),
        segments=seg,
        model_id="",
        text_sha256="",
        n_experts=1,
    )
    a, b = tr.split(0.5)
    assert a.n_tokens == 5 and b.n_tokens == 5
    assert set(a.segments) & set(b.segments) == set()
    with pytest.raises(TraceError, match="single segment"):
        tr.take(0, 3).split(0.5)


def test_from_router_logits_topk_and_weights() -> None:
    logits = np.array([[0.0, 2.0, 1.0, -1.0]], np.float32)
    tr = trace_from_router_logits([logits, logits[:, ::-1].copy()], top_k=2)
    assert tr.experts[0, 0].tolist() == [1, 2]
    assert tr.experts[0, 1].tolist() == [2, 1]
    p = np.exp([2.0, 1.0]) / np.exp([2.0, 1.0]).sum()
    np.testing.assert_allclose(tr.weights[0, 0], p, rtol=1e-6)
    raw = trace_from_router_logits([logits], top_k=2, normalize_topk=False)
    full = np.exp(logits[0]) / np.exp(logits[0]).sum()
    np.testing.assert_allclose(raw.weights[0, 0], full[[1, 2]], rtol=1e-6)


def test_hf_builder_matches_the_models_own_routing() -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    model = transformers.MixtralForCausalLM(cfg).eval()
    seen: list[tuple[np.ndarray, np.ndarray]] = []

    def hook(_m, _i, out):  # the router returns (logits, top-k weights, top-k indices)
        seen.append((out[2].numpy().copy(), out[1].float().numpy().copy()))

    handles = [layer.mlp.gate.register_forward_hook(hook) for layer in model.model.layers]
    windows = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12], [5, 5, 5]]
    tr = trace_hf_model(model, windows, model_id="tiny", batch_size=2)
    for h in handles:
        h.remove()
    assert tr.experts.shape == (15, 2, 2)
    assert tr.segments.tolist() == [0] * 6 + [1] * 6 + [2] * 3
    # hooks fired per forward pass: batch 1 (two windows) then batch 2 (one window)
    for layer in range(2):
        idx = np.concatenate([seen[layer][0], seen[2 + layer][0]])
        w = np.concatenate([seen[layer][1], seen[2 + layer][1]])
        assert np.array_equal(tr.experts[:, layer], idx)
        np.testing.assert_allclose(tr.weights[:, layer], w, rtol=1e-5, atol=1e-6)
