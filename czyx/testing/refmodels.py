"""Tiny transformers MoE models and an in-memory ModelConsumer over their weights.

Tests only. The consumer implements ``store.consumer.ModelConsumer`` from a
transformers model's state dict, naming tensors through the store's own
checkpoint mapping (``store.archs``: trunk roles, and the stacked
``experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` of transformers
5.x), packing each expert as the contract's extent (gate, up, down; f32; slot
rounded up to 4096 bytes). It counts reads so tests can see the cache at
work, and can apply a class permutation to prove the engine never assumes
identity. It needs no store directory, so the numerics are tested apart from
mounting (tests/inference/test_end_to_end.py covers the mounted path).
"""

from __future__ import annotations

import numpy as np
import torch

from czyx.store.consumer import ExpertExtent, ModelInfo, gate_up_down_views
from czyx.store.models.archs import arch_for_config

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def hf_greedy(model: torch.nn.Module, prompt: list[int] | np.ndarray, steps: int) -> list[int]:
    """transformers' greedy continuation of ``prompt``: exactly ``steps`` new token ids.

    The reference the engine's greedy generation is compared with in the tests.
    """
    ids = torch.as_tensor(np.asarray(prompt, dtype=np.int64))[None]
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0
        )
    return out[0, ids.shape[1] :].tolist()


def tiny_model(arch: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny fp32 model of ``arch`` with weights large enough for decisive logits."""
    import transformers as T

    common = dict(
        vocab_size=256,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        initializer_range=0.15,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        max_position_embeddings=512,
    )
    if arch == "mixtral":
        cfg = dict(common, num_local_experts=8, rope_theta=10000.0, sliding_window=9)
        cls, ccls = T.MixtralForCausalLM, T.MixtralConfig
    elif arch == "qwen2_moe":
        cfg = dict(
            common,
            num_hidden_layers=3,
            num_experts=8,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        )
        cls, ccls = T.Qwen2MoeForCausalLM, T.Qwen2MoeConfig
    elif arch == "qwen3_moe":
        cfg = dict(
            common, num_experts=8, moe_intermediate_size=24, head_dim=16, norm_topk_prob=True
        )
        cls, ccls = T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig
    elif arch == "olmoe":
        cfg = dict(common, num_experts=8, intermediate_size=24, norm_topk_prob=False, clip_qkv=8.0)
        cls, ccls = T.OlmoeForCausalLM, T.OlmoeConfig
    else:
        raise ValueError(arch)
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = cls(ccls(**cfg)).eval()
    # Norm weights start at 1.0; jitter them so a swapped or skipped norm is visible.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.mul_(1.0 + 0.2 * torch.randn_like(p))
    return model


class StateDictConsumer:
    """A ``ModelConsumer`` over an in-memory transformers model (tests only).

    Parameters
    ----------
    model
        A transformers MoE causal LM.
    permutation
        Optional per-layer ``[E]`` arrays: router byte ``b`` of layer ``l`` is
        stored at class ``permutation[l][b]`` (as a mount with a learned
        class order would do).
    """

    def __init__(self, model: torch.nn.Module, permutation: list[np.ndarray] | None = None):
        cfg = model.config
        config = cfg.to_dict()
        spec = arch_for_config(config)
        self.sd: dict[tuple[str, int | None], np.ndarray] = {}
        fused: dict[tuple[int, str], np.ndarray] = {}
        for name, tensor in model.state_dict().items():
            kind = spec.classify(name)
            if kind is None:
                raise ValueError(f"{spec.name}: tensor {name!r} has no role in store.archs")
            arr = tensor.detach().float().numpy()
            if kind.kind == "trunk":
                self.sd[(kind.role, kind.layer)] = arr
            elif kind.kind == "fused":
                fused[(kind.layer, kind.part)] = arr
            else:  # per-expert tensors: in-memory transformers 5.x models are fused
                raise ValueError(f"unexpected per-expert tensor {name!r} in a 5.x state dict")
        n_layers = spec.n_layers(config)
        n_experts = spec.n_experts(config)
        # Experts as contract extents, stored by class (after the permutation).
        self._extents: dict[tuple[int, int], np.ndarray] = {}
        nbytes = 0
        for layer in spec.sparse_layers(config):
            gu, dn = fused[(layer, "gate_up")], fused[(layer, "down")]
            for e in range(n_experts):
                cls_ = int(permutation[layer][e]) if permutation is not None else e
                blob = np.concatenate([gu[e].ravel(), dn[e].ravel()]).astype(np.float32)
                self._extents[(layer, cls_)] = blob.view(np.uint8)
                nbytes = blob.nbytes
            self._inter, self._hidden = gu.shape[1] // 2, gu.shape[2]
        self.permutation = permutation
        slot = -(-nbytes // 4096) * 4096
        self.info = ModelInfo(
            arch=spec.name,
            config=config,
            n_layers=n_layers,
            n_experts=n_experts,
            expert_nbytes=nbytes,
            expert_slot_nbytes=slot,
            expert_format="f32",
            selector=b"\x00" * 32,
        )
        self.reads: list[tuple[int, int]] = []
        self.closed = False

    def has_trunk(self, role: str, layer: int | None = None) -> bool:
        return (role, layer) in self.sd

    def trunk(self, role: str, layer: int | None = None) -> np.ndarray:
        return self.sd[(role, layer)]

    def _class(self, layer: int, router_byte: int) -> int:
        if self.permutation is None:
            return router_byte
        return int(self.permutation[layer][router_byte])

    def expert_extent(self, layer: int, router_byte: int) -> ExpertExtent:
        return ExpertExtent(block=-1, offset=0, length=self.info.expert_nbytes, checksum=0)

    def read_expert(self, layer: int, router_byte: int, slot: np.ndarray) -> None:
        if slot.dtype != np.uint8 or slot.size != self.info.expert_slot_nbytes:
            raise ValueError(f"slot must be uint8[{self.info.expert_slot_nbytes}]")
        src = self._extents[(layer, self._class(layer, router_byte))]
        slot[: src.size] = src
        self.reads.append((layer, router_byte))

    def expert_views(self, slot: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        i, h = self._inter, self._hidden
        return gate_up_down_views(slot, self.info.expert_nbytes, i, h, np.float32)

    def close(self) -> None:
        self.closed = True
