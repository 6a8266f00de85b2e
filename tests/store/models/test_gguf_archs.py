"""GGUF for the architectures llama.cpp converts beyond the first four: PhiMoE, Llama 4,
Qwen3-Next and Jamba.

A PhiMoE model written the way llama.cpp's converter lays it out
(``PhiMoeModel``: the ``phimoe`` arch, experts stacked as
``ffn_{gate,up,down}_exps``, LayerNorm, attention and head biases kept,
NEOX rope unpermuted) mounts and runs with transformers' logits and greedy
tokens (the file is read as the HF checkpoint it was converted from, so
czyx runs its sparsemixer routing); ``export --format gguf`` writes it back
tensor for tensor; a safetensors PhiMoE exports to a GGUF that mounts again
with the same logits. What GGUF cannot hold (PhiMoE's longrope mscales, a
non-default ``router_jitter_noise``) is refused. Llama 4 text the same way
(``Llama4Model``: ``llama4``, experts from HF's transposed stacks, q/k unpermuted),
with what llama.cpp fixes in code (chunks of 8192, NoPE every fourth layer, its
temperature) refused on export when the config differs; its llama3 rope scaling as the
converter writes it (``rope_freqs.weight``, each frequency's divisor) mounts, runs and
exports back, and a safetensors Llama 4 with it exports the converter's factors.
Qwen3-Next and Jamba as ``Qwen3NextModel`` / ``JambaModel`` convert them (in_proj_qkvz
split, ``ssm_a = -exp(A_log)``, squeezed conv1d, Qwen3-Next's norms as ``1 + w``): mounted
with transformers' logits and greedy tokens, exported back byte for byte, and a safetensors
model exported to the converter's own bytes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from czyx import portals
from czyx.inference.engine import Engine
from czyx.inference.generate import generate_ids
from czyx.inference.kernels.linear import float_inputs
from czyx.inference.opened import OpenedModel
from czyx.store import Store
from czyx.store.models.gguf import ARCHS as GGUF_ARCHS
from czyx.store.models.gguf import UnsupportedGGUFError, config_from_gguf, gguf_metadata
from czyx.store.models.gguf_export import export_gguf
from czyx.store.models.mount import mount
from czyx.testing.archparity import reference
from czyx.testing.gguf_writer import reference_model, same_tensors, write_gguf
from czyx.testing.tiny_models import build_tiny_model

PROMPT = np.random.default_rng(5).integers(0, 96, 12)
# GGUF quant blocks are 32 wide along rows: every row length a multiple of 32.
DIMS = dict(hidden_size=64, intermediate_size=64, initializer_range=0.2, router_jitter_noise=0.01)


def phimoe(**kw):
    return build_tiny_model("phimoe", 3, **{**DIMS, **kw})


def _run(store_dir, tag, steps=12, prompt=PROMPT):
    """czyx's logits over ``prompt`` and its ``steps`` greedy tokens after it."""
    with Store.open(store_dir) as store:
        token = portals.root_token(store)
    with OpenedModel(str(store_dir), tag, token) as opened, float_inputs():
        logits = Engine(opened.consumer).prefill(np.asarray(prompt), all_logits=True)
        tokens, _ = generate_ids(Engine(opened.consumer), list(prompt), steps)
    return logits, tokens


@pytest.mark.parametrize(("qtype", "window"), [("f32", None), ("f16", 5), ("q8_0", None)])
def test_phimoe_gguf_runs_as_transformers(tmp_path, qtype, window):
    model = phimoe(sliding_window=window)
    write_gguf(model, tmp_path / "m.gguf", qtype)
    with Store.open(tmp_path / "s") as store:
        mount(store, tmp_path / "m.gguf", "m@1")
    got, tokens = _run(tmp_path / "s", "m@1")
    want, want_tokens = reference(reference_model(model, qtype), PROMPT, 12)
    assert np.abs(got - want).max() < 1e-5 * float(want.max() - want.min())
    assert tokens == want_tokens


def test_phimoe_gguf_exports_back_tensor_for_tensor(tmp_path):
    import gguf

    write_gguf(phimoe(), tmp_path / "in.gguf", "q8_0")
    with Store.open(tmp_path / "s") as store:
        mount(store, tmp_path / "in.gguf", "m@1")
        (path,) = export_gguf(store, "m@1", tmp_path / "out.gguf")
    names = same_tensors(tmp_path / "in.gguf", path)
    assert "blk.0.attn_norm.bias" in names and "output.bias" in names
    assert gguf.GGUFReader(path).fields["general.architecture"].contents() == "phimoe"


@pytest.mark.parametrize("make", ["phimoe", "llama4", "qwen3_next", "jamba"])
def test_safetensors_model_exports_to_a_gguf_that_runs_the_same(tmp_path, make):
    """A safetensors model exports to a GGUF that mounts and runs as transformers does;
    a hybrid's to the converter's own tensors (``1 + w``, the split ``in_proj_qkvz``, the
    squeezed conv1d byte for byte; ``-exp(A_log)`` correctly rounded, within an ulp of
    torch's) and metadata."""
    makers = {"phimoe": lambda: phimoe(sliding_window=7), "llama4": llama4}
    model = makers[make]() if make in makers else hybrid(make)
    model.save_pretrained(tmp_path / "ckpt")
    with Store.open(tmp_path / "s") as store:
        mount(store, tmp_path / "ckpt", "m@1")
        (path,) = export_gguf(store, "m@1", tmp_path / "out.gguf")
    if make in HYBRID:
        write_gguf(model, tmp_path / "want.gguf", "f32")
        same_tensors(tmp_path / "want.gguf", path, ulp=(".ssm_a",))
        assert _arch_fields(path) == _arch_fields(tmp_path / "want.gguf")
    with Store.open(tmp_path / "s2") as store:
        mount(store, path, "g@1")
    got, tokens = _run(tmp_path / "s2", "g@1")
    want, want_tokens = reference(model, PROMPT, 12)
    assert np.abs(got - want).max() < 1e-5 * float(want.max() - want.min())
    assert tokens == want_tokens


def test_what_gguf_cannot_hold_is_refused(tmp_path):
    model = phimoe(router_jitter_noise=0.3)
    model.save_pretrained(tmp_path / "ckpt")
    with Store.open(tmp_path / "s") as store:
        mount(store, tmp_path / "ckpt", "m@1")
        with pytest.raises(UnsupportedGGUFError, match="router_jitter_noise"):
            export_gguf(store, "m@1", tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()
    # a converter's longrope file: an attention factor and rope factor tensors
    meta = {f"phimoe.{k}": 4 for k in ("embedding_length", "attention.head_count")}
    meta |= {"phimoe.block_count": 1, "phimoe.expert_count": 4, "phimoe.expert_used_count": 2}
    with pytest.raises(UnsupportedGGUFError, match="longrope"):
        config_from_gguf(
            {**meta, "phimoe.rope.scaling.attn_factor": 1.19}, GGUF_ARCHS["phimoe"], 8, True
        )
    with pytest.raises(UnsupportedGGUFError, match="longrope"):
        config_from_gguf(meta, GGUF_ARCHS["phimoe"], 8, True, ["rope_factors_long.weight"])


# Llama 4 as llama.cpp runs it: chunks of 8192 and a temperature floor of 8192 (fixed in
# its code), so within a short prompt every layer attends to all earlier tokens.
LLAMA4 = dict(
    DIMS,
    intermediate_size=32,
    intermediate_size_mlp=64,
    head_dim=32,
    num_attention_heads=2,
    num_key_value_heads=1,
    num_local_experts=8,
    num_experts_per_tok=2,
    attention_chunk_size=8192,
    floor_scale=8192,
    attn_scale=0.1,
    vocab_size=96,
)


# Llama 4's released rope: llama3 scaling. An original context of 64 (top level too, where
# the converter reads it) puts the 16 frequencies of a 32-wide head on both sides of its
# band: factors 1, between, and 8 (rope_freqs.weight); a prompt of 40 tokens makes
# them matter.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def llama4(**kw):
    return build_tiny_model("llama4_text", 3, **{**LLAMA4, **kw})


@pytest.mark.parametrize(
    ("qtype", "over"),
    [
        ("f32", {}),
        ("q8_0", {}),
        # every layer full attention and rope (MobileLLM-R1): the converter's sliding_window 0
        ("f16", {"layer_types": ["full_attention"] * 4, "no_rope_layers": [1] * 4}),
    ],
    ids=["f32", "q8_0", "all-full-f16"],
)
def test_llama4_gguf_runs_as_transformers_and_exports_back(tmp_path, qtype, over):
    """A Llama 4 text model as ``Llama4Model`` converts it (experts stacked from HF's
    transposed ``gate_up_proj``, q/k unpermuted, dense and MoE layers interleaved) mounts
    with transformers' logits and greedy tokens and exports back tensor for tensor."""
    import gguf

    model = llama4(**over)
    write_gguf(model, tmp_path / "m.gguf", qtype)
    with Store.open(tmp_path / "s") as store:
        manifest = store.manifest(mount(store, tmp_path / "m.gguf", "m@1").selector)
        (path,) = export_gguf(store, "m@1", tmp_path / "out.gguf")
    assert manifest["expert"]["sparse_layers"] == [1, 3]
    got, tokens = _run(tmp_path / "s", "m@1")
    want, want_tokens = reference(reference_model(model, qtype), PROMPT, 12)
    assert np.abs(got - want).max() < 1e-5 * float(want.max() - want.min())
    assert tokens == want_tokens
    if qtype == "q8_0":
        assert manifest["expert"]["format"] == "q8"
    assert "blk.1.ffn_gate_shexp.weight" in same_tensors(tmp_path / "m.gguf", path)
    fields = gguf.GGUFReader(path).fields
    for key in (
        "interleave_moe_layer_step",
        "expert_feed_forward_length",
        "attention.sliding_window",
    ):
        f, g = (
            fields.get(f"llama4.{key}"),
            gguf.GGUFReader(tmp_path / "m.gguf").fields.get(f"llama4.{key}"),
        )
        assert (f is None) == (g is None) and (f is None or f.contents() == g.contents()), key


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"attention_chunk_size": 4}, "fixes chunked attention"),
        ({"floor_scale": 4}, "fixes chunked attention"),
        ({"no_rope_layers": [1, 0, 1, 1]}, "fixes chunked attention"),
        ({"use_qk_norm": False}, "use_qk_norm"),
        ({"moe_layers": [1, 2]}, "moe_layers"),
        # (the converter writes llama3 alone, as rope_freqs)
        ({"rope_parameters": {**LLAMA3_ROPE, "rope_type": "linear"}}, "rope type 'linear'"),
    ],
)
def test_llama4_features_llama_cpp_fixes_otherwise_are_refused(over, match):
    config = json.loads(llama4(**over).config.to_json_string())
    with pytest.raises(UnsupportedGGUFError, match=match):
        gguf_metadata(config)


LONG_PROMPT = np.random.default_rng(6).integers(0, 96, 40)


def llama4_llama3_rope(**kw):
    return llama4(rope_parameters=LLAMA3_ROPE, original_max_position_embeddings=64, **kw)


def _rope_freqs(path) -> np.ndarray:
    import gguf

    (t,) = [t for t in gguf.GGUFReader(path).tensors if t.name == "rope_freqs.weight"]
    return np.asarray(t.data)


@pytest.mark.parametrize("qtype", ["f32", "q8_0"])
def test_llama4_gguf_with_rope_freqs_runs_as_transformers_and_exports_back(tmp_path, qtype):
    """A Llama 4 GGUF with the converter's ``rope_freqs`` (llama3 rope scaling) runs each
    frequency divided by its stored factor, as llama.cpp does: transformers' llama3 logits
    and greedy tokens; export writes the factors back byte for byte; a safetensors export
    is refused (no transformers config holds them)."""
    from czyx.store.models.export import ExportError, export

    model = llama4_llama3_rope()
    write_gguf(model, tmp_path / "m.gguf", qtype)
    ff = _rope_freqs(tmp_path / "m.gguf")
    assert ff.min() == 1 and ff.max() == 8 and ((ff > 1) & (ff < 8)).any()
    with Store.open(tmp_path / "s") as store:
        mount(store, tmp_path / "m.gguf", "m@1")
        (path,) = export_gguf(store, "m@1", tmp_path / "out.gguf")
        with pytest.raises(ExportError, match="rope_freqs"):
            export(store, "m@1", tmp_path / "hf")
    assert "rope_freqs.weight" in same_tensors(tmp_path / "m.gguf", path)
    got, tokens = _run(tmp_path / "s", "m@1", prompt=LONG_PROMPT)
    want, want_tokens = reference(reference_model(model, qtype), LONG_PROMPT, 12)
    tol = 1e-5 * float(want.max() - want.min())
    assert np.abs(got - want).max() < tol
    assert tokens == want_tokens
    plain = llama4()  # the same weights without the scaling: the factors do matter here
    plain.load_state_dict(model.state_dict())
    assert np.abs(reference(plain, LONG_PROMPT, 0)[0] - want).max() > 100 * tol


def test_rope_freqs_without_its_rope_type_or_the_type_without_them_is_refused(tmp_path):
    """Mount checks the tensor and the rope type that reads it come together."""
    from czyx.store.models.mount_errors import MissingTensorError

    llama4().save_pretrained(tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "config.json"
    config = json.loads(path.read_text())
    config["rope_parameters"] = {"rope_type": "freq_factors", "rope_theta": 10000.0}
    path.write_text(json.dumps(config))
    with Store.open(tmp_path / "s") as store, pytest.raises(MissingTensorError, match="without"):
        mount(store, tmp_path / "ckpt", "m@1")


def test_safetensors_llama4_with_llama3_rope_exports_the_converters_rope_freqs(tmp_path):
    """The export computes ``rope_freqs`` as ``LlamaModel.generate_extra_tensors`` does (the
    same float32 bytes as the converter's torch loop), and the GGUF runs as the model."""
    model = llama4_llama3_rope()
    model.save_pretrained(tmp_path / "ckpt")
    write_gguf(model, tmp_path / "want.gguf", "f32")
    with Store.open(tmp_path / "s") as store:
        mount(store, tmp_path / "ckpt", "m@1")
        (path,) = export_gguf(store, "m@1", tmp_path / "out.gguf")
    assert _rope_freqs(path).tobytes() == _rope_freqs(tmp_path / "want.gguf").tobytes()
    with Store.open(tmp_path / "s2") as store:
        mount(store, path, "g@1")
    got, tokens = _run(tmp_path / "s2", "g@1", prompt=LONG_PROMPT)
    want, want_tokens = reference(model, LONG_PROMPT, 12)
    assert np.abs(got - want).max() < 1e-5 * float(want.max() - want.min())
    assert tokens == want_tokens


def test_llama4_gguf_without_its_feed_forward_lengths_is_malformed():
    from czyx.store.models.gguf import GGUFError

    meta = {"llama4.embedding_length": 64, "llama4.attention.head_count": 2}
    meta |= {"llama4.block_count": 4, "llama4.expert_count": 8, "llama4.expert_used_count": 1}
    meta |= {"llama4.interleave_moe_layer_step": 2, "llama4.feed_forward_length": 64}
    with pytest.raises(GGUFError, match="expert_feed_forward_length"):
        config_from_gguf(meta, GGUF_ARCHS["llama4"], 96, True)


# Qwen3-Next and Jamba, every row length a multiple of 32 (Jamba's dt_proj, 4 wide, is the
# converter's F16 fallback in a q8_0 file).
HYBRID = {
    "qwen3_next": dict(DIMS, moe_intermediate_size=32, shared_expert_intermediate_size=32),
    "jamba": dict(DIMS, mamba_expand=2),
}


def hybrid(arch, **kw):
    """A tiny hybrid model whose norm weights are random (some of ``1 + w`` below 0.5,
    where ``(1 + w) - 1`` is not exact in float32)."""
    import torch

    model = build_tiny_model(arch, 3, **{**HYBRID[arch], **kw})
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.8)
    return model


def _arch_fields(path) -> dict:
    """The ``<arch>.*`` metadata of a GGUF file."""
    import gguf

    fields = gguf.GGUFReader(path).fields
    arch = fields["general.architecture"].contents()
    return {k: f.contents() for k, f in fields.items() if k.startswith(f"{arch}.")}


@pytest.mark.parametrize(
    ("arch", "qtype"),
    [
        ("qwen3_next", "f32"),
        ("qwen3_next", "q8_0"),
        ("qwen3_next", "bf16"),
        ("jamba", "f32"),
        ("jamba", "q8_0"),
    ],
)
def test_hybrid_gguf_runs_as_transformers_and_exports_back(tmp_path, arch, qtype):
    """A hybrid model as llama.cpp's converter writes it mounts with transformers' logits
    and greedy tokens, and exports back tensor for tensor with the same metadata."""
    model = hybrid(arch)
    write_gguf(model, tmp_path / "m.gguf", qtype)
    with Store.open(tmp_path / "s") as store:
        mount(store, tmp_path / "m.gguf", "m@1")
        (path,) = export_gguf(store, "m@1", tmp_path / "out.gguf")
    got, tokens = _run(tmp_path / "s", "m@1")
    want, want_tokens = reference(reference_model(model, qtype), PROMPT, 12)
    assert np.abs(got - want).max() < 1e-5 * float(want.max() - want.min())
    assert tokens == want_tokens
    names = same_tensors(tmp_path / "m.gguf", path)
    assert "blk.0.ssm_a" in names
    assert _arch_fields(path) == _arch_fields(tmp_path / "m.gguf")


@pytest.mark.parametrize(
    ("arch", "over", "match"),
    [
        ("qwen3_next", {"layer_types": ["full_attention", "linear_attention"] * 2}, "interval"),
        ("qwen3_next", {"attention_bias": True}, "attention_bias"),
        ("jamba", {"mamba_proj_bias": True}, "mamba_proj_bias"),
        ("jamba", {"attn_layer_period": 2, "attn_layer_offset": 3}, "offsets"),
    ],
)
def test_hybrid_configs_llama_cpp_lays_out_otherwise_are_refused(arch, over, match):
    config = {**json.loads(build_tiny_model(arch, 0).config.to_json_string()), **over}
    with pytest.raises(UnsupportedGGUFError, match=match):
        gguf_metadata(config)


def test_jamba_gguf_whose_attention_layers_have_no_period_is_refused():
    meta = {"jamba.embedding_length": 64, "jamba.attention.head_count": 4}
    meta |= {"jamba.block_count": 5, "jamba.expert_count": 8, "jamba.expert_used_count": 2}
    meta |= {"jamba.attention.head_count_kv": [0, 2, 2, 0, 2], "jamba.feed_forward_length": 64}
    with pytest.raises(UnsupportedGGUFError, match="attention layers"):
        config_from_gguf(meta, GGUF_ARCHS["jamba"], 96, True)


def test_gguf_hybrid_is_not_exported_as_safetensors(tmp_path):
    """Its ``ssm_a`` and ``1 + w`` norms have no exact HF inverse: refused in one line."""
    from czyx.store.models.export import ExportError, export

    write_gguf(hybrid("jamba"), tmp_path / "m.gguf", "f32")
    with Store.open(tmp_path / "s") as store:
        mount(store, tmp_path / "m.gguf", "m@1")
        with pytest.raises(ExportError, match="export it as GGUF"):
            export(store, "m@1", tmp_path / "out")


def test_bf16_qwen3next_exports_its_norms_as_the_converter_adds_in_bf16(tmp_path):
    """The converter adds 1 to a bf16 checkpoint's norms in bf16, then writes F32:
    the export rounds the same way (and -exp(A_log) to bf16 too, within a bf16 ulp)."""
    import gguf
    import torch

    model = hybrid("qwen3_next").to(torch.bfloat16)
    model.save_pretrained(tmp_path / "ckpt")
    with Store.open(tmp_path / "s") as store:
        mount(store, tmp_path / "ckpt", "m@1")
        (path,) = export_gguf(store, "m@1", tmp_path / "out.gguf")
    out = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}
    layer = model.model.layers[0]
    want = (layer.input_layernorm.weight.detach() + 1).float().numpy()
    assert np.array_equal(out["blk.0.attn_norm.weight"], want)
    a = (-torch.exp(layer.linear_attn.A_log.detach())).float().numpy()
    assert np.abs(out["blk.0.ssm_a"] - a).max() <= np.abs(a).max() * 2**-8


def test_qwen3next_gguf_whose_ssm_a_is_not_negative_is_refused(tmp_path, monkeypatch):
    """``A = -exp(A_log)`` is below 0: a file holding a value that is not fails closed."""
    from czyx.inference.errors import UnsupportedModelError
    from czyx.testing import gguf_writer

    real = gguf_writer._hybrid_tensors

    def flipped(cfg, arch, name, t):
        return [(n, -b if name.endswith(".A_log") else b) for n, b in real(cfg, arch, name, t)]

    monkeypatch.setattr(gguf_writer, "_hybrid_tensors", flipped)
    write_gguf(hybrid("qwen3_next"), tmp_path / "m.gguf", "f32")
    with Store.open(tmp_path / "s") as store:
        mount(store, tmp_path / "m.gguf", "m@1")
    with pytest.raises(UnsupportedModelError, match="ssm_a holds a value not below 0"):
        _run(tmp_path / "s", "m@1", steps=1)


def test_qwen3next_qkvz_halves_of_two_types_join_as_their_exact_values(tmp_path, monkeypatch):
    """attn_qkv Q8_0 beside an F16 attn_gate: in_proj_qkvz is read as the float32 of
    each half's values, rows in HF order."""
    import gguf

    from czyx.store.models.gguf import qkvz_dims, qkvz_rows
    from czyx.store.models.gguf_source import GGUFCheckpoint
    from czyx.testing import gguf_writer

    real = gguf_writer._tensor_type
    f16 = gguf.GGMLQuantizationType.F16
    monkeypatch.setattr(
        gguf_writer, "_tensor_type", lambda n, a, qt: f16 if "attn_gate" in n else real(n, a, qt)
    )
    model = hybrid("qwen3_next")
    write_gguf(model, tmp_path / "m.gguf", "q8_0")
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    qkv, gate = tensors["blk.0.attn_qkv.weight"], tensors["blk.0.attn_gate.weight"]
    halves = [gguf.quants.dequantize(np.asarray(qkv.data), qkv.tensor_type)]
    halves.append(np.asarray(gate.data).astype(np.float32))
    with GGUFCheckpoint(tmp_path / "m.gguf") as ckpt:
        name = "model.layers.0.linear_attn.in_proj_qkvz.weight"
        got = ckpt.array(name)
        rows = qkvz_rows(*qkvz_dims(ckpt.config))
    assert got.dtype == np.float32
    assert np.array_equal(got, np.concatenate(halves)[rows])
    want = model.model.layers[0].linear_attn.in_proj_qkvz.weight.detach().numpy()
    assert np.abs(got - want).max() < 0.02 * np.abs(want).max()
