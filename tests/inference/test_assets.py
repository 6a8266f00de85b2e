"""The bundled checkpoint: present, intact (hashes in its log), and the shape it claims."""

from __future__ import annotations

import hashlib
import json

from safetensors import safe_open

from czyx.inference.assets import bundled_model_dir


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


def test_bundled_model_predicts_held_out_text(tmp_path) -> None:
    """Measured here, not read from the log: through the store and the engine, the
    model codes held-out standard-library text in fewer bits than zlib -9 does."""
    import zlib

    import numpy as np

    from czyx.inference.engine import Engine
    from czyx.inference.quant_eval import stdlib_split, text_windows, window_logits
    from czyx.inference.tokenizer import ByteTokenizer
    from czyx.portals import open_consumer
    from czyx.store import Store
    from czyx.store.models.mount import mount

    _, val = stdlib_split()
    # Windows of the training context (256 bytes; the model degrades past it),
    # from files spread over the held-out split.
    windows = text_windows(ByteTokenizer().encode, val[::11], 256, 8)
    assert len(windows) == 8
    with Store.open(tmp_path / "store") as st:
        mount(st, bundled_model_dir(), "stdlib@1")
        with open_consumer(st, None, "stdlib@1") as consumer:
            logits = window_logits(Engine(consumer), windows)
    nll = []
    for z, w in zip(logits, windows):
        z = z[:-1].astype(np.float64)
        m = z.max(-1, keepdims=True)
        logp = z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))
        nll.append(-logp[np.arange(w.size - 1), w[1:]])
    model_bpb = float(np.concatenate(nll).mean() / np.log(2))
    data = b"".join(bytes(w.astype(np.uint8)) for w in windows)
    zlib_bpb = 8 * len(zlib.compress(data, 9)) / len(data)
    assert model_bpb < zlib_bpb, (model_bpb, zlib_bpb)
