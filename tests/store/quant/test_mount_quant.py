"""`czyx mount --quant` and `czyx calibrate`: quantized versions in a real store.

A tiny float checkpoint is mounted as is and quantized (selective); the
quantized version opens with packed experts and packed trunk tensors, and the
engine on it computes exactly what it computes on the same checkpoint
quantized in memory (same bytes, same kernels). Calibration over text
publishes an importance map that changes the quantized bytes.
"""

from __future__ import annotations

import numpy as np
import pytest

from czyx.cli import main
from czyx.inference.engine import Engine
from czyx.portals import open_consumer
from czyx.store import Store
from czyx.store.models.export import export
from czyx.store.models.mount import mount
from czyx.store.models.mount_errors import MountError
from czyx.store.quant.codec import QuantCodec
from czyx.store.quant.memory import QuantizedConsumer
from czyx.store.quant.policy import POLICIES
from czyx.testing.refmodels import StateDictConsumer
from czyx.testing.tiny_models import make_tiny_checkpoint, model_class

SIZES = dict(hidden_size=64, intermediate_size=64, vocab_size=256)
TOKENS = np.random.default_rng(2).integers(0, 256, 10)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("mixtral", tmp_path_factory.mktemp("ck") / "m", **SIZES)


def test_quantized_mount_matches_in_memory_quantization(ckpt, tmp_path):
    codec = QuantCodec(POLICIES["selective"])
    with Store.open(tmp_path / "s") as store:
        flt = mount(store, ckpt, "m@f32")
        q = mount(store, ckpt, "m@sel", quant=codec)
        assert q.selector != flt.selector and q.trunk_selector != flt.trunk_selector
        assert q.bytes_total < flt.bytes_total / 4
        assert not mount(store, ckpt, "m@sel", quant=codec).created  # same content
        with open_consumer(store, None, "m@sel") as model:
            assert model.info.expert_format == "q2"
            buf, fmt, shape = model.trunk_quantized("q_proj", 0)
            assert fmt.name == "q4" and shape == model.trunk("q_proj", 0).shape
            assert buf.size == fmt.nbytes(*shape)
            assert model.trunk_quantized("router", 0) is None
            assert model.trunk_quantized("embed")[1].name == "q8"
            got = Engine(model).prefill(TOKENS, all_logits=True)
        with pytest.raises(Exception, match="quantized"):
            export(store, "m@sel", tmp_path / "out")
        with pytest.raises(MountError):
            mount(store, ckpt, "m@adapter", adapter_of="m@f32", quant=codec)
    hf = model_class("mixtral").from_pretrained(ckpt).eval()
    mem = QuantizedConsumer(StateDictConsumer(hf), POLICIES["selective"])
    want = Engine(mem).prefill(TOKENS, all_logits=True)
    assert np.array_equal(got, want)


def test_cli_calibrate_then_mount_with_importance(ckpt, tmp_path, capsys):
    store_dir = str(tmp_path / "s")
    text = tmp_path / "calib.txt"
    text.write_text("def f(x):\n    return x * 2  # a little code\n" * 40, encoding="utf-8")
    assert main(["mount", str(ckpt), "--as", "m@1", "--store", store_dir, "--no-progress"]) == 0
    rc = main(
        [
            "calibrate",
            "m@1",
            "--text",
            str(text),
            "--store",
            store_dir,
            "--window",
            "32",
            "--max-tokens",
            "256",
        ]
    )
    assert rc == 0
    assert "m-importance@1" in capsys.readouterr().out
    args = ["--store", store_dir, "--no-progress", "--quant", "selective"]
    assert main(["mount", str(ckpt), "--as", "m@q", *args]) == 0
    assert (
        main(["mount", str(ckpt), "--as", "m@qcal", *args, "--importance", "m-importance@1"]) == 0
    )
    assert (
        main(
            [
                "mount",
                str(ckpt),
                "--as",
                "m@x",
                "--store",
                store_dir,
                "--importance",
                "m-importance@1",
            ]
        )
        == 1
    )
    assert main(["mount", str(ckpt), "--as", "m@y", "--store", store_dir, "--quant", "fancy"]) == 1
    with Store.open(store_dir) as store:
        assert store.manifest(store.resolve_tag("m@qcal"))["quant"]["importance"]["n_tokens"] == 256
        with open_consumer(store, None, "m@q") as a, open_consumer(store, None, "m@qcal") as b:
            qa, qb = a.trunk_quantized("q_proj", 1)[0], b.trunk_quantized("q_proj", 1)[0]
            assert not np.array_equal(qa, qb)  # the map changed the scales
            la = Engine(a).prefill(TOKENS)
            lb = Engine(b).prefill(TOKENS)
            assert la.shape == lb.shape == (256,)


def test_bf16_mount_quantizes_once_to_the_numpy_reference_bytes(tmp_path, monkeypatch):
    """The C quantizer reads bf16 in place; every tensor is quantized once (the write
    pass reads the hash pass's spool), and the stored bytes are the numpy reference's."""
    from czyx.store.models.checkpoint import Checkpoint, to_float32
    from czyx.store.quant.formats import dequantize, quantize_reference

    path = make_tiny_checkpoint("mixtral", tmp_path / "bf", dtype="bfloat16", **SIZES)
    calls = {"expert": 0, "trunk": 0}
    real_e, real_t = QuantCodec.encode_expert_raw, QuantCodec.encode_trunk_raw

    def count_e(self, *a, **k):
        calls["expert"] += 1
        return real_e(self, *a, **k)

    def count_t(self, *a, **k):
        out = real_t(self, *a, **k)
        calls["trunk"] += out[1] is not None  # float tensors are not quantized
        return out

    monkeypatch.setattr(QuantCodec, "encode_expert_raw", count_e)
    monkeypatch.setattr(QuantCodec, "encode_trunk_raw", count_t)
    policy = POLICIES["q4-all"]
    with Store.open(tmp_path / "s") as store:
        res = mount(store, path, "m@q4", quant=QuantCodec(policy))
        with open_consumer(store, None, "m@q4") as model, Checkpoint(path) as ck:
            n_experts = model.info.n_layers * model.info.n_experts
            assert calls["expert"] == n_experts
            mats = [t for t in ck.names() if "experts" not in t and len(ck.info(t).shape) == 2]
            assert calls["trunk"] == len(mats)
            gate_name = "model.layers.1.block_sparse_moe.experts.3.w1.weight"
            src = to_float32(ck.array(gate_name), "BF16")
            slot = np.zeros(model.info.expert_slot_nbytes, np.uint8)
            model.read_expert(1, 3, slot)
            gate = model.expert_views(slot)[0]
            np.testing.assert_array_equal(gate, quantize_reference(src, "q4"))
            # resident: only packed bytes; the float face is made on request
            buf, fmt, shape = model.trunk_quantized("q_proj", 0)
            a, b = model.trunk("q_proj", 0), model.trunk("q_proj", 0)
            assert a is not b and np.array_equal(a, dequantize(buf, fmt, shape))
            assert not buf.flags.writeable
    assert res.created
