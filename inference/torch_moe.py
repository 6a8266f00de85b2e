"""A second, minimal consumer of the store's interface: one MoE layer as a torch module.

Scope: proof that another engine plugs into the same store. It uses only
:class:`czyx.store.consumer.ModelConsumer` (``trunk`` for the router,
``expert_views`` for a filled slot) and the store's one expert-read
interface (:func:`czyx.store.io.experts.open_expert_reads`: ``submit`` /
``wait`` / ``check``, the same reads the numpy engine's planner makes), keeps
no cache, and computes the routed-expert output of one layer with torch ops:
while one expert computes, the next one's read is in flight. torch is
imported here only; the numpy engine never needs it.
"""

from __future__ import annotations

import numpy as np
import torch

from czyx.store.consumer import ModelConsumer
from czyx.store.io.experts import ExpertReads, open_expert_reads
from czyx.store.io.reader import aligned_empty


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
    readers, native
        The store's reader threads and kind (see ``ExpertReads``).
    """

    def __init__(
        self,
        consumer: ModelConsumer,
        layer: int,
        top_k: int,
        renormalize: bool,
        *,
        readers: int = 1,
        native: bool | None = None,
    ) -> None:
        super().__init__()
        self.consumer = consumer
        self.layer = layer
        self.top_k = top_k
        self.renormalize = renormalize
        self.router = torch.from_numpy(np.array(consumer.trunk("router", layer), np.float32))
        # Two slots: one expert computes while the next one is read.
        arena = aligned_empty(2 * consumer.info.expert_slot_nbytes)  # for direct I/O too
        self.slots = list(arena.reshape(2, -1))
        self.expert_reads: ExpertReads = open_expert_reads(
            consumer, self.slots, readers=readers, native=native
        )
        self.reads = 0

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` (post-attention-norm hidden states) -> routed output ``[T, H]``."""
        probs = torch.softmax(x @ self.router.T, dim=-1)
        weights, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        experts = torch.unique(idx).tolist()
        er = self.expert_reads
        pending = er.submit(self.layer, experts[0], 0) if experts else None
        for i, e in enumerate(experts):
            read = pending
            er.wait(read)
            er.check(read)  # verified bytes or a typed error, never other bytes
            self.reads += 1
            if i + 1 < len(experts):  # the next read overlaps this expert's compute
                pending = er.submit(self.layer, experts[i + 1], (i + 1) % 2)
            slot = self.slots[read.slot]
            gate, up, down = (torch.from_numpy(v) for v in self.consumer.expert_views(slot))
            rows, kpos = torch.where(idx == e)
            xs = x[rows]
            y = (torch.nn.functional.silu(xs @ gate.T) * (xs @ up.T)) @ down.T
            out.index_add_(0, rows, y * weights[rows, kpos, None])
        return out

    def close(self) -> None:
        """Stop the store's readers for this layer (idempotent)."""
        self.expert_reads.close()
