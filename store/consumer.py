"""The consumer interface: the only way an inference engine reaches a model's bytes.

An engine (ours in ``inference``, or any other: a torch module, a C server)
needs four things from the store, and nothing else:

1. open a model version through a portal (``open_model``, implemented by the
   store; the portal must carry the ``infer`` right);
2. get trunk tensors by role and layer (``trunk``), resident for the run
   (or, where the engine opened the model with the store's optional
   ``lazy_trunk`` mode, per-layer tensors read and verified on each call, so
   an engine can hold only a window of layers: ``inference.trunkwindow``);
3. read experts ``(layer, router_byte)`` into caller-owned slots, verified:
   one at a time (``read_expert``), or asynchronously into an arena of slots
   through the store's one expert-read interface
   (:func:`czyx.store.io.experts.open_expert_reads`: ``submit`` / ``wait`` /
   ``check``, with the reader kinds behind it). ``expert_extent`` is the
   resolution both use (arithmetic on the layout; the portal's check);
4. release (``close``).

Role names are architecture-neutral (see ``TRUNK_ROLES``); the mapping from a
checkpoint's tensor names lives in ``czyx.store.models.archs``.

The expert extent format: the gate ``[I, H]``, up ``[I, H]`` and down ``[H, I]``
matrices, contiguous and row-major in that order, each in the format recorded
in the manifest (``ModelInfo.expert_format``); ``expert_views`` turns a filled
slot into the three arrays without copying.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

# Global roles (layer=None) and per-layer roles. Not every architecture has
# every role: ``ModelConsumer.has_trunk`` tells.
GLOBAL_ROLES = ("embed", "final_norm", "lm_head")
LAYER_ROLES = (
    "input_norm",  # [H]
    "post_attn_norm",  # [H]
    "q_proj",  # [n_heads * head_dim, H]
    "k_proj",  # [n_kv_heads * head_dim, H]
    "v_proj",  # [n_kv_heads * head_dim, H]
    "o_proj",  # [H, n_heads * head_dim]
    "q_bias",  # [n_heads * head_dim]          (Qwen2-MoE)
    "k_bias",  # [n_kv_heads * head_dim]       (Qwen2-MoE)
    "v_bias",  # [n_kv_heads * head_dim]       (Qwen2-MoE)
    "q_norm",  # [head_dim] (Qwen3-MoE) or [n_heads * head_dim] (OLMoE)
    "k_norm",  # [head_dim] (Qwen3-MoE) or [n_kv_heads * head_dim] (OLMoE)
    "router",  # [E, H]
    "shared_gate_proj",  # [I_shared, H]   (Qwen2-MoE shared expert)
    "shared_up_proj",  # [I_shared, H]
    "shared_down_proj",  # [H, I_shared]
    "shared_expert_gate",  # [1, H]        (Qwen2-MoE sigmoid gate of the shared expert)
    "mlp_gate_proj",  # dense MLP layers of models that mix dense and sparse layers
    "mlp_up_proj",
    "mlp_down_proj",
)
TRUNK_ROLES = GLOBAL_ROLES + LAYER_ROLES


@dataclass(frozen=True)
class ExpertExtent:
    """Where one expert's bytes are, as the store's expert reader needs them.

    ``block`` indexes the consumer's own block files (the descriptors it hands
    :class:`czyx.store.io.experts.ExpertReads`); ``-1``: no file behind the
    extent, it is read through the consumer's ``read_expert``. No OS resource
    travels in an extent.
    """

    block: int
    offset: int
    length: int
    checksum: int


@dataclass(frozen=True)
class ArchFacts:
    """The architecture facts of a config, normalised once (``czyx.store.models.archs``).

    Each family spells them differently in ``config.json`` (``num_experts`` or
    ``num_local_experts`` or ``n_routed_experts``; dense layers by
    ``mlp_only_layers`` / ``decoder_sparse_step`` or ``first_k_dense_replace``);
    the store's architecture table reads them at mount, and an engine reads
    them here rather than deriving them a second time.
    """

    n_layers: int
    n_experts: int
    hidden_size: int
    expert_intermediate: int
    sparse_layers: tuple[int, ...]


@dataclass(frozen=True)
class ModelInfo:
    """What an engine needs to know about a mounted model version."""

    arch: str  # "mixtral" | "qwen2_moe" | "qwen3_moe" | "olmoe" | ...
    config: dict[str, Any]  # the checkpoint's config.json
    n_layers: int
    n_experts: int
    expert_nbytes: int  # bytes of one expert extent (all experts of a model share it)
    expert_slot_nbytes: int  # expert_nbytes rounded up to the direct-I/O alignment
    expert_format: str  # "f32", "f16", "bf16", or a quantized format name
    selector: bytes  # the model version's 32-byte space selector

    @property
    def facts(self) -> ArchFacts:
        """The normalised architecture facts of :attr:`config` (the store's one derivation).

        Raises
        ------
        UnknownArchitectureError
            :attr:`arch` is not a family the store knows, or the config lacks a key.
        """
        from czyx.store.models.archs import arch_facts  # models/ builds on this module

        return arch_facts(self.arch, self.config)


@runtime_checkable
class ModelConsumer(Protocol):
    """A model version opened through a portal, as an engine sees it."""

    info: ModelInfo

    def has_trunk(self, role: str, layer: int | None = None) -> bool:
        """Whether the model has a tensor of ``role`` (at ``layer``)."""
        ...

    def trunk(self, role: str, layer: int | None = None) -> np.ndarray:
        """The tensor of ``role`` (at ``layer``), as float32: resident, or in a
        lazy-trunk consumer a per-layer tensor read and verified by this call."""
        ...

    def expert_extent(self, layer: int, router_byte: int) -> ExpertExtent:
        """Resolve ``(layer, router byte)`` to its extent: class permutation,
        then the layout's curve ordinal, then arithmetic. Raises the portal's
        denial error if the portal does not cover this class or layer."""
        ...

    def read_expert(self, layer: int, router_byte: int, slot: np.ndarray) -> None:
        """Read one expert's extent into ``slot`` (a uint8 view of
        ``expert_slot_nbytes``), verifying its checksum; raises on a short
        read or a mismatch, never returns other bytes."""
        ...

    def expert_views(self, slot: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Zero-copy ``(gate [I,H], up [I,H], down [H,I])`` views of a filled slot
        (for float formats); quantized formats return their packed views."""
        ...

    def close(self) -> None:
        """Release the model's files and its store handle (idempotent)."""
        ...


@runtime_checkable
class TieredConsumer(ModelConsumer, Protocol):
    """A consumer over two versions of one model whose experts each read at one of two
    precisions (:class:`~czyx.store.models.tiered.TieredModel`): an expert cache sizes
    its slots for the wider and keeps kernel views of each slot at either."""

    names: tuple[str, str]  # the two versions, high precision first
    formats: tuple[str, str]  # their expert formats
    strides: tuple[int, int]  # bytes an expert takes at each tier
    tier: np.ndarray  # int8 [n_layers, n_experts]: the tier each expert is read at

    def expert_views_at(
        self, slot: np.ndarray, tier: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``expert_views`` of a slot filled at ``tier``."""
        ...


def gate_up_down_views(
    slot: np.ndarray, nbytes: int, inter: int, hidden: int, dtype: Any = np.float32
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Zero-copy ``(gate [I,H], up [I,H], down [H,I])`` of a slot's first ``nbytes``.

    The ``expert_views`` of every consumer whose expert extent is the three float
    matrices back to back in that order (the synthetic and in-memory reference
    consumers); ``nbytes`` is the extent's length (``ModelInfo.expert_nbytes``).
    """
    i, h = inter, hidden
    f = slot[:nbytes].view(dtype)
    return (
        f[: i * h].reshape(i, h),
        f[i * h : 2 * i * h].reshape(i, h),
        f[2 * i * h :].reshape(h, i),
    )


# Optional extensions an engine may look for with ``getattr``:
#   open_expert_reads(slots, *, readers, native, io) -> store.io.experts.ExpertReads
#       the expert-read interface onto this consumer's block files (consumers
#       without files are read through ``read_expert`` behind the same calls:
#       ``czyx.store.io.experts.open_expert_reads`` does this lookup).
#   tokenizer_json() -> str | None
#       the checkpoint's tokenizer.json as mounted (None: the model has none,
#       use bytes). ``inference.tokenizer.tokenizer_for`` does this lookup.
#   trunk_layer_nbytes(layer) -> int
#       stored bytes of one layer's trunk tensors (what a trunk window reads
#       per layer); reads nothing.
