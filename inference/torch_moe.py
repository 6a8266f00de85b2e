"""A second, minimal consumer of the store's interface: one MoE layer as a torch module.

Scope: proof that another engine plugs into the same store. It uses only
:class:`store.consumer.ModelConsumer` (``trunk`` for the router,
``read_expert`` + ``expert_views`` for each routed expert it needs), keeps no
cache, and computes the routed-expert output of one layer with torch ops.
torch is imported here only; the numpy engine never needs it.
"""

from __future__ import annotations

import numpy as np
import torch

from czyx.store.consumer import ModelConsumer


class TorchMoELayer(torch.nn.Module):
    """The routed experts of ``layer`` (softmax top-k, optional renormalisation).

    Parameters
    ----------
    consumer
        An opened model version.
    layer
        The sparse layer to compute.
    top_k, renormalize
        Routing parameters (from the model config).
    """

    def __init__(self, consumer: ModelConsumer, layer: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.consumer = consumer
        self.layer = layer
        self.top_k = top_k
        self.renormalize = renormalize
        self.router = torch.from_numpy(np.array(consumer.trunk("router", layer), np.float32))
        # One slot is enough: this consumer reads each expert it needs, uses it, moves on.
        self.slot = np.zeros(consumer.info.expert_slot_nbytes, np.uint8)
        self.reads = 0

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` (post-attention-norm hidden states) -> routed output ``[T, H]``."""
        probs = torch.softmax(x @ self.router.T, dim=-1)
        weights, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in torch.unique(idx).tolist():
            self.consumer.read_expert(self.layer, e, self.slot)
            self.reads += 1
            gate, up, down = (torch.from_numpy(v) for v in self.consumer.expert_views(self.slot))
            rows, kpos = torch.where(idx == e)
            xs = x[rows]
            y = (torch.nn.functional.silu(xs @ gate.T) * (xs @ up.T)) @ down.T
            out.index_add_(0, rows, y * weights[rows, kpos, None])
        return out
