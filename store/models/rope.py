"""Rotary-embedding parameters of a checkpoint config, read and validated once.

Scope: parsing only (no arithmetic on frequencies). Mount calls
:func:`rope_params` so a rope scaling the engine cannot run is refused when
the checkpoint is mounted, not when it is first run; the engine
(``inference.models.rope``) builds its frequency tables from the very same
:class:`RopeParams`, so mount and run cannot disagree on what is supported.

Both spellings are read: transformers 5.x ``rope_parameters`` and the older
top-level ``rope_theta`` / ``rope_scaling`` (``type`` or ``rope_type``) /
``partial_rotary_factor``. Defaults follow transformers'
``standardize_rope_params`` and ``modeling_rope_utils`` (for example
``original_max_position_embeddings`` falls back to ``max_position_embeddings``
for ``yarn``/``llama3``/``longrope``, and a top-level
``original_max_position_embeddings`` wins, as Phi-3 writes it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from czyx.store.models.mount_errors import MountError

#: czyx's rope type of a model whose rotary frequencies are the default ones divided by
#: per-frequency factors held in its trunk (role ``rope_freqs``): llama.cpp's
#: ``rope_freqs.weight`` of a GGUF file, ``theta_i = pos * base^(-2i/d) / ff[i]`` (its
#: ``ggml_rope_ext`` freq_factors). The config names only the type; the factors stay the
#: file's tensor (export writes it back byte for byte) and the engine reads them from there.
FREQ_FACTORS = "freq_factors"
#: Rope types the engine implements (transformers' names, and czyx's :data:`FREQ_FACTORS`).
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope", FREQ_FACTORS)


class UnsupportedRopeError(MountError):
    """A rope type or rope parameter the engine does not implement (named in the message)."""


@dataclass(frozen=True)
class RopeParams:
    """Normalised rotary parameters (the fields each rope type reads; others keep defaults).

    ``rotary_dim`` is the number of leading channels of a head that rotate
    (``head_dim * partial_rotary_factor``). ``max_position`` is the config's
    ``max_position_embeddings`` (dynamic NTK and longrope read it).
    """

    rope_type: str
    theta: float
    rotary_dim: int
    max_position: int
    factor: float | None = None
    original_max: int | None = None
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    long_factor: tuple[float, ...] | None = None
    short_factor: tuple[float, ...] | None = None
    freq_factors: tuple[float, ...] | None = None  # FREQ_FACTORS: the trunk's, filled by the engine


def _num(params: Mapping[str, Any], key: str, rope_type: str) -> float:
    value = params.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UnsupportedRopeError(
            f"rope type {rope_type!r} needs a numeric {key!r}, got {value!r}"
        )
    return float(value)


def rope_params(config: Mapping[str, Any], head_dim: int) -> RopeParams:
    """Read and validate the rope conventions of ``config`` for heads of ``head_dim``.

    Parameters
    ----------
    config
        The checkpoint's ``config.json`` as a dict.
    head_dim
        The width of the head part that carries the rotary channels (DeepSeek's
        ``qk_rope_head_dim``; ``head_dim`` or ``hidden_size // heads`` otherwise).

    Raises
    ------
    UnsupportedRopeError
        An unknown rope type, per-layer-type rope parameters, a missing or
        non-numeric parameter the type needs, or a rotary width that is odd,
        empty or wider than the head.
    """
    params = dict(config.get("rope_parameters") or {})
    legacy = dict(config.get("rope_scaling") or {})
    if params and all(isinstance(v, Mapping) for v in params.values()):
        raise UnsupportedRopeError("per-layer-type rope_parameters are not supported")
    merged = {**legacy, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedRopeError(
            f"config rope type {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "dynamic" and merged.get("alpha"):
        raise UnsupportedRopeError("rope type 'dynamic' with 'alpha' (NTK-alpha) is not supported")
    theta = merged.get("rope_theta", config.get("rope_theta", 10000.0))
    partial = merged.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    rot = int(head_dim * float(partial))
    if rot <= 0 or rot % 2 or rot > head_dim:
        raise UnsupportedRopeError(
            f"config partial_rotary_factor={partial} gives rotary width {rot} for head_dim "
            f"{head_dim}; it must be even and within the head"
        )
    max_pos = int(config.get("max_position_embeddings") or 0)
    original = None
    if rope_type in ("yarn", "llama3", "longrope"):
        original = config.get("original_max_position_embeddings") or merged.get(
            "original_max_position_embeddings", max_pos
        )
        if not original:
            raise UnsupportedRopeError(
                f"rope type {rope_type!r} needs original_max_position_embeddings "
                "or max_position_embeddings"
            )
        original = int(original)
    factor = merged.get("factor")
    out: dict[str, Any] = dict(
        rope_type=rope_type,
        theta=_num({"rope_theta": theta}, "rope_theta", rope_type),
        rotary_dim=rot,
        max_position=max_pos,
        original_max=original,
    )
    if rope_type in ("linear", "dynamic", "llama3"):
        out["factor"] = _num(merged, "factor", rope_type)
    if rope_type == "dynamic" and not max_pos:
        raise UnsupportedRopeError("rope type 'dynamic' needs max_position_embeddings")
    if rope_type == "llama3":
        out["low_freq_factor"] = _num(merged, "low_freq_factor", rope_type)
        out["high_freq_factor"] = _num(merged, "high_freq_factor", rope_type)
        if out["low_freq_factor"] == out["high_freq_factor"]:
            raise UnsupportedRopeError("llama3 rope: low_freq_factor equals high_freq_factor")
    if rope_type in ("yarn", "longrope"):
        if factor is not None:
            out["factor"] = _num(merged, "factor", rope_type)
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            if merged.get(key) is not None:
                out[key] = _num(merged, key, rope_type)
    if rope_type == "yarn":
        if "factor" not in merged:
            raise UnsupportedRopeError("rope type 'yarn' needs a numeric 'factor'")
        out["beta_fast"] = float(merged.get("beta_fast") or 32.0)
        out["beta_slow"] = float(merged.get("beta_slow") or 1.0)
        out["truncate"] = bool(merged.get("truncate", True))
    if rope_type == "longrope":
        for key in ("long_factor", "short_factor"):
            vals = merged.get(key)
            if not isinstance(vals, (list, tuple)) or len(vals) != rot // 2:
                raise UnsupportedRopeError(
                    f"longrope {key} must list {rot // 2} numbers (rotary width {rot})"
                )
            out[key] = tuple(float(v) for v in vals)
    return RopeParams(**out)
