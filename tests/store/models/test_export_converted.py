"""Export of converted and quantized versions: a checkpoint transformers loads, with history."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from safetensors import safe_open

from czyx import portals
from czyx.inference.engine import Engine
from czyx.inference.kernels import linear
from czyx.inference.opened import OpenedModel
from czyx.store import Store
from czyx.store.models.export import ExportError, export
from czyx.store.models.gguf_export import export_gguf
from czyx.store.models.mount import mount
from czyx.store.quant.codec import QuantCodec
from czyx.store.quant.policy import parse_policy
from czyx.testing.fp8_writer import fp8_reference, write_fp8_checkpoint
from czyx.testing.gguf_writer import reference_model, write_gguf
from czyx.testing.tiny_models import model_class

from .test_gguf import gguf_model

PROMPT = np.random.default_rng(8).integers(0, 256, 12)


def _logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(PROMPT)[None]).logits[0].float().numpy()


def _load(arch: str, path):
    return model_class(arch).from_pretrained(path, dtype=torch.float32).eval()


def _history(path) -> list:
    with safe_open(str(path / "model.safetensors"), "np") as f:
        meta = json.loads(f.metadata()["czyx_format_history"])
    assert meta == json.loads((path / "czyx_format_history.json").read_text())
    return meta


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_float_gguf_version_exports_as_a_transformers_checkpoint(tmp_path, arch):
    model = gguf_model(arch)
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    write_gguf(model, tmp_path / "m.gguf", "f16", chat_template=template)
    with Store.open(tmp_path / "s") as store:
        mount(store, tmp_path / "m.gguf", "m@1")
        export(store, "m@1", tmp_path / "out")
        (gg,) = export_gguf(store, "m@1", tmp_path / "again.gguf")
    tok_cfg = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == template
    assert GGUFReader(gg).fields["tokenizer.chat_template"].contents() == template
    want = _logits(reference_model(model, "f16"))
    got = _logits(_load(arch, tmp_path / "out"))
    assert np.abs(got - want).max() < 1e-5 * float(want.max() - want.min())
    hist = _history(tmp_path / "out")
    assert hist[0] == {"step": "source", "format": "gguf", "types": ["F16", "F32"]}


def test_quantized_gguf_version_needs_dequantize_and_then_is_exact(tmp_path):
    model = gguf_model("qwen3_moe")
    write_gguf(model, tmp_path / "m.gguf", "q8_0")
    with Store.open(tmp_path / "s") as store:
        mount(store, tmp_path / "m.gguf", "m@1")
        with pytest.raises(ExportError, match="dequantize"):
            export(store, "m@1", tmp_path / "refused")
        export(store, "m@1", tmp_path / "out", dequantize=True)
    assert not (tmp_path / "refused" / "model.safetensors").exists()
    want = _logits(reference_model(model, "q8_0"))
    got = _logits(_load("qwen3_moe", tmp_path / "out"))
    assert np.abs(got - want).max() < 1e-5 * float(want.max() - want.min())
    mount_step = _history(tmp_path / "out")[-1]
    assert mount_step["expert_format"] == "q8" and mount_step["policy"] == "gguf:native"


def test_store_quantized_version_exports_in_its_compute_dtype(tmp_path):
    model = gguf_model("olmoe").to(torch.float16)
    model.save_pretrained(tmp_path / "ckpt")
    with Store.open(tmp_path / "s") as store:
        mount(store, tmp_path / "ckpt", "m@q4", quant=QuantCodec(parse_policy("q4-all")))
        export(store, "m@q4", tmp_path / "out", dequantize=True)
        token = portals.root_token(store)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118
    assert dtypes == {torch.float16}
    exported = _load("olmoe", tmp_path / "out").float()
    # the float-input kernels: the comparison is of the weights' values, not of the
    # 8-bit inputs the short-prompt kernels use (inference.kernels.linear)
    with OpenedModel(str(tmp_path / "s"), "m@q4", token) as opened, linear.float_inputs():
        engine = Engine(opened.consumer).prefill(PROMPT, all_logits=True)
    got = _logits(exported)
    # the same q4 values, rounded once more to f16 by the export
    assert np.abs(got - engine).max() < 1e-2 * float(engine.max() - engine.min())
    assert _history(tmp_path / "out")[-1]["policy"] == "q4-all"


def test_fp8_version_exports_its_reference_values(tmp_path):
    model = gguf_model("mixtral")
    ckpt = write_fp8_checkpoint(model, tmp_path / "c", (32, 32))
    with Store.open(tmp_path / "s") as store:
        mount(store, ckpt, "m@1", convert="f32")
        export(store, "m@1", tmp_path / "out")
    want = _logits(fp8_reference(model, ckpt))
    got = _logits(_load("mixtral", tmp_path / "out"))
    assert np.abs(got - want).max() < 1e-5 * float(want.max() - want.min())
    steps = [h["step"] for h in _history(tmp_path / "out")]
    assert steps == ["source", "convert", "mount"]


def test_cli_dequantize_flag(tmp_path, capsys):
    from czyx.cli import main

    write_gguf(gguf_model("olmoe"), tmp_path / "m.gguf", "q4_0")
    sd = str(tmp_path / "s")
    assert main(["mount", str(tmp_path / "m.gguf"), "--as", "m@1", "--store", sd]) == 0
    assert main(["export", "m@1", str(tmp_path / "o"), "--store", sd]) != 0
    assert "--dequantize" in capsys.readouterr().err
    assert main(["export", "m@1", str(tmp_path / "o"), "--store", sd, "--dequantize"]) == 0
    assert (tmp_path / "o" / "config.json").is_file()
