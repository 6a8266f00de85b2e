"""A synthetic ModelConsumer for cache tests: every expert's bytes name their owner.

Tests only. Expert ``(layer, e)`` is a float32 extent whose every value is
``layer * 1000 + e``, so a slot's contents say which expert it holds; reads
are counted, and a chosen pair can be made to fail like a bad block.
"""

from __future__ import annotations

import numpy as np

from czyx.store.consumer import ExpertExtent, ModelInfo


class FakeConsumer:
    """``ModelConsumer`` with ``n_layers x n_experts`` tiny experts (I=H=8) and no trunk."""

    def __init__(self, n_layers: int = 3, n_experts: int = 8, fail: tuple[int, int] | None = None):
        self.h = self.i = 8
        nbytes = 3 * self.h * self.i * 4
        self.info = ModelInfo(
            arch="fake",
            config={},
            n_layers=n_layers,
            n_experts=n_experts,
            expert_nbytes=nbytes,
            expert_slot_nbytes=4096,
            expert_format="f32",
            selector=b"\x01" * 32,
        )
        self.fail = fail
        self.reads: list[tuple[int, int]] = []

    def has_trunk(self, role: str, layer: int | None = None) -> bool:
        return False

    def trunk(self, role: str, layer: int | None = None) -> np.ndarray:
        raise KeyError(role)

    def expert_extent(self, layer: int, router_byte: int) -> ExpertExtent:
        return ExpertExtent(-1, 0, self.info.expert_nbytes, 0)

    def read_expert(self, layer: int, router_byte: int, slot: np.ndarray) -> None:
        if self.fail == (layer, router_byte):
            raise OSError(f"short read of layer {layer} expert {router_byte}")
        slot[: self.info.expert_nbytes].view(np.float32)[:] = layer * 1000 + router_byte
        self.reads.append((layer, router_byte))

    def expert_views(self, slot: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n = self.h * self.i
        f = slot[: self.info.expert_nbytes].view(np.float32)
        return f[:n].reshape(8, 8), f[n : 2 * n].reshape(8, 8), f[2 * n :].reshape(8, 8)

    def close(self) -> None:
        pass


def owner_value(cache, slot: int) -> float:
    """The ``layer * 1000 + expert`` value stored in a slot."""
    return float(cache.slot_bytes(slot)[:4].view(np.float32)[0])
