"""Bench fixtures for bench_engine.py: checkpoints mounted in a real store.

``mount_transformers`` saves a transformers model with ``save_pretrained`` and
mounts it (``store.mount``); ``write_synthetic_checkpoint`` writes a
Mixtral-shaped checkpoint with random weights, one safetensors shard per
layer (never the whole model in memory), for the memory figure. Both are then
opened the way ``czyx run`` opens a model: through a portal
(``czyx.commands.run.OpenedModel``: the owner's root portal,
``store.model.open_model`` with O_DIRECT expert reads).
"""

from __future__ import annotations

import json
import os

import numpy as np


def mount_checkpoint(ckpt_dir: str, store_dir: str, tag: str) -> None:
    """Mount the checkpoint directory ``ckpt_dir`` into ``store_dir`` as ``tag``."""
    from czyx.store import Store
    from czyx.store.models.mount import mount

    store = Store.open(store_dir)
    try:
        mount(store, ckpt_dir, tag)
    finally:
        store.close()


def mount_transformers(model, workdir: str, tag: str = "bench@1") -> str:
    """Save ``model`` under ``workdir`` and mount it; returns the store directory."""
    ckpt = os.path.join(workdir, "checkpoint")
    model.save_pretrained(ckpt)
    store_dir = os.path.join(workdir, "store")
    mount_checkpoint(ckpt, store_dir, tag)
    return store_dir


def synthetic_config(
    hidden: int, inter: int, n_layers: int, n_experts: int, vocab: int = 4096
) -> dict:
    """A Mixtral config for a synthetic model."""
    return dict(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=n_layers,
        num_attention_heads=max(hidden // 64, 1),
        num_key_value_heads=max(hidden // 256, 1),
        num_local_experts=n_experts,
        num_experts_per_tok=2,
        vocab_size=vocab,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        hidden_act="silu",
        torch_dtype="float32",
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    )


def write_synthetic_checkpoint(ckpt_dir: str, cfg: dict, seed: int = 0) -> int:
    """Write random weights for ``cfg`` as a sharded safetensors checkpoint.

    One shard per layer (its attention, router and stacked experts) plus one
    for the globals, so at most one layer is in memory. Uniform values scaled
    to a small spread (faster to draw than normals; they only need to be
    finite and distinct). Returns the bytes of routed experts written.
    """
    from safetensors.numpy import save_file

    os.makedirs(ckpt_dir, exist_ok=True)
    rng = np.random.default_rng(seed)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    e = cfg["num_local_experts"]
    hd = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd

    def r(*shape: int, scale: float = 0.1) -> np.ndarray:
        a = rng.random(shape, dtype=np.float32)
        a -= 0.5
        a *= scale
        return a

    weight_map: dict[str, str] = {}
    expert_bytes = 0

    def save(tensors: dict[str, np.ndarray], name: str) -> None:
        save_file(tensors, os.path.join(ckpt_dir, name))
        weight_map.update(dict.fromkeys(tensors, name))

    save(
        {
            "model.embed_tokens.weight": r(v, h),
            "model.norm.weight": np.ones(h, np.float32),
            "lm_head.weight": r(v, h),
        },
        "globals.safetensors",
    )
    for la in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{la}."
        tensors = {
            p + "input_layernorm.weight": np.ones(h, np.float32),
            p + "post_attention_layernorm.weight": np.ones(h, np.float32),
            p + "self_attn.q_proj.weight": r(h, h),
            p + "self_attn.k_proj.weight": r(kv, h),
            p + "self_attn.v_proj.weight": r(kv, h),
            p + "self_attn.o_proj.weight": r(h, h),
            p + "mlp.gate.weight": r(e, h, scale=4.0),
            p + "mlp.experts.gate_up_proj": r(e, 2 * i, h),
            p + "mlp.experts.down_proj": r(e, h, i),
        }
        expert_bytes += tensors[p + "mlp.experts.gate_up_proj"].nbytes
        expert_bytes += tensors[p + "mlp.experts.down_proj"].nbytes
        save(tensors, f"layer-{la:03d}.safetensors")
        del tensors
    with open(os.path.join(ckpt_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(ckpt_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    return expert_bytes
