"""A file-backed ModelConsumer for planner tests: experts in a real aligned block file.

Tests only. :class:`FileConsumer` writes every expert of a base consumer (the
in-memory ``StateDictConsumer`` of a tiny transformers model, or synthetic
bytes) into one block file with :class:`store.blockfile.BlockWriter` (4096-
aligned, padded extents, XXH3 checksums) and serves ``expert_extent`` with a
real descriptor, so the planner's I/O paths, identity checks and checksum
verification run against a file that tests can truncate, replace or corrupt.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from czyx.store.consumer import ExpertExtent, ModelInfo
from czyx.store.core.blockfile import BlockWriter
from czyx.store.io.experts import BlockFileExperts, pread_expert

ALIGN = 4096


class SyntheticExperts:
    """A minimal base: ``n_layers x n_experts`` experts of random float32 bytes, no trunk."""

    def __init__(self, n_layers: int = 3, n_experts: int = 8, nbytes: int = 3 * 4096, seed=0):
        rng = np.random.default_rng(seed)
        self.blobs = {
            (la, e): rng.integers(0, 255, nbytes, dtype=np.uint8)
            for la in range(n_layers)
            for e in range(n_experts)
        }
        self.info = ModelInfo(
            arch="synthetic",
            config={},
            n_layers=n_layers,
            n_experts=n_experts,
            expert_nbytes=nbytes,
            expert_slot_nbytes=-(-nbytes // ALIGN) * ALIGN,
            expert_format="f32",
            selector=b"\x02" * 32,
        )

    def expert_bytes(self, layer: int, e: int) -> np.ndarray:
        return self.blobs[(layer, e)]

    def expert_views(self, slot: np.ndarray):
        """Three float32 matrices ``[1, m]``, ``[1, m]``, ``[m, 1]`` (the bytes are random)."""
        m = self.info.expert_nbytes // 12
        f = slot[: 12 * m].view(np.float32)
        return f[:m].reshape(1, m), f[m : 2 * m].reshape(1, m), f[2 * m :].reshape(m, 1)


class FileConsumer(BlockFileExperts):
    """Experts of ``base`` in a block file under ``directory``; trunk and views from ``base``."""

    def __init__(self, base, directory: str | os.PathLike):
        self.base = base
        self.info: ModelInfo = base.info
        self.path = Path(directory) / "experts.blk"
        w = BlockWriter(self.path, self.info.selector, b"\x07" * 16, ALIGN)
        nl, ne = self.info.n_layers, self.info.n_experts
        self.off = np.full((nl, ne), -1, np.int64)
        self.sums = np.zeros((nl, ne), np.uint64)
        for layer in range(nl):
            for e in range(ne):
                blob = self._blob(layer, e)
                if blob is None:
                    continue
                ext = w.write(blob)
                self.off[layer, e] = ext.offset
                self.sums[layer, e] = ext.checksum
        w.sync()
        w.close()
        self.fd = os.open(self.path, os.O_RDONLY)
        self.reads = 0

    def _blob(self, layer: int, e: int) -> np.ndarray | None:
        if hasattr(self.base, "expert_bytes"):
            return self.base.expert_bytes(layer, e)
        ext = getattr(self.base, "_extents", {})
        cls = self.base._class(layer, e)
        return ext.get((layer, cls))

    def has_trunk(self, role: str, layer: int | None = None) -> bool:
        return self.base.has_trunk(role, layer)

    def trunk(self, role: str, layer: int | None = None) -> np.ndarray:
        return self.base.trunk(role, layer)

    def expert_extent(self, layer: int, router_byte: int) -> ExpertExtent:
        off = int(self.off[layer, router_byte])
        if off < 0:
            raise LookupError(f"layer {layer} has no routed expert {router_byte}")
        return ExpertExtent(0, off, self.info.expert_nbytes, int(self.sums[layer, router_byte]))

    def expert_fds(self) -> list[int]:
        """The one block file's descriptor (``ExpertExtent.block`` 0)."""
        return [self.fd]

    def read_expert(self, layer: int, router_byte: int, slot: np.ndarray) -> None:
        pread_expert(self.fd, self.path, self.expert_extent(layer, router_byte), slot)
        self.reads += 1

    def expert_views(self, slot: np.ndarray):
        return self.base.expert_views(slot)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
