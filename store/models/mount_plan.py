"""Plan a mount: which checkpoint bytes become which trunk tensor or expert extent.

Scope: pure validation and bookkeeping over a :class:`store.checkpoint.Checkpoint`
and its :class:`store.archs.ArchSpec`; no store I/O. The plan says, for every
routed expert ``(layer, expert)``, the three contiguous byte ranges of its
gate ``[I, H]``, up ``[I, H]`` and down ``[H, I]`` matrices (a per-expert
tensor, or a row block of a fused ``[E, 2I, H]`` / ``[E, H, I]`` tensor: both
are contiguous because the expert index is the outermost axis), and for every
other tensor its trunk ``(role, layer)``. A tensor the table does not know, an
expert index beyond the config, a missing or duplicated expert part, a wrong
shape or a mixed dtype is refused here, before anything is written.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from czyx.expert_key import MAX_EXPERTS
from czyx.store.models.archs import MTP_ROLE, ArchSpec, TensorKind, arch_for_config
from czyx.store.models.checkpoint import DTYPES, FORMAT_OF_DTYPE, Checkpoint
from czyx.store.models.mount_errors import (
    ConfigError,
    MissingTensorError,
    ShapeMismatchError,
    UnexpectedTensorError,
)
from czyx.store.models.rope import FREQ_FACTORS, RopeParams, rope_params


@dataclass(frozen=True)
class PartSource:
    """One expert matrix: ``nbytes`` bytes at ``start`` inside tensor ``tensor``."""

    tensor: str
    start: int
    nbytes: int
    shape: tuple[int, int]


@dataclass(frozen=True)
class TrunkEntry:
    """A load-bearing tensor: its checkpoint name, role and layer (None: global)."""

    tensor: str
    role: str
    layer: int | None


@dataclass(frozen=True)
class ModelPlan:
    """Everything mount needs to know before writing, validated.

    ``experts`` maps ``(layer, expert)`` to ``(gate, up, down)`` sources;
    ``expert_layout`` is ``"per_expert"`` or ``"fused"`` (as the source had it,
    so export can write it back the same way).
    """

    arch: str
    config: dict[str, Any]
    n_layers: int
    n_experts: int
    hidden: int
    inter: int
    sparse_layers: tuple[int, ...]
    dtype: str
    expert_layout: str
    trunk: tuple[TrunkEntry, ...]
    experts: dict[tuple[int, int], tuple[PartSource, PartSource, PartSource]]
    # Source layout of stacked experts when it is not the contract's (see
    # store.models.expert_transform): each expert is then two parts, its
    # [H, 2I] and [I, H] blocks, rearranged on assembly.
    expert_transform: str | None = None

    @property
    def expert_format(self) -> str:
        """Short format name of the expert bytes (``f32``/``f16``/``bf16``)."""
        return FORMAT_OF_DTYPE[self.dtype]

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one expert extent: gate, up and down back to back."""
        return 3 * self.inter * self.hidden * DTYPES[self.dtype][1]


# Integer config fields: (least, greatest) a model can have. The upper bounds are far
# above any released model, and exist so a lying config cannot make the engine
# allocate per layer, per head or per position without limit.
CONFIG_INTS: dict[str, tuple[int, int]] = {
    "num_hidden_layers": (1, 1024),
    "hidden_size": (1, 1 << 17),
    "intermediate_size": (1, 1 << 20),
    "moe_intermediate_size": (1, 1 << 20),
    "shared_expert_intermediate_size": (0, 1 << 20),
    "num_attention_heads": (1, 4096),
    "num_key_value_heads": (1, 4096),
    "head_dim": (1, 4096),
    "qk_head_dim": (1, 4096),
    "v_head_dim": (1, 4096),
    "qk_rope_head_dim": (0, 4096),
    "qk_nope_head_dim": (0, 4096),
    "kv_lora_rank": (1, 1 << 16),
    "q_lora_rank": (1, 1 << 16),
    "vocab_size": (1, 1 << 23),
    "max_position_embeddings": (1, 1 << 24),
    "num_experts_per_tok": (1, 256),
    "num_local_experts": (1, MAX_EXPERTS),
    "num_experts": (1, MAX_EXPERTS),
    "n_routed_experts": (1, MAX_EXPERTS),
    "n_shared_experts": (0, 256),
    "n_group": (1, 256),
    "topk_group": (1, 256),
    "first_k_dense_replace": (0, 1024),
    "moe_layer_freq": (1, 1024),
    "decoder_sparse_step": (1, 1024),
    "full_attention_interval": (1, 1024),
    "linear_conv_kernel_dim": (1, 64),
    "linear_key_head_dim": (1, 4096),
    "linear_value_head_dim": (1, 4096),
    "linear_num_key_heads": (1, 4096),
    "linear_num_value_heads": (1, 4096),
    "mamba_d_state": (1, 4096),
    "mamba_d_conv": (1, 64),
    "mamba_expand": (1, 64),
    "attn_layer_period": (1, 1024),
    "attn_layer_offset": (0, 1023),
    "expert_layer_period": (1, 1024),
    "expert_layer_offset": (0, 1023),
}

# Float fields: (exclusive least, greatest); all must be finite.
CONFIG_FLOATS: dict[str, tuple[float, float]] = {
    "rms_norm_eps": (0.0, 1.0),
    "rope_theta": (0.0, 1e12),
    "routed_scaling_factor": (0.0, 1e6),
}


def validate_config(config: Mapping[str, Any], n_experts: int | None = None) -> None:
    """Refuse a config whose values a model cannot have, with one clear line.

    Checks the types and bounds of :data:`CONFIG_INTS` and :data:`CONFIG_FLOATS`
    (a field may be absent, or ``None`` where transformers allows it), the
    ``rope_theta`` inside ``rope_parameters``, and the relations between fields
    (experts per token at most the experts, heads a multiple of the KV heads,
    ``mlp_only_layers`` inside the layers). Run at mount and again when a
    version is opened, so a config can never reach the engine unchecked.

    Raises
    ------
    ConfigError
    """
    if not isinstance(config, Mapping):
        raise ConfigError(f"config: expected a JSON object, got {type(config).__name__}")
    for key, (lo, hi) in CONFIG_INTS.items():
        v = config.get(key)
        if v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool):
            raise ConfigError(f"config: {key}={v!r:.60} is not an integer")
        if not lo <= v <= hi:
            raise ConfigError(f"config: {key}={v} outside [{lo}, {hi}]")
    floats = {k: config.get(k) for k in CONFIG_FLOATS}
    rope = config.get("rope_parameters")
    if rope is not None:
        if not isinstance(rope, Mapping):
            raise ConfigError(f"config: rope_parameters={rope!r:.60} is not an object")
        if rope.get("rope_theta") is not None:
            floats["rope_theta"] = rope["rope_theta"]
        if config.get("rope_theta") is not None:
            floats["rope_theta (top level)"] = config["rope_theta"]
    for key, v in floats.items():
        if v is None:
            continue
        lo, hi = CONFIG_FLOATS[key.split(" ")[0]]
        if not isinstance(v, int | float) or isinstance(v, bool):
            raise ConfigError(f"config: {key}={v!r:.60} is not a number")
        if not (math.isfinite(v) and lo < v <= hi):
            raise ConfigError(f"config: {key}={v} outside ({lo}, {hi}]")
    k = config.get("num_experts_per_tok")
    if n_experts is not None and k is not None and k > n_experts:
        raise ConfigError(f"config: num_experts_per_tok={k} > {n_experts} routed experts")
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if heads is not None and kv is not None and heads % kv:
        raise ConfigError(
            f"config: num_attention_heads={heads} not a multiple of num_key_value_heads={kv}"
        )
    ng, tg = config.get("n_group"), config.get("topk_group")
    if ng is not None and tg is not None and tg > ng:
        raise ConfigError(f"config: topk_group={tg} > n_group={ng}")
    lk, lv = config.get("linear_num_key_heads"), config.get("linear_num_value_heads")
    if lk is not None and lv is not None and lv % lk:
        raise ConfigError(
            f"config: linear_num_value_heads={lv} not a multiple of linear_num_key_heads={lk}"
        )
    types = config.get("layer_types")
    if types is not None:
        n = config.get("num_hidden_layers") or 0
        if (
            not isinstance(types, list)
            or len(types) != n
            or not all(isinstance(t, str) for t in types)
        ):
            raise ConfigError(f"config: layer_types={types!r:.60} is not {n} layer names")
    dense = config.get("mlp_only_layers")
    if dense is not None:
        n = config.get("num_hidden_layers") or 0
        if not isinstance(dense, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x < n for x in dense
        ):
            raise ConfigError(f"config: mlp_only_layers={dense!r:.60} is not layers below {n}")


def plan_checkpoint(ckpt: Checkpoint, *, partial: bool = False) -> ModelPlan:
    """Classify and validate every tensor of ``ckpt``.

    Parameters
    ----------
    ckpt
        The opened checkpoint.
    partial
        An adapter checkpoint: only the tensors it replaces are present, so
        completeness across layers/experts is not required (each expert it
        does carry must still be whole).

    Raises
    ------
    UnknownArchitectureError, UnexpectedTensorError, MissingTensorError,
    ShapeMismatchError
    """
    spec = arch_for_config(ckpt.config)
    cfg = ckpt.config
    validate_config(cfg)
    n_layers, n_experts = spec.n_layers(cfg), spec.n_experts(cfg)
    validate_config(cfg, n_experts)
    hidden, inter = spec.hidden_size(cfg), spec.expert_intermediate(cfg)
    sparse = spec.sparse_layers(cfg)
    rope = rope_params(cfg, spec.rope_head_dim(cfg))  # an unsupported rope is refused here
    trunk: list[TrunkEntry] = []
    seen_roles: dict[tuple[str, int | None], str] = {}
    per_expert: dict[tuple[int, int], dict[str, str]] = {}
    fused: dict[int, dict[str, str]] = {}
    kept: list[str] = []  # multi-token-prediction layers: kept verbatim, never run
    for name in ckpt.names():
        if spec.mtp_layer(name, cfg) is not None:
            kept.append(name)
            continue
        kind = spec.classify(name)
        file = str(ckpt.info(name).file)
        if kind is None:
            raise UnexpectedTensorError(
                f"not a tensor of a {spec.name} checkpoint", file=file, tensor=name
            )
        if kind.layer is not None and kind.layer >= n_layers:
            raise UnexpectedTensorError(
                f"layer {kind.layer} >= num_hidden_layers {n_layers}"
                + (
                    " (beyond its num_nextn_predict_layers multi-token-prediction layers)"
                    if cfg.get("num_nextn_predict_layers")
                    else ""
                ),
                file=file,
                tensor=name,
            )
        if kind.kind == "trunk":
            _add_trunk(kind, name, file, seen_roles, trunk)
            continue
        if kind.layer not in sparse:
            raise UnexpectedTensorError(
                f"routed expert tensor in dense layer {kind.layer}", file=file, tensor=name
            )
        if kind.kind == "expert":
            if kind.expert >= n_experts:
                raise UnexpectedTensorError(
                    f"expert {kind.expert} >= configured {n_experts}", file=file, tensor=name
                )
            parts = per_expert.setdefault((kind.layer, kind.expert), {})
        else:
            parts = fused.setdefault(kind.layer, {})
        if kind.part in parts:
            raise UnexpectedTensorError(f"duplicates {parts[kind.part]!r}", file=file, tensor=name)
        parts[kind.part] = name

    if not partial:
        _check_rope_freqs(ckpt, rope, seen_roles)
    # Each kept tensor is a trunk record of role "mtp" at its index in name order.
    trunk += [TrunkEntry(name, MTP_ROLE, i) for i, name in enumerate(sorted(kept))]
    experts: dict[tuple[int, int], tuple[PartSource, PartSource, PartSource]] = {}
    dtypes: set[str] = set()
    layers_per = {layer for layer, _ in per_expert}
    if layers_per & set(fused):
        layer = min(layers_per & set(fused))
        raise UnexpectedTensorError(
            f"layer {layer} has both per-expert and fused experts", file=str(ckpt.path)
        )
    for (layer, e), parts in sorted(per_expert.items()):
        experts[(layer, e)] = _per_expert_sources(ckpt, layer, e, parts, hidden, inter, dtypes)
    for layer, parts in sorted(fused.items()):
        fused_sources = _transposed_sources if spec.expert_transform else _fused_sources
        for e, src in enumerate(
            fused_sources(ckpt, layer, parts, n_experts, hidden, inter, dtypes)
        ):
            experts[(layer, e)] = src
    if len(dtypes) > 1:
        raise ShapeMismatchError(f"routed experts mix dtypes {sorted(dtypes)}", file=str(ckpt.path))
    dtype = dtypes.pop() if dtypes else "F32"
    if dtype not in FORMAT_OF_DTYPE:
        raise ShapeMismatchError(f"expert dtype {dtype} is not a float format", file=str(ckpt.path))
    if not partial:
        _check_complete(ckpt, spec, experts, seen_roles, sparse, n_layers, n_experts)
    layout = "fused" if fused else "per_expert"
    return ModelPlan(
        spec.name,
        dict(cfg),
        n_layers,
        n_experts,
        hidden,
        inter,
        sparse,
        dtype,
        layout,
        tuple(trunk),
        experts,
        spec.expert_transform,
    )


def _check_rope_freqs(
    ckpt: Checkpoint, rope: RopeParams, seen_roles: dict[tuple[str, int | None], str]
) -> None:
    """A ``rope_freqs`` tensor (a GGUF's rope factors) exactly where the rope type
    :data:`~czyx.store.models.rope.FREQ_FACTORS` reads it, one per rotary frequency."""
    name = seen_roles.get(("rope_freqs", None))
    if (rope.rope_type == FREQ_FACTORS) != (name is not None):
        raise MissingTensorError(
            f"rope type {rope.rope_type!r} with{'out' if name is None else ''} a rope_freqs "
            f"tensor (only {FREQ_FACTORS!r} reads one)",
            file=str(ckpt.path),
        )
    if name is not None and tuple(ckpt.info(name).shape) != (rope.rotary_dim // 2,):
        raise ShapeMismatchError(
            f"shape {tuple(ckpt.info(name).shape)}, not ({rope.rotary_dim // 2},): one factor "
            f"per frequency of rotary width {rope.rotary_dim}",
            file=str(ckpt.info(name).file),
            tensor=name,
        )


def _add_trunk(
    kind: TensorKind,
    name: str,
    file: str,
    seen: dict[tuple[str, int | None], str],
    trunk: list[TrunkEntry],
) -> None:
    key = (kind.role, kind.layer)
    if key in seen:
        raise UnexpectedTensorError(
            f"role {kind.role} of layer {kind.layer} is already {seen[key]!r}",
            file=file,
            tensor=name,
        )
    seen[key] = name
    trunk.append(TrunkEntry(name, kind.role, kind.layer))


def _check_shape(ckpt: Checkpoint, name: str, want: tuple[int, ...], dtypes: set[str]) -> int:
    info = ckpt.info(name)
    if info.shape != want:
        raise ShapeMismatchError(
            f"shape {list(info.shape)}, config implies {list(want)}",
            file=str(info.file),
            tensor=name,
        )
    dtypes.add(info.dtype)
    return DTYPES[info.dtype][1]


def _per_expert_sources(
    ckpt: Checkpoint,
    layer: int,
    e: int,
    parts: dict[str, str],
    hidden: int,
    inter: int,
    dtypes: set[str],
) -> tuple[PartSource, PartSource, PartSource]:
    out = []
    for part in ("gate", "up", "down"):
        if part not in parts:
            other = next(iter(parts.values()))
            raise MissingTensorError(
                f"expert {e} of layer {layer} has no {part} matrix",
                file=str(ckpt.info(other).file),
                tensor=other,
            )
        shape = (hidden, inter) if part == "down" else (inter, hidden)
        size = _check_shape(ckpt, parts[part], shape, dtypes)
        out.append(PartSource(parts[part], 0, inter * hidden * size, shape))
    return out[0], out[1], out[2]


def _gate_up_down(
    ckpt: Checkpoint, layer: int, parts: dict[str, str], kind: str
) -> tuple[str, str]:
    """The ``gate_up`` and ``down`` tensor names of a layer's stacked experts (or refused)."""
    for part in ("gate_up", "down"):
        if part not in parts:
            other = next(iter(parts.values()))
            raise MissingTensorError(
                f"{kind} experts of layer {layer} lack {part}_proj",
                file=str(ckpt.info(other).file),
                tensor=other,
            )
    return parts["gate_up"], parts["down"]


def _fused_sources(
    ckpt: Checkpoint,
    layer: int,
    parts: dict[str, str],
    n_experts: int,
    hidden: int,
    inter: int,
    dtypes: set[str],
) -> list[tuple[PartSource, PartSource, PartSource]]:
    gu, dn = _gate_up_down(ckpt, layer, parts, "fused")
    size = _check_shape(ckpt, gu, (n_experts, 2 * inter, hidden), dtypes)
    _check_shape(ckpt, dn, (n_experts, hidden, inter), dtypes)
    m = inter * hidden * size  # bytes of one [I, H] matrix
    return [
        (
            PartSource(gu, e * 2 * m, m, (inter, hidden)),
            PartSource(gu, e * 2 * m + m, m, (inter, hidden)),
            PartSource(dn, e * m, m, (hidden, inter)),
        )
        for e in range(n_experts)
    ]


def _transposed_sources(
    ckpt: Checkpoint,
    layer: int,
    parts: dict[str, str],
    n_experts: int,
    hidden: int,
    inter: int,
    dtypes: set[str],
) -> list[tuple[PartSource, PartSource]]:
    """GPT-OSS: ``gate_up [E, H, 2I]`` (interleaved) and ``down [E, I, H]``, two blocks each."""
    gu, dn = _gate_up_down(ckpt, layer, parts, "stacked")
    size = _check_shape(ckpt, gu, (n_experts, hidden, 2 * inter), dtypes)
    _check_shape(ckpt, dn, (n_experts, inter, hidden), dtypes)
    m = inter * hidden * size
    return [
        (
            PartSource(gu, e * 2 * m, 2 * m, (hidden, 2 * inter)),
            PartSource(dn, e * m, m, (inter, hidden)),
        )
        for e in range(n_experts)
    ]


def _check_complete(
    ckpt: Checkpoint,
    spec: ArchSpec,
    experts: dict,
    roles: dict,
    sparse: tuple[int, ...],
    n_layers: int,
    n_experts: int,
) -> None:
    have = np.zeros((n_layers, n_experts), bool)
    for layer, e in experts:
        have[layer, e] = True
    for layer in sparse:
        missing = np.flatnonzero(~have[layer])
        if missing.size:
            raise MissingTensorError(
                f"layer {layer} lacks routed experts {missing.tolist()[:8]} "
                f"(config: {n_experts} experts)",
                file=str(ckpt.path),
            )
    required = [("embed", None), ("final_norm", None)]
    if not ckpt.config.get("tie_word_embeddings"):
        required.append(("lm_head", None))
    for layer in range(n_layers):
        required += [("input_norm", layer), ("post_attn_norm", layer), ("o_proj", layer)]
        if layer in sparse:
            required.append(("router", layer))
    for role, layer in required:
        if (role, layer) not in roles:
            raise MissingTensorError(
                f"{spec.name} checkpoint lacks trunk role {role}"
                + ("" if layer is None else f" of layer {layer}"),
                file=str(ckpt.path),
            )
