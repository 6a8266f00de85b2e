"""Architecture tables and mount plans over tiny checkpoints of every family and layout."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from czyx.store.models.archs import ALL_ROLES, ARCHS, arch_for_config, role_key_class
from czyx.store.models.checkpoint import Checkpoint
from czyx.store.models.mount_errors import (
    MissingTensorError,
    ShapeMismatchError,
    UnexpectedTensorError,
    UnknownArchitectureError,
)
from czyx.store.models.mount_plan import plan_checkpoint
from czyx.testing.tiny_models import ARCHES, build_tiny_model, make_tiny_checkpoint

CASES = [(a, f) for a in ARCHES for f in (False, True)]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("archs")
    return {(a, f): make_tiny_checkpoint(a, root / f"{a}-{f}", fused=f) for a, f in CASES}


@pytest.mark.parametrize(("arch", "fused"), CASES)
def test_plan_covers_every_tensor(ckpts, arch, fused):
    import torch

    with Checkpoint(ckpts[(arch, fused)]) as ck:
        plan = plan_checkpoint(ck)
        assert plan.arch == arch and plan.expert_layout == ("fused" if fused else "per_expert")
        assert len(plan.experts) == len(plan.sparse_layers) * plan.n_experts
        # Each tensor is either trunk or (part of) an expert, never both, never dropped.
        trunk = {t.tensor for t in plan.trunk}
        expert_tensors = {p.tensor for parts in plan.experts.values() for p in parts}
        assert trunk.isdisjoint(expert_tensors) and trunk | expert_tensors == set(ck.names())
        # Expert bytes are those of transformers' own fused in-memory parameters.
        model = build_tiny_model(arch)
        layer, e = plan.sparse_layers[-1], plan.n_experts - 1
        block = model.model.layers[layer]
        mlp = block.feed_forward if arch == "jamba" else block.mlp  # Jamba names it so
        gate_up = mlp.experts.gate_up_proj[e].detach()
        want = (gate_up[: plan.inter], gate_up[plan.inter :], mlp.experts.down_proj[e].detach())
        for src, w in zip(plan.experts[(layer, e)], want):
            raw = np.frombuffer(ck.raw(src.tensor)[src.start : src.start + src.nbytes], np.float32)
            assert torch.equal(torch.from_numpy(raw.reshape(src.shape).copy()), w)
        roles = {(t.role, t.layer) for t in plan.trunk}
        assert ("router", layer) in roles and ("embed", None) in roles


def test_family_specific_roles(ckpts):
    def roles(arch):
        with Checkpoint(ckpts[(arch, False)]) as ck:
            return {t.role for t in plan_checkpoint(ck).trunk}

    assert {"shared_gate_proj", "shared_expert_gate", "q_bias"} <= roles("qwen2_moe")
    assert {"q_norm", "k_norm"} <= roles("qwen3_moe") and "q_bias" not in roles("qwen3_moe")
    assert {"q_norm", "k_norm"} <= roles("olmoe")
    assert {"q_a_proj", "kv_b_proj", "router_bias", "mlp_up_proj"} <= roles("deepseek_v3")
    assert roles("mixtral").isdisjoint({"q_norm", "shared_gate_proj"})


def test_qk_norm_width_differs(ckpts):
    with Checkpoint(ckpts[("olmoe", False)]) as ck:
        assert ck.info("model.layers.0.self_attn.q_norm.weight").shape == (32,)
    with Checkpoint(ckpts[("qwen3_moe", False)]) as ck:
        assert ck.info("model.layers.0.self_attn.q_norm.weight").shape == (8,)


def test_mixtral_names():
    spec = ARCHS["mixtral"]
    k = spec.classify("model.layers.3.block_sparse_moe.experts.5.w3.weight")
    assert (k.kind, k.layer, k.expert, k.part) == ("expert", 3, 5, "up")
    assert spec.classify("model.layers.1.block_sparse_moe.gate.weight").role == "router"
    assert spec.classify("model.layers.1.mlp.experts.gate_up_proj").part == "gate_up"
    assert spec.classify("model.layers.1.self_attn.q_norm.weight") is None
    assert spec.classify("model.layers.x.input_layernorm.weight") is None


def test_unknown_architecture():
    with pytest.raises(UnknownArchitectureError, match="llama"):
        arch_for_config({"model_type": "llama"})
    with pytest.raises(UnknownArchitectureError, match="None"):
        arch_for_config({})


def test_role_classes_are_distinct_bytes():
    classes = [role_key_class(r) for r in ALL_ROLES]
    assert len(set(classes)) == len(classes) and max(classes) < 256
    with pytest.raises(ValueError):
        role_key_class("nonsense")


def _mutate(path, drop=(), add=None, config=None):
    """Rewrite a checkpoint's single file without ``drop`` tensors, plus ``add``."""
    from safetensors.torch import load_file, save_file

    st = load_file(str(path / "model.safetensors"))
    for name in drop:
        del st[name]
    st.update(add or {})
    save_file(st, str(path / "model.safetensors"))
    if config:
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, **config}))


@pytest.mark.parametrize(
    ("arch", "drop", "add", "config", "error", "match"),
    [
        (
            "qwen3_moe",
            ["model.layers.1.mlp.experts.3.up_proj.weight"],
            None,
            None,
            MissingTensorError,
            "no up matrix",
        ),
        (
            "qwen3_moe",
            [f"model.layers.1.mlp.experts.3.{p}_proj.weight" for p in ("gate", "up", "down")],
            None,
            None,
            MissingTensorError,
            r"lacks routed experts \[3\]",
        ),
        (
            "qwen3_moe",
            [],
            {"model.layers.1.mlp.experts.8.up_proj.weight": (16, 32)},
            None,
            UnexpectedTensorError,
            "expert 8 >= configured 8",
        ),
        (
            "qwen3_moe",
            [],
            {"model.layers.0.mlp.foo.weight": (2,)},
            None,
            UnexpectedTensorError,
            "not a tensor of a qwen3_moe",
        ),
        (
            "qwen3_moe",
            [],
            {"model.layers.2.input_layernorm.weight": (32,)},
            None,
            UnexpectedTensorError,
            "layer 2",
        ),
        ("qwen3_moe", [], None, {"moe_intermediate_size": 17}, ShapeMismatchError, "config"),
        (
            "mixtral",
            [],
            {"model.layers.0.mlp.gate.weight": (4, 32)},
            None,
            UnexpectedTensorError,
            "already",
        ),
        ("qwen3_moe", ["model.norm.weight"], None, None, MissingTensorError, "final_norm"),
    ],
    ids=[
        "missing-part",
        "missing-expert",
        "extra-expert",
        "unknown-tensor",
        "layer-range",
        "shape",
        "duplicate-router",
        "missing-trunk",
    ],
)
def test_bad_checkpoints(tmp_path, arch, drop, add, config, error, match):
    import torch

    path = make_tiny_checkpoint(arch, tmp_path / "ck")
    _mutate(path, drop, {k: torch.zeros(s) for k, s in (add or {}).items()}, config)
    with Checkpoint(path) as ck, pytest.raises(error, match=match) as info:
        plan_checkpoint(ck)
    assert str(path) in str(info.value)


def test_mixed_layouts_in_one_layer_refused(tmp_path, ckpts):
    import torch

    path = make_tiny_checkpoint("olmoe", tmp_path / "ck")
    _mutate(
        path,
        add={
            "model.layers.0.mlp.experts.gate_up_proj": torch.zeros(8, 32, 32),
            "model.layers.0.mlp.experts.down_proj": torch.zeros(8, 32, 16),
        },
    )
    with Checkpoint(path) as ck, pytest.raises(UnexpectedTensorError, match="both"):
        plan_checkpoint(ck)


def test_partial_plan_for_adapters(tmp_path):
    path = make_tiny_checkpoint("qwen3_moe", tmp_path / "ck")
    keep = {f"model.layers.1.mlp.experts.2.{p}_proj.weight" for p in ("gate", "up", "down")}
    with Checkpoint(path) as ck:
        drop = [n for n in ck.names() if n not in keep]
    _mutate(path, drop)
    with Checkpoint(path) as ck:
        with pytest.raises(MissingTensorError):
            plan_checkpoint(ck)
        plan = plan_checkpoint(ck, partial=True)
    assert list(plan.experts) == [(1, 2)] and plan.trunk == ()


_PARTS = {
    "mixtral": (
        "block_sparse_moe.experts.{e}.{t}.weight",
        {"gate": "w1", "up": "w3", "down": "w2"},
    ),
    "qwen3_moe": ("mlp.experts.{e}.{t}_proj.weight", {"gate": "gate", "up": "up", "down": "down"}),
    "jamba": (
        "feed_forward.experts.{e}.{t}_proj.weight",
        {"gate": "gate", "up": "up", "down": "down"},
    ),
}


@given(
    # GPT-OSS, the GraniteMoEs and Llama 4 have no per-expert tensor names (only stacked).
    arch=st.sampled_from(
        sorted(
            a
            for a in ARCHS
            if a not in ("gpt_oss", "granitemoe", "granitemoeshared", "llama4_text")
        )
    ),
    layer=st.integers(0, 10**6),
    expert=st.integers(0, 10**4),
    part=st.sampled_from(["gate", "up", "down"]),
)
def test_expert_names_classify_for_all_indices(arch, layer, expert, part):
    mixtral_names = arch in ("mixtral", "phimoe", "minimax_m2")
    parts = "mixtral" if mixtral_names else arch if arch in _PARTS else "qwen3_moe"
    template, tokens = _PARTS[parts]
    name = f"model.layers.{layer}." + template.format(e=expert, t=tokens[part])
    kind = ARCHS[arch].classify(name)
    assert (kind.kind, kind.layer, kind.expert, kind.part) == ("expert", layer, expert, part)
    stacked = "down" if part == "down" else "gate_up"
    block = "feed_forward" if arch == "jamba" else "mlp"
    fused = ARCHS[arch].classify(f"model.layers.{layer}.{block}.experts.{stacked}_proj")
    assert (fused.kind, fused.layer, fused.part) == ("fused", layer, stacked)


@given(st.text(max_size=80))
def test_arbitrary_names_never_crash(name):
    for spec in ARCHS.values():
        kind = spec.classify(name)
        assert kind is None or kind.kind in ("trunk", "expert", "fused")
