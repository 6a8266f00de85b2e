"""The shared part of hybrid decoders: attention layers beside recurrent (linear) ones.

Scope: what Qwen3-Next (gated DeltaNet) and Jamba (Mamba) do alike. A hybrid
model names each layer's mixer, keeps KV for its attention layers only and a
fixed-size state per recurrent layer (:class:`~inference.models.deltanet.HybridCache`),
and loads the recurrent layers' own roles in place of attention's. A subclass
sets ``dims`` (its conv and state shapes) and calls :meth:`_place` with the
attention and recurrent layer indices before the base constructor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from czyx.inference.models.decoder import MoEDecoder
from czyx.inference.models.deltanet import HybridCache


class HybridDecoder(MoEDecoder):
    """A :class:`MoEDecoder` whose layers are attention or recurrent mixers."""

    dims: Any  # DeltaNetDims or MambaDims: conv_shape and state_shape of a recurrent layer

    def _place(self, attention: Sequence[int], recurrent: Sequence[int]) -> None:
        """Give each layer its slot: its KV slot (attention) or its state slot (recurrent)."""
        self.slot = {i: j for j, i in enumerate(attention)} | {
            i: j for j, i in enumerate(recurrent)
        }
        self.n_full, self.n_linear = len(attention), len(recurrent)

    def _mixer_roles(self, i: int) -> tuple[str, ...]:
        """Layer ``i``'s token-mixer roles (attention's or its recurrent layer's)."""
        raise NotImplementedError

    def _roles(self, i: int) -> tuple[str, ...]:
        return (
            self.required_roles
            + self._mixer_roles(i)
            + (self.sparse_roles if self.cfg.sparse_layers[i] else self.dense_roles)
        )

    @property
    def kv_layers(self) -> int:
        """Layers that keep keys and values (the attention layers)."""
        return self.n_full

    @property
    def recurrent_nbytes(self) -> int:
        """Bytes of one sequence's recurrent state (constant in its length)."""
        d = self.dims
        return 4 * self.n_linear * (math.prod(d.conv_shape) + math.prod(d.state_shape))

    def new_kv(self, capacity: int = 64) -> HybridCache:
        """An empty hybrid cache: KV of the attention layers, state of the recurrent ones."""
        cfg = self.cfg
        return HybridCache(
            self.n_full, cfg.n_kv_heads, cfg.head_dim, self.n_linear, self.dims, capacity
        )
