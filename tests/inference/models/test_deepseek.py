"""DeepSeek-V3 and -V2 (multi-head latent attention) against transformers, through the store.

Each case is mounted from the per-expert checkpoint ``save_pretrained``
writes and from the stacked form transformers 5.x holds in memory: logits
within 1e-5 of transformers, greedy tokens equal to transformers' with all
experts resident and with a quarter of them cached, and the export
byte-identical (transformers reloads it to the same logits). Config variants
(no query LoRA, plain rope layout, group-limited routing, YaRN with
``mscale_all_dim``) run on an in-memory consumer. A published checkpoint's
multi-token-prediction layer mounts, is never run and exports back; a
session saves the compressed latent and resumes bit-identically.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from czyx.inference.engine import Engine
from czyx.inference.generate import generate_ids
from czyx.inference.opened import OpenedModel
from czyx.inference.sampling import SamplingParams
from czyx.inference.sessions.format import ParsedExtent, encode
from czyx.inference.sessions.live import LiveSession
from czyx.store import Store
from czyx.store.models.export import export
from czyx.store.models.model import ModelSpace
from czyx.store.models.mount import mount
from czyx.store.models.mount_errors import UnexpectedTensorError
from czyx.testing.archparity import reference, run_parity, write_checkpoint
from czyx.testing.refmodels import StateDictConsumer
from czyx.testing.tiny_models import build_tiny_model, per_expert_tensors

BASE = dict(initializer_range=0.2, num_hidden_layers=3)
PROMPT = np.random.default_rng(3).integers(0, 96, 12)


@pytest.mark.parametrize("fused", [False, True], ids=["per_expert", "fused"])
@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2"])
def test_mounted_deepseek_matches_transformers(tmp_path, arch, fused):
    r = run_parity(arch, tmp_path, fused=fused, **BASE)
    assert r.refused is None, r.refused
    assert r.max_diff < 1e-5 and r.logit_range > 1.0
    assert r.greedy_full and r.greedy_quarter and r.quarter_misses > 0
    assert r.export_identical and r.export_max_diff < 1e-5


VARIANTS = [
    ("deepseek_v3", dict(rope_interleave=False, n_group=4, topk_group=2, norm_topk_prob=False)),
    ("deepseek_v3", dict(q_lora_rank=None, routed_scaling_factor=1.0, n_shared_experts=2)),
    (
        "deepseek_v3",
        dict(
            max_position_embeddings=64,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "mscale": 1.0,
                "mscale_all_dim": 0.8,
            },
        ),
    ),
    ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2)),
    ("deepseek_v2", dict(q_lora_rank=None, routed_scaling_factor=1.5)),
]


@pytest.mark.parametrize("arch, overrides", VARIANTS)
def test_deepseek_config_variants_match_transformers(arch, overrides):
    model = build_tiny_model(arch, 1, **{**BASE, **overrides})
    want, want_tokens = reference(model, PROMPT, 24)
    got = Engine(StateDictConsumer(model)).prefill(PROMPT, all_logits=True)
    assert np.abs(got - want).max() < 1e-5
    tokens, _ = generate_ids(Engine(StateDictConsumer(model)), PROMPT.tolist(), 24)
    assert tokens == want_tokens


def _mtp_tensors(model, layer: int) -> dict[str, torch.Tensor]:
    """An MTP layer as DeepSeek-V3 publishes it: a decoder layer plus enorm/hnorm/eh_proj/head."""
    g = torch.Generator().manual_seed(5)
    sd = model.state_dict()
    out = {}
    last = model.config.num_hidden_layers - 1
    for name, t in sd.items():  # a copy of the last (sparse) layer, per-expert experts
        if not name.startswith(f"model.layers.{last}."):
            continue
        rest = name.removeprefix(f"model.layers.{last}.")
        if rest.startswith("mlp.experts."):  # gate_up_proj / down_proj stacked in memory
            part = rest.split(".")[-1]
            out.update(per_expert_tensors(f"model.layers.{layer}.mlp.experts.", part, t))
            continue
        out[f"model.layers.{layer}.{rest}"] = torch.randn(t.shape, generator=g)
    h, v = model.config.hidden_size, model.config.vocab_size
    for name, shape in (
        ("enorm.weight", (h,)),
        ("hnorm.weight", (h,)),
        ("eh_proj.weight", (h, 2 * h)),
        ("embed_tokens.weight", (v, h)),
        ("shared_head.norm.weight", (h,)),
        ("shared_head.head.weight", (v, h)),
    ):
        out[f"model.layers.{layer}.{name}"] = torch.randn(shape, generator=g)
    return {k: v.contiguous() for k, v in out.items()}


def test_mtp_layer_mounts_is_not_run_and_exports_back(tmp_path):
    model = build_tiny_model("deepseek_v3", 2, **BASE)
    assert model.config.num_nextn_predict_layers == 1
    src = write_checkpoint(model, tmp_path / "ckpt", fused=False)
    file = src / "model.safetensors"
    tensors = load_file(str(file))
    mtp = _mtp_tensors(model, model.config.num_hidden_layers)
    save_file({**tensors, **mtp}, str(file), metadata={"format": "pt"})
    store = Store.open(tmp_path / "store")
    try:
        mount(store, src, "ds@1")
        kept = {k: r for k, r in ModelSpace(store, "ds@1").trunk.items() if k[0] == "mtp"}
        assert len(kept) == len(mtp)
        export(store, "ds@1", tmp_path / "out")
    finally:
        store.close()
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == file.read_bytes()
    want, _ = reference(model, PROMPT, 0)
    opened = OpenedModel(str(tmp_path / "store"), "ds@1", None)
    try:
        assert not opened.consumer.has_trunk("q_a_proj", model.config.num_hidden_layers)
        got = Engine(opened.consumer).prefill(PROMPT, all_logits=True)
    finally:
        opened.close()
    assert np.abs(got - want).max() < 1e-5


def test_a_layer_beyond_the_mtp_layers_is_refused(tmp_path):
    model = build_tiny_model("deepseek_v3", 2, **BASE)
    src = write_checkpoint(model, tmp_path / "ckpt", fused=False)
    file = src / "model.safetensors"
    extra = {"model.layers.4.input_layernorm.weight": torch.ones(model.config.hidden_size)}
    save_file({**load_file(str(file)), **extra}, str(file), metadata={"format": "pt"})
    store = Store.open(tmp_path / "store")
    try:
        with pytest.raises(UnexpectedTensorError, match="layer 4 >= num_hidden_layers 3"):
            mount(store, src, "ds@1")
    finally:
        store.close()


def test_session_saves_the_latent_and_resumes_bit_identically():
    model = build_tiny_model("deepseek_v3", 3, **BASE)
    cfg = model.config
    live = LiveSession.start(Engine(StateDictConsumer(model)), SamplingParams(), "alice")
    live.feed(PROMPT.tolist())
    live.generate(4)
    state = live.state()
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert state.k[0].shape == (1, len(PROMPT) + 4, (width + 1) // 2)  # the latent, not K/V
    parsed = ParsedExtent(encode(state).payload)
    ref = [live.step() for _ in range(10)]
    ref_logits = live.logits.copy()
    resumed = LiveSession.resume(Engine(StateDictConsumer(model)), parsed, "alice")
    assert [resumed.step() for _ in range(10)] == ref
    assert np.array_equal(resumed.logits, ref_logits)


def test_unknown_topk_method_is_refused():
    from czyx.inference.errors import UnsupportedModelError

    model = build_tiny_model("deepseek_v2", 0, **BASE)
    consumer = StateDictConsumer(model)
    consumer.info.config["topk_method"] = "noaux_tc"
    with pytest.raises(UnsupportedModelError, match="noaux_tc"):
        Engine(consumer)
