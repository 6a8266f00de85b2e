"""The bundled checkpoint: present, intact (hashes in its log), and the shape it claims."""

from __future__ import annotations

import hashlib
import json

from safetensors import safe_open

from inference.assets import bundled_model_dir


def test_bundled_checkpoint_matches_its_training_log() -> None:
    d = bundled_model_dir()
    log = json.loads((d / "training_log.json").read_text())
    for name, meta in log["files"].items():
        data = (d / name).read_bytes()
        assert len(data) == meta["bytes"], name
        assert hashlib.sha256(data).hexdigest() == meta["sha256"], name
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "mixtral" and cfg["vocab_size"] == 256
    assert log["val_bpb"] < log["baselines_bpb"]["zlib9_bpb"]
    assert abs(log["val_bpb_reloaded"] - log["val_bpb"]) < 0.01
    with safe_open(d / "model.safetensors", "np") as f:
        keys = set(f.keys())
        w1 = f.get_tensor("model.layers.0.block_sparse_moe.experts.0.w1.weight")
    assert w1.dtype.name == "float16"
    assert w1.shape == (cfg["intermediate_size"], cfg["hidden_size"])
    n_expert_mats = sum(".block_sparse_moe.experts." in k for k in keys)
    assert n_expert_mats == 3 * cfg["num_local_experts"] * cfg["num_hidden_layers"]
