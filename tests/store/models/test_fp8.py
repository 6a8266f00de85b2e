"""FP8 block-scaled checkpoints (F8_E4M3 + weight_scale_inv): mounted only under a policy.

Reference: the transformers model whose weights are the FP8 codes times their
block scales in float32 (``fp8_reference``). ``f32`` must match it to 1e-5 of
the logit range; ``bf16`` and ``q8`` are close and their drift is recorded.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from czyx import portals
from czyx.inference.engine import Engine
from czyx.inference.kernels.linear import float_inputs
from czyx.inference.opened import OpenedModel
from czyx.store import Store
from czyx.store.models.fp8 import dequantize_fp8, e4m3_table
from czyx.store.models.gguf import ConversionPolicyError
from czyx.store.models.mount import mount
from czyx.testing.fp8_writer import fp8_reference, write_fp8_checkpoint

from .test_gguf import gguf_model

PROMPT = np.random.default_rng(4).integers(0, 256, 12)


def _run(tmp_path, arch, policy, block=(32, 32)):
    model = gguf_model(arch)
    ckpt = write_fp8_checkpoint(model, tmp_path / "c", block)
    with Store.open(tmp_path / "s") as store:
        result = mount(store, ckpt, "m@1", convert=policy)
        manifest = store.manifest(result.selector)
        token = portals.root_token(store)
    with OpenedModel(str(tmp_path / "s"), "m@1", token) as opened, float_inputs():
        got = Engine(opened.consumer).prefill(PROMPT, all_logits=True)
    with torch.no_grad():
        want = fp8_reference(model, ckpt)(torch.tensor(PROMPT)[None]).logits[0].numpy()
    return result, manifest, got, want


def test_e4m3_table_matches_torch():
    bits = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    table = e4m3_table()
    assert np.array_equal(np.isnan(table), np.isnan(bits))
    assert np.array_equal(table[~np.isnan(table)], bits[~np.isnan(bits)])


def test_block_dequantization_handles_partial_blocks():
    codes = np.random.default_rng(0).integers(0, 0x7E, (5, 7)).astype(np.uint8)
    scale = np.array([[2.0, 3.0], [5.0, 7.0]], np.float32)
    got = dequantize_fp8(codes, scale, (4, 4))
    want = e4m3_table()[codes] * np.repeat(np.repeat(scale, 4, 0), 4, 1)[:5, :7]
    assert np.array_equal(got, want)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_f32_policy_is_the_reference_exactly(tmp_path, arch):
    _, manifest, got, want = _run(tmp_path, arch, "f32")
    assert np.abs(got - want).max() < 1e-5 * float(want.max() - want.min())
    assert manifest["quant"]["policy"] == "fp8:f32"
    assert all(v[2] == 0 for v in manifest["quant"]["converted"].values())
    assert manifest["source"]["conversion"]["block"] == [32, 32]
    assert "quantization_config" not in manifest["config"]


def test_deepseek_block_size_with_partial_blocks(tmp_path):
    _, _, got, want = _run(tmp_path, "olmoe", "f32", block=(128, 128))
    assert np.abs(got - want).max() < 1e-5 * float(want.max() - want.min())


@pytest.mark.parametrize(
    ("arch", "policy", "fmt"), [("qwen2_moe", "bf16", "bf16"), ("qwen3_moe", "q8", "q8")]
)
def test_narrower_policies_record_their_drift(tmp_path, arch, policy, fmt):
    result, manifest, got, want = _run(tmp_path, arch, policy)
    assert manifest["expert"]["format"] == fmt
    conv = manifest["quant"]["converted"]
    src, target, rel, max_abs = conv["model.layers.0.experts.*.gate"]
    assert (src, target) == ("F8_E4M3", fmt) and 0 < rel < 0.01 and max_abs > 0
    assert "model.layers.0.self_attn.q_proj.weight" in conv
    assert any("F8_E4M3 ->" in line for line in result.conversions)
    assert np.abs(got - want).max() < 0.02 * float(want.max() - want.min())


def test_fp8_without_a_policy_is_refused(tmp_path):
    ckpt = write_fp8_checkpoint(gguf_model("olmoe"), tmp_path / "c", (32, 32))
    with Store.open(tmp_path / "s") as store:
        with pytest.raises(ConversionPolicyError, match="F8_E4M3"):
            mount(store, ckpt, "m@1")
        assert store.tags() == {}


def test_cli_convert(tmp_path, capsys):
    from czyx.cli import main

    ckpt = write_fp8_checkpoint(gguf_model("olmoe"), tmp_path / "c", (32, 32))
    sd = str(tmp_path / "s")
    assert main(["mount", str(ckpt), "--as", "m@1", "--store", sd, "--convert", "bf16"]) == 0
    assert "F8_E4M3 -> bf16, relative RMS error" in capsys.readouterr().out
