"""Bench fixtures for bench_engine.py: a file-backed consumer and a synthetic MoE.

``FileConsumer`` is a stand-in for the store's model reader (``store.model``)
until it is merged: it holds the trunk in memory and the routed experts in one
flat file of 4096-aligned slots, read with ``os.preadv`` (O_DIRECT when the
file system allows it, else buffered with the file evicted from the page cache
before each cold run). Same interface as ``store.consumer.ModelConsumer``, so
the engine cannot tell the difference.

``write_synthetic`` generates a Mixtral-shaped model with random weights
chunk by chunk (never all in memory), for the memory figure.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from store.consumer import ExpertExtent, ModelInfo

ALIGN = 4096


def slot_nbytes(hidden: int, inter: int) -> tuple[int, int]:
    """``(expert_nbytes, slot_nbytes)`` of an f32 expert (gate, up, down)."""
    n = 3 * hidden * inter * 4
    return n, -(-n // ALIGN) * ALIGN


def write_experts(
    path: str,
    n_layers: int,
    n_experts: int,
    hidden: int,
    inter: int,
    expert: Callable[[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]],
) -> None:
    """Write every ``expert(layer, e) -> (gate, up, down)`` into ``path``, one slot each."""
    nbytes, slot = slot_nbytes(hidden, inter)
    pad = np.zeros(slot - nbytes, np.uint8)
    with open(path, "wb") as f:
        for layer in range(n_layers):
            for e in range(n_experts):
                g, u, d = expert(layer, e)
                for a in (g, u, d):
                    f.write(np.ascontiguousarray(a, np.float32).tobytes())
                f.write(pad.tobytes())
        f.flush()
        os.fsync(f.fileno())


class FileConsumer:
    """A ``ModelConsumer`` over an in-memory trunk and a flat expert file.

    Parameters
    ----------
    path
        The expert file written by :func:`write_experts`.
    config
        The model's config dict (``model_type`` gives the arch).
    trunk
        ``{(role, layer or None): float32 array}``.
    direct
        Open with O_DIRECT (falls back to buffered reads where refused).
    """

    def __init__(
        self,
        path: str,
        config: dict,
        trunk: dict[tuple[str, int | None], np.ndarray],
        hidden: int,
        inter: int,
        direct: bool = True,
    ) -> None:
        n_layers = int(config["num_hidden_layers"])
        n_experts = int(config.get("num_local_experts") or config["num_experts"])
        nbytes, slot = slot_nbytes(hidden, inter)
        self.info = ModelInfo(
            arch=config["model_type"],
            config=config,
            n_layers=n_layers,
            n_experts=n_experts,
            expert_nbytes=nbytes,
            expert_slot_nbytes=slot,
            expert_format="f32",
            selector=b"\x00" * 32,
        )
        self._trunk = trunk
        self._h, self._i = hidden, inter
        self.direct = False
        flags = os.O_RDONLY
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(path, flags | os.O_DIRECT)
                self.direct = True
            except OSError:
                self.fd = os.open(path, flags)
        else:
            self.fd = os.open(path, flags)
        self.path = path

    def evict_page_cache(self) -> None:
        """Drop the file from the page cache (for a cold run of buffered reads)."""
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def has_trunk(self, role: str, layer: int | None = None) -> bool:
        return (role, layer) in self._trunk

    def trunk(self, role: str, layer: int | None = None) -> np.ndarray:
        return self._trunk[(role, layer)]

    def expert_extent(self, layer: int, router_byte: int) -> ExpertExtent:
        off = (layer * self.info.n_experts + router_byte) * self.info.expert_slot_nbytes
        return ExpertExtent(self.fd, off, self.info.expert_slot_nbytes, 0)

    def read_expert(self, layer: int, router_byte: int, slot: np.ndarray) -> None:
        ext = self.expert_extent(layer, router_byte)
        done = 0
        while done < ext.length:  # loop over short reads
            n = os.preadv(self.fd, [memoryview(slot[done:])], ext.offset + done)
            if n <= 0:
                raise OSError(f"short read at offset {ext.offset + done} of {self.path}")
            done += n

    def expert_views(self, slot: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        h, i = self._h, self._i
        f = slot[: self.info.expert_nbytes].view(np.float32)
        return (
            f[: i * h].reshape(i, h),
            f[i * h : 2 * i * h].reshape(i, h),
            f[2 * i * h :].reshape(h, i),
        )

    def close(self) -> None:
        os.close(self.fd)


def from_transformers(model, path: str, direct: bool = True) -> FileConsumer:
    """Write a transformers Mixtral/OLMoE/Qwen3-MoE model's experts to ``path``; consume it."""
    from tests.inference.refmodels import StateDictConsumer

    ref = StateDictConsumer(model)
    cfg = model.config
    n_experts = ref.info.n_experts
    sd = ref.sd
    sparse = [la for la in range(cfg.num_hidden_layers) if ref.has_trunk("router", la)]
    if len(sparse) != cfg.num_hidden_layers:
        raise ValueError("the file stand-in needs every layer sparse")
    gu0 = sd["model.layers.0.mlp.experts.gate_up_proj"]
    inter, hidden = gu0.shape[1] // 2, gu0.shape[2]

    def expert(layer: int, e: int):
        gu = sd[f"model.layers.{layer}.mlp.experts.gate_up_proj"][e]
        dn = sd[f"model.layers.{layer}.mlp.experts.down_proj"][e]
        return gu[:inter], gu[inter:], dn

    write_experts(path, cfg.num_hidden_layers, n_experts, hidden, inter, expert)
    trunk = {}
    from store.consumer import GLOBAL_ROLES, LAYER_ROLES

    for role in GLOBAL_ROLES:
        if ref.has_trunk(role):
            trunk[(role, None)] = ref.trunk(role)
    for la in range(cfg.num_hidden_layers):
        for role in LAYER_ROLES:
            if ref.has_trunk(role, la):
                trunk[(role, la)] = ref.trunk(role, la)
    return FileConsumer(path, ref.info.config, trunk, hidden, inter, direct)


def synthetic_config(
    hidden: int, inter: int, n_layers: int, n_experts: int, vocab: int = 4096
) -> dict:
    """A Mixtral config for a synthetic model."""
    return dict(
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
    )


def synthetic_trunk(cfg: dict, seed: int = 0) -> dict[tuple[str, int | None], np.ndarray]:
    """Random trunk tensors (scaled like an initialised model)."""
    rng = np.random.default_rng(seed)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    hd = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd

    def r(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.05).astype(np.float32)

    t: dict[tuple[str, int | None], np.ndarray] = {
        ("embed", None): r(v, h),
        ("final_norm", None): np.ones(h, np.float32),
        ("lm_head", None): r(v, h),
    }
    for la in range(cfg["num_hidden_layers"]):
        t.update(
            {
                ("input_norm", la): np.ones(h, np.float32),
                ("post_attn_norm", la): np.ones(h, np.float32),
                ("q_proj", la): r(h, h),
                ("k_proj", la): r(kv, h),
                ("v_proj", la): r(kv, h),
                ("o_proj", la): r(h, h),
                ("router", la): r(cfg["num_local_experts"], h) * 20,
            }
        )
    return t


def write_synthetic(path: str, cfg: dict, seed: int = 0) -> None:
    """Write random experts for ``cfg`` to ``path`` (one expert in memory at a time).

    Uniform values (faster to draw than normals) scaled to a small std; the
    values only need to be finite and distinct per expert.
    """
    rng = np.random.default_rng(seed + 1)
    h, i = cfg["hidden_size"], cfg["intermediate_size"]

    def r(*shape: int) -> np.ndarray:
        a = rng.random(shape, dtype=np.float32)
        a -= 0.5
        a *= 0.1
        return a

    def expert(layer: int, e: int):
        return r(i, h), r(i, h), r(h, i)

    write_experts(path, cfg["num_hidden_layers"], cfg["num_local_experts"], h, i, expert)
