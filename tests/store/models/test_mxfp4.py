"""MXFP4 GPT-OSS checkpoints (``*_blocks`` / ``*_scales`` experts): mounted only under a policy.

References: transformers' own dequantization (``convert_moe_packed_tensors``)
loaded into the float model (``mxfp4_reference``), and transformers loading
the MXFP4 checkpoint itself with ``Mxfp4Config(dequantize=True)`` (its CPU
path). ``f32`` must match both to 1e-5 of the logit range; ``q8`` is close
and its drift is recorded.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from czyx import portals
from czyx.inference.engine import Engine
from czyx.inference.kernels.linear import float_inputs
from czyx.inference.opened import OpenedModel
from czyx.store import Store
from czyx.store.models.gguf import ConversionPolicyError
from czyx.store.models.mount import mount
from czyx.store.models.mxfp4 import E2M1, MXFP4Checkpoint, dequantize_mxfp4
from czyx.testing.mxfp4_writer import mxfp4_reference, quantize_mxfp4, write_mxfp4_checkpoint
from czyx.testing.tiny_models import build_tiny_model

PROMPT = np.random.default_rng(5).integers(0, 96, 10)


@pytest.fixture(scope="module")
def model():
    # intermediate 32 so both expert tensors' blocked axes are multiples of 32
    m = build_tiny_model("gpt_oss", seed=3, intermediate_size=32)
    with torch.no_grad():  # spread the experts' magnitudes over several E8M0 scales
        for layer in m.model.layers:
            for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                p.mul_(torch.exp(torch.randn_like(p)))
    return m


@pytest.fixture(scope="module")
def ckpt(model, tmp_path_factory):
    return write_mxfp4_checkpoint(model, tmp_path_factory.mktemp("mx") / "c")


def _logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(PROMPT)[None]).logits[0].float().numpy()


def _run(tmp_path, ckpt, policy):
    with Store.open(tmp_path / "s") as store:
        result = mount(store, ckpt, "m@1", convert=policy)
        manifest = store.manifest(result.selector)
        token = portals.root_token(store)
    with OpenedModel(str(tmp_path / "s"), "m@1", token) as opened, float_inputs():
        got = Engine(opened.consumer).prefill(PROMPT, all_logits=True)
    return result, manifest, got


def test_e2m1_table_is_transformers_and_gguf():
    from gguf.quants import MXFP4
    from transformers.integrations.mxfp4 import FP4_VALUES

    assert np.array_equal(E2M1, np.array(FP4_VALUES, np.float32))
    assert np.array_equal(E2M1 * 2, np.array(MXFP4.kvalues, np.float32))


def test_dequantization_is_transformers_bit_for_bit():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 5, 2, 16), dtype=np.uint8)
    scales = rng.integers(0, 255, (3, 5, 2), dtype=np.uint8)  # every exponent but 255 (NaN/inf)
    scales.reshape(-1)[:6] = [0, 1, 126, 127, 128, 254]
    want = convert_moe_packed_tensors(
        torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
    ).numpy()
    got = dequantize_mxfp4(blocks, scales)
    assert got.shape == want.shape == (3, 64, 5)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_writer_round_trips_exact_values():
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 16, (2, 64, 3))
    exps = rng.integers(-4, 4, (2, 2, 3))
    w = E2M1[codes] * np.ldexp(1.0, np.repeat(exps, 32, axis=1)).astype(np.float32)
    w[:, ::32, :] = 6.0 * np.ldexp(1.0, exps)  # each block's amax sets its scale
    blocks, scales = quantize_mxfp4(w)
    assert np.array_equal(dequantize_mxfp4(blocks, scales), w)


def test_checkpoint_presents_the_float_experts(ckpt):
    with MXFP4Checkpoint(ckpt, "f32") as ck:
        name = "model.layers.0.mlp.experts.gate_up_proj"
        assert name in ck and name + "_blocks" not in ck and name + "_scales" not in ck
        info = ck.info(name)
        assert (info.dtype, info.shape) == ("F32", (8, 32, 64))
        out = np.empty(info.nbytes - 12, np.uint8)
        ck.read_into(name, 6, out)  # a range that starts and ends mid-element and mid-expert
        assert np.array_equal(out, ck.array(name).reshape(-1).view(np.uint8)[6:-6])
        assert "quantization_config" not in ck.config


def test_f32_policy_matches_transformers(tmp_path, model, ckpt):
    from transformers import GptOssForCausalLM, Mxfp4Config

    _, manifest, got = _run(tmp_path, ckpt, "f32")
    want = _logits(mxfp4_reference(model, ckpt))
    span = float(want.max() - want.min())
    assert np.abs(got - want).max() < 1e-5 * span
    # transformers reading the MXFP4 checkpoint itself (it dequantizes on CPU)
    direct = GptOssForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    ).eval()
    assert np.abs(got - _logits(direct)).max() < 1e-5 * span
    assert manifest["quant"]["policy"] == "mxfp4:f32"
    conv = manifest["quant"]["converted"]
    assert set(conv) == {
        f"model.layers.{i}.experts.*.{p}" for i in (0, 1) for p in ("gate", "up", "down")
    }
    assert all(v[:3] == ["MXFP4", "f32", 0] for v in conv.values())
    assert manifest["source"]["conversion"]["quantization_config"]["quant_method"] == "mxfp4"
    assert manifest["expert"]["transform"] == "gate_up_t_interleaved"
    assert "quantization_config" not in manifest["config"]


@pytest.mark.parametrize(("policy", "fmt"), [("bf16", "bf16"), ("q8", "q8")])
def test_narrower_policies_record_their_drift(tmp_path, model, ckpt, policy, fmt):
    result, manifest, got = _run(tmp_path, ckpt, policy)
    want = _logits(mxfp4_reference(model, ckpt))
    assert manifest["expert"]["format"] == fmt
    conv = manifest["quant"]["converted"]
    src, target, rel, max_abs = conv["model.layers.0.experts.*.gate"]
    assert (src, target) == ("MXFP4", fmt)
    if policy == "bf16":  # E2M1 times a power of two has at most 2 significant bits
        assert rel == 0 and max_abs == 0
        assert np.abs(got - want).max() < 1e-5 * float(want.max() - want.min())
    else:
        assert 0 < rel < 0.01 and max_abs > 0
        assert np.abs(got - want).max() < 0.02 * float(want.max() - want.min())
    assert sum("MXFP4 ->" in line for line in result.conversions) == 6


def test_mxfp4_without_a_policy_is_refused(tmp_path, ckpt):
    with Store.open(tmp_path / "s") as store:
        with pytest.raises(ConversionPolicyError, match="MXFP4"):
            mount(store, ckpt, "m@1")
        assert store.tags() == {}


def test_quant_flag_is_refused(tmp_path, ckpt):
    from czyx.store.quant.codec import QuantCodec
    from czyx.store.quant.policy import parse_policy

    codec = QuantCodec(parse_policy("q4-all"))
    with Store.open(tmp_path / "s") as store, pytest.raises(ConversionPolicyError, match="quant"):
        mount(store, ckpt, "m@1", convert="f32", quant=codec)


def test_blocks_without_scales_are_refused(tmp_path, model):
    from safetensors.numpy import load_file, save_file

    from czyx.store.models.mount_errors import MissingTensorError

    c = write_mxfp4_checkpoint(model, tmp_path / "c")
    state = load_file(str(c / "model.safetensors"))
    del state["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(state, str(c / "model.safetensors"))
    with pytest.raises(MissingTensorError, match="scales"):
        MXFP4Checkpoint(c, "f32")


def test_cli_convert(tmp_path, ckpt, capsys):
    from czyx.cli import main

    sd = str(tmp_path / "s")
    assert main(["mount", str(ckpt), "--as", "m@1", "--store", sd]) != 0
    assert "MXFP4" in capsys.readouterr().err
    assert main(["mount", str(ckpt), "--as", "m@1", "--store", sd, "--convert", "q8"]) == 0
    assert "MXFP4 -> q8, relative RMS error" in capsys.readouterr().out
    assert json.loads((ckpt / "config.json").read_text())["quantization_config"]


def test_published_layout_bf16_trunk_and_shards(tmp_path):
    """As GPT-OSS ships: bf16 trunk and expert biases, experts MXFP4, sharded with an index."""
    from safetensors.torch import load_file, save_file

    model = build_tiny_model("gpt_oss", seed=4, intermediate_size=32, dtype="bfloat16")
    c = write_mxfp4_checkpoint(model, tmp_path / "c")
    state = load_file(str(c / "model.safetensors"))
    (c / "model.safetensors").unlink()
    names = sorted(state)
    shards = {
        "model-00001-of-00002.safetensors": [n for n in names if ".layers.0." in n],
        "model-00002-of-00002.safetensors": [n for n in names if ".layers.0." not in n],
    }
    for fname, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(c / fname), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (c / "model.safetensors.index.json").write_text(json.dumps(index))
    _, manifest, got = _run(tmp_path, c, "bf16")
    assert manifest["expert"]["dtype"] == "BF16"
    want = _logits(mxfp4_reference(model.float(), _merged(c, state)))
    assert np.abs(got - want).max() < 1e-5 * float(want.max() - want.min())


def _merged(c, state):
    from safetensors.torch import save_file

    out = c.parent / "merged"
    out.mkdir()
    save_file(state, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("policy", ["f32", "q8"])
def test_export_writes_what_transformers_loads(tmp_path, model, ckpt, policy):
    """Stacked GPT-OSS experts come back stacked (transformers loads no per-expert names)."""
    from safetensors import safe_open
    from transformers import GptOssForCausalLM

    from czyx.store.models.export import export

    _, _, got = _run(tmp_path, ckpt, policy)
    with Store.open(tmp_path / "s") as store:
        export(store, "m@1", tmp_path / "out", dequantize=policy == "q8")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "np") as f:
        keys = set(f.keys())
        history = json.loads(f.metadata()["czyx_format_history"])
    assert "model.layers.1.mlp.experts.gate_up_proj" in keys
    assert not any(".experts.0." in k for k in keys)
    assert [h["step"] for h in history] == ["source", "convert", "mount"]
    exported = GptOssForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    back = _logits(exported)
    # the values the version stores (f32: the MXFP4 reference exactly; q8: its dequantization)
    assert np.abs(back - got).max() < 1e-5 * float(got.max() - got.min())
    if policy == "f32":
        want = _logits(mxfp4_reference(model, ckpt))
        assert np.abs(back - want).max() < 1e-5 * float(want.max() - want.min())
