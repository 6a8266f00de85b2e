"""GGUF in: files written the way llama.cpp's converter lays them out, mounted, run.

References: the transformers model whose weights are the GGUF's own values
dequantized by the ``gguf`` package (``reference_model``). Float GGUFs must
match it to 1e-5 of the logit range; natively stored Q8_0 / Q4_0 / Q4_1 too
(the repack is lossless, only the kernels' summation order differs). Types
without a native format mount only under a conversion policy, with the drift
recorded.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from czyx import portals
from czyx.inference.engine import Engine
from czyx.inference.kernels.linear import float_inputs
from czyx.inference.opened import OpenedModel
from czyx.inference.tokenizer import tokenizer_for
from czyx.store import Store
from czyx.store.models.gguf import (
    ConversionPolicyError,
    UnsupportedGGUFError,
    qk_permute,
    qk_rows,
)
from czyx.store.models.gguf_source import native_pack
from czyx.store.models.mount import mount, summarize
from czyx.store.quant.formats import dequantize
from czyx.testing.gguf_writer import reference_model, tiny_bpe_tokenizer_json, write_gguf
from czyx.testing.refmodels import ARCHS, tiny_model

PROMPT = np.random.default_rng(5).integers(0, 256, 12)
# GGUF blocks are 32 wide along rows: every matrix's row length a multiple of 32.
_DIMS = {"hidden_size": 64, "intermediate_size": 64}
_OVER = {
    "mixtral": {"sliding_window": None},  # llama.cpp runs Mixtral without a window
    "qwen2_moe": {"mlp_only_layers": [], "num_hidden_layers": 2, "moe_intermediate_size": 32},
    "qwen3_moe": {"moe_intermediate_size": 32},
    "olmoe": {"num_key_value_heads": 4},  # llama.cpp's olmoe has no GQA (as OLMoE itself)
}


def gguf_model(arch: str, **kw):
    return tiny_model(arch, seed=2, **{**_DIMS, **_OVER[arch], **kw})


def _logits(store_dir, tag, token) -> np.ndarray:
    with OpenedModel(str(store_dir), tag, token) as opened, float_inputs():
        return Engine(opened.consumer).prefill(PROMPT, all_logits=True)


def _want(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(PROMPT)[None]).logits[0].numpy()


def _mount_and_run(tmp_path, model, qtype, **kw):
    write_gguf(model, tmp_path / "m.gguf", qtype)
    with Store.open(tmp_path / "s") as store:
        result = mount(store, tmp_path / "m.gguf", "m@1", **kw)
        token = portals.root_token(store)
        manifest = store.manifest(result.selector)
    return result, manifest, _logits(tmp_path / "s", "m@1", token)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("qtype", ["f32", "f16"])
def test_float_gguf_matches_transformers(tmp_path, arch, qtype):
    model = gguf_model(arch)
    _, manifest, got = _mount_and_run(tmp_path, model, qtype)
    want = _want(reference_model(model, qtype))
    assert np.abs(got - want).max() < 1e-5 * float(want.max() - want.min())
    assert manifest["source"]["format"] == "gguf"
    assert manifest["expert"]["format"] == qtype


@pytest.mark.parametrize(
    ("arch", "qtype", "fmt"),
    [
        ("mixtral", "q8_0", "q8"),
        ("qwen2_moe", "q4_0", "q4"),
        ("qwen3_moe", "q4_1", "q4"),
        ("olmoe", "q8_0", "q8"),
    ],
)
def test_quantized_gguf_is_stored_natively(tmp_path, arch, qtype, fmt):
    model = gguf_model(arch)
    result, manifest, got = _mount_and_run(tmp_path, model, qtype)
    want = _want(reference_model(model, qtype))
    assert np.abs(got - want).max() < 1e-5 * float(want.max() - want.min())
    assert manifest["expert"]["format"] == fmt
    assert manifest["quant"]["policy"] == "gguf:native"
    assert manifest["quant"]["converted"] == {}  # nothing converted: no drift to report
    assert result.conversions == ()


def test_type_without_native_format_needs_a_policy(tmp_path):
    model = gguf_model("qwen3_moe")
    write_gguf(model, tmp_path / "m.gguf", "q5_0")
    with Store.open(tmp_path / "s") as store:
        with pytest.raises(ConversionPolicyError, match="Q5_0 has no native store format"):
            mount(store, tmp_path / "m.gguf", "m@1")
        assert store.tags() == {}
        result = mount(store, tmp_path / "m.gguf", "m@q8", convert="q8")
        manifest = store.manifest(result.selector)
        token = portals.root_token(store)
    assert manifest["expert"]["format"] == "q8"
    converted = manifest["quant"]["converted"]
    assert "blk.0.ffn_gate_exps.weight" in converted
    source, target, rel_rms, max_abs = converted["blk.0.ffn_gate_exps.weight"]
    assert (source, target) == ("Q5_0", "q8") and 0 < rel_rms < 0.02 and max_abs > 0
    assert any("Q5_0 -> q8" in line for line in result.conversions)
    want = _want(reference_model(model, "q5_0"))
    got = _logits(tmp_path / "s", "m@q8", token)
    # requantized: close to the Q5_0 reference, not equal
    assert np.abs(got - want).max() < 0.05 * float(want.max() - want.min())


def test_float_policy_dequantizes_and_records_drift(tmp_path):
    model = gguf_model("olmoe")
    write_gguf(model, tmp_path / "m.gguf", "q5_0")
    with Store.open(tmp_path / "s") as store:
        result = mount(store, tmp_path / "m.gguf", "m@f32", convert="f32")
        manifest = store.manifest(result.selector)
        token = portals.root_token(store)
    assert manifest["expert"]["format"] == "f32"
    assert all(v[1] == "f32" and v[2] == 0 for v in manifest["quant"]["converted"].values())
    want = _want(reference_model(model, "q5_0"))
    got = _logits(tmp_path / "s", "m@f32", token)
    assert np.abs(got - want).max() < 1e-5 * float(want.max() - want.min())


def test_split_files_mount_as_one_model(tmp_path):
    model = gguf_model("mixtral")
    files = write_gguf(model, tmp_path / "split" / "m.gguf", "f16", split_max_tensors=8)
    assert len(files) > 2
    with Store.open(tmp_path / "s") as store:
        a = mount(store, tmp_path / "split", "m@dir")
        b = mount(store, files[1], "m@file")
        token = portals.root_token(store)
    assert a.selector == b.selector
    want = _want(reference_model(model, "f16"))
    got = _logits(tmp_path / "s", "m@dir", token)
    assert np.abs(got - want).max() < 1e-5 * float(want.max() - want.min())
    files[-1].unlink()
    with Store.open(tmp_path / "s2") as store, pytest.raises(Exception, match="missing"):
        mount(store, files[0], "m@1")


def test_tokenizer_travels_from_gguf_metadata(tmp_path):
    from tokenizers import Tokenizer

    model = gguf_model("qwen3_moe", vocab_size=320)
    tj = tiny_bpe_tokenizer_json(320)
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    write_gguf(model, tmp_path / "m.gguf", "f32", tokenizer_json=tj, chat_template=template)
    with Store.open(tmp_path / "s") as store:
        mount(store, tmp_path / "m.gguf", "m@1")
        token = portals.root_token(store)
        # 16 experts + 3 global + 2 x 9 layer tensors; the tokenizer record is no tensor
        assert summarize(store, "m@1")["formats"] == {"f32": 16 + 3 + 18}
    src = Tokenizer.from_str(tj)
    text = "the lazy fox: 42 experts <|endoftext|> jumps!"
    with OpenedModel(str(tmp_path / "s"), "m@1", token) as opened:
        tok = tokenizer_for(opened.consumer, 320)
        ids = tok.encode(text)
        assert ids == src.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == src.decode(ids, skip_special_tokens=True)
        assert src.token_to_id("<|endoftext|>") in tok.eos_ids
        # the chat template travels too: the server renders chat with it
        from czyx.server.app import stored_template

        assert opened.consumer.gguf_chat_template() == template
        rendered = stored_template(opened.consumer, "m@1")
        assert rendered is not None
        assert rendered.render([{"role": "user", "content": "hi"}]).startswith("<user>hi")


@pytest.mark.parametrize(
    ("arch", "match"),
    [
        ("bert", "'bert' is not supported"),
    ],
)
def test_unsupported_architecture_is_refused(tmp_path, arch, match):
    import gguf

    w = gguf.GGUFWriter(tmp_path / "x.gguf", arch)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with Store.open(tmp_path / "s") as store, pytest.raises(UnsupportedGGUFError, match=match):
        mount(store, tmp_path / "x.gguf", "m@1")


def test_cli_mounts_a_gguf_file(tmp_path, capsys):
    from czyx.cli import main

    write_gguf(gguf_model("olmoe"), tmp_path / "m.gguf", "q4_0")
    sd = str(tmp_path / "s")
    assert main(["mount", str(tmp_path / "m.gguf"), "--as", "m@1", "--store", sd]) == 0
    assert "mounted: m@1" in capsys.readouterr().out
    q5 = tmp_path / "q5.gguf"
    write_gguf(gguf_model("olmoe"), q5, "q5_0")
    assert main(["mount", str(q5), "--as", "m@2", "--store", sd]) != 0
    assert "conversion policy" in capsys.readouterr().err
    assert main(["mount", str(q5), "--as", "m@2", "--store", sd, "--convert", "q4"]) == 0
    assert "Q5_0 -> q4, relative RMS error" in capsys.readouterr().out


@pytest.mark.parametrize("heads", [1, 2, 4])
def test_rope_row_orders_are_inverse(heads):
    rows = heads * 8
    assert np.array_equal(qk_permute(rows, heads)[qk_rows(rows, heads)], np.arange(rows))


@settings(max_examples=40, deadline=None)
@given(
    qname=st.sampled_from(["Q8_0", "Q4_0", "Q4_1"]),
    rows=st.integers(1, 5),
    blocks=st.integers(1, 4),
    scale=st.floats(1e-4, 1e3),
    seed=st.integers(0, 2**31 - 1),
)
def test_native_repack_is_lossless(qname, rows, blocks, scale, seed):
    import gguf

    qt = gguf.GGMLQuantizationType[qname]
    w = (np.random.default_rng(seed).standard_normal((rows, 32 * blocks)) * scale).astype(
        np.float32
    )
    data = gguf.quants.quantize(w, qt)
    packed, fmt = native_pack(data, qt)
    assert np.array_equal(dequantize(packed, fmt, w.shape), gguf.quants.dequantize(data, qt))


def test_manifest_records_the_gguf_metadata(tmp_path):
    model = gguf_model("qwen2_moe")
    _, manifest, _ = _mount_and_run(tmp_path, model, "f16")
    meta = manifest["source"]["metadata"]
    assert meta["general.architecture"] == "qwen2moe"
    assert manifest["source"]["tensor_types"]["blk.0.ffn_gate_exps.weight"] == "F16"
    assert json.loads(json.dumps(manifest["config"]))["moe_intermediate_size"] == 32


def test_mxfp4_gguf_converts_exactly_under_f32(tmp_path):
    model = gguf_model("qwen3_moe")
    write_gguf(model, tmp_path / "m.gguf", "mxfp4")
    with Store.open(tmp_path / "s") as store:
        with pytest.raises(ConversionPolicyError, match="MXFP4"):
            mount(store, tmp_path / "m.gguf", "m@native")
        result = mount(store, tmp_path / "m.gguf", "m@1", convert="f32")
        token = portals.root_token(store)
    assert any("MXFP4 -> f32" in line for line in result.conversions)
    want = _want(reference_model(model, "mxfp4"))
    got = _logits(tmp_path / "s", "m@1", token)
    assert np.abs(got - want).max() < 1e-5 * float(want.max() - want.min())


def test_float_gguf_with_a_store_quant_policy_keeps_its_tokenizer(tmp_path):
    from czyx.store.quant.codec import QuantCodec
    from czyx.store.quant.policy import parse_policy

    model = gguf_model("mixtral", vocab_size=320)
    write_gguf(model, tmp_path / "m.gguf", "f16", tokenizer_json=tiny_bpe_tokenizer_json(320))
    with Store.open(tmp_path / "s") as store:
        res = mount(store, tmp_path / "m.gguf", "m@q4", quant=QuantCodec(parse_policy("q4-all")))
        assert store.manifest(res.selector)["expert"]["format"] == "q4"
        token = portals.root_token(store)
        write_gguf(model, tmp_path / "q.gguf", "q8_0")
        with pytest.raises(ConversionPolicyError, match="requantize"):
            mount(store, tmp_path / "q.gguf", "m@x", quant=QuantCodec(parse_policy("q4-all")))
    with OpenedModel(str(tmp_path / "s"), "m@q4", token) as opened:
        assert opened.consumer.tokenizer_json() is not None
