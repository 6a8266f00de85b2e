"""A synthetic, file-backed Mixtral-format MoE: a model larger than a RAM budget, on demand.

Scope: benchmarks and evidence runs. :func:`create` writes every routed
expert of a randomly initialised Mixtral-shaped model into one aligned block
file (:class:`store.blockfile.BlockWriter`: 4096-aligned padded extents,
XXH3-64 checksums) and returns a :class:`SyntheticMoE`, a
:class:`~store.consumer.ModelConsumer` whose ``expert_extent`` hands out a
real descriptor, so the planner's I/O paths read a real file. The trunk stays
in memory. Weights are scaled so the residual stream stays well conditioned
(routing then depends on the token, as in a trained model, although its
locality is whatever random weights give: say so when quoting results).
Experts are float32 or float16 (``dtype``): real checkpoints ship 16-bit
experts, which halve the bytes read per expert while the engine widens them
to float32 per use.

Making experts cheaply: a few random expert blobs are drawn once, and each
expert is one of them times a distinct factor, so every extent (and
checksum) differs while generating a gigabyte costs one multiply pass.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from czyx.store.consumer import ExpertExtent, ModelInfo, gate_up_down_views
from czyx.store.core.blockfile import BlockWriter
from czyx.store.core.checksum import checksum
from czyx.store.io.experts import BlockFileExperts, pread_expert

ALIGN = 4096
_DTYPES = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16)}


def mixtral_config(
    hidden: int, inter: int, layers: int, experts: int, top_k: int, vocab: int, heads: int
) -> dict[str, Any]:
    """A Mixtral ``config.json`` dict for the given shape."""
    return {
        "model_type": "mixtral",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(heads // 2, 1),
        "num_local_experts": experts,
        "num_experts_per_tok": top_k,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "sliding_window": None,
    }


class SyntheticMoE(BlockFileExperts):
    """The consumer over a block file written by :func:`create` (trunk in memory)."""

    def __init__(
        self, path: Path, config: dict[str, Any], trunk: dict, off, sums, dtype: str = "f32"
    ) -> None:
        self.path = Path(path)
        h, i = config["hidden_size"], config["intermediate_size"]
        self._h, self._i = h, i
        self._dtype = _DTYPES[dtype]
        nbytes = 3 * h * i * self._dtype.itemsize
        self.info = ModelInfo(
            arch="mixtral",
            config=config,
            n_layers=config["num_hidden_layers"],
            n_experts=config["num_local_experts"],
            expert_nbytes=nbytes,
            expert_slot_nbytes=-(-nbytes // ALIGN) * ALIGN,
            expert_format=dtype,
            selector=checksum(self.path.name.encode()).to_bytes(8, "little") * 4,
        )
        self._trunk = trunk
        self.off, self.sums = off, sums
        self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)

    @property
    def expert_file_bytes(self) -> int:
        """Bytes of every routed expert's extent."""
        return self.info.n_layers * self.info.n_experts * self.info.expert_nbytes

    @property
    def trunk_bytes(self) -> int:
        """Bytes of the resident trunk tensors."""
        return sum(a.nbytes for a in self._trunk.values())

    def has_trunk(self, role: str, layer: int | None = None) -> bool:
        return (role, layer) in self._trunk

    def trunk(self, role: str, layer: int | None = None) -> np.ndarray:
        return self._trunk[(role, layer)]

    def expert_extent(self, layer: int, router_byte: int) -> ExpertExtent:
        return ExpertExtent(
            0,
            int(self.off[layer, router_byte]),
            self.info.expert_nbytes,
            int(self.sums[layer, router_byte]),
        )

    def expert_fds(self) -> list[int]:
        """The one block file's descriptor (``ExpertExtent.block`` 0)."""
        return [self.fd]

    def read_expert(self, layer: int, router_byte: int, slot: np.ndarray) -> None:
        """Buffered read into ``slot``, verified (the reference path the planner replaces)."""
        pread_expert(self.fd, self.path, self.expert_extent(layer, router_byte), slot)

    def expert_views(self, slot: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        i, h = self._i, self._h
        return gate_up_down_views(slot, self.info.expert_nbytes, i, h, self._dtype)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def create(
    directory: str | os.PathLike,
    *,
    hidden: int = 256,
    inter: int = 512,
    layers: int = 4,
    experts: int = 8,
    top_k: int = 2,
    vocab: int = 256,
    heads: int = 4,
    seed: int = 0,
    dtype: str = "f32",
) -> SyntheticMoE:
    """Write a synthetic Mixtral MoE's experts to ``directory/experts.blk``; open it.

    ``dtype`` is the experts' format, ``"f32"`` or ``"f16"``.

    Returns
    -------
    SyntheticMoE
        The consumer (close it when done; the file stays).
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    cfg = mixtral_config(hidden, inter, layers, experts, top_k, vocab, heads)
    rng = np.random.default_rng(seed)
    f32 = np.float32
    hd = hidden // heads
    kvh = cfg["num_key_value_heads"]

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=f32) / np.sqrt(shape[-1])).astype(f32)

    trunk: dict[tuple[str, int | None], np.ndarray] = {
        ("embed", None): rng.standard_normal((vocab, hidden), dtype=f32),
        ("final_norm", None): (1 + 0.1 * rng.standard_normal(hidden, dtype=f32)).astype(f32),
        ("lm_head", None): w(vocab, hidden),
    }
    for la in range(layers):
        trunk[("input_norm", la)] = (1 + 0.1 * rng.standard_normal(hidden, dtype=f32)).astype(f32)
        trunk[("post_attn_norm", la)] = (1 + 0.1 * rng.standard_normal(hidden, dtype=f32)).astype(
            f32
        )
        trunk[("q_proj", la)] = w(heads * hd, hidden)
        trunk[("k_proj", la)] = w(kvh * hd, hidden)
        trunk[("v_proj", la)] = w(kvh * hd, hidden)
        trunk[("o_proj", la)] = w(hidden, heads * hd)
        trunk[("router", la)] = rng.standard_normal((experts, hidden), dtype=f32)
    pool = [
        np.concatenate(
            [w(inter, hidden).ravel(), w(inter, hidden).ravel(), w(hidden, inter).ravel()]
        )
        for _ in range(3)
    ]
    Path(directory).mkdir(parents=True, exist_ok=True)
    path = Path(directory) / "experts.blk"
    if path.exists():
        path.unlink()
    writer = BlockWriter(path, b"\x05" * 32, rng.bytes(16), ALIGN)
    off = np.zeros((layers, experts), np.int64)
    sums = np.zeros((layers, experts), np.uint64)
    buf = np.empty_like(pool[0])
    out = buf if dtype == "f32" else np.empty(buf.shape, _DTYPES[dtype])
    try:
        for la in range(layers):
            for e in range(experts):
                np.multiply(pool[(la * experts + e) % 3], f32(1.0 + 0.01 * e + 0.001 * la), out=buf)
                if out is not buf:
                    out[...] = buf
                ext = writer.write(out)
                off[la, e], sums[la, e] = ext.offset, ext.checksum
        writer.sync()
    finally:
        writer.close()
    return SyntheticMoE(path, cfg, trunk, off, sums, dtype)
