"""Rotary embeddings with transformers' rope scalings: linear, dynamic NTK, YaRN, Llama-3, LongRoPE;
and llama.cpp's stored frequency factors.

Scope: inverse frequencies and their attention scaling, computed from the
store's validated :class:`~czyx.store.models.rope.RopeParams` with the same
float32 operations, in the same order, as transformers'
``modeling_rope_utils`` (``ROPE_INIT_FUNCTIONS``), so the cos/sin tables
match theirs to float32 rounding; and the two position-dependent behaviours
transformers' ``dynamic_rope_update`` adds at run time:

* ``dynamic``: when a forward pass reaches beyond every length seen so far
  (and beyond ``max_position_embeddings``) the frequencies are recomputed for
  that length; back below the original length they reset. Like transformers
  (whose rotary module holds this state), the state is the decoder's, and
  keys already in the KV cache keep the rotation they were stored with.
* ``longrope``: each forward pass uses the long factors when its last
  position is past ``original_max_position_embeddings``, the short ones
  otherwise.

YaRN and LongRoPE scale cos and sin by their attention factor (transformers
multiplies it into both, so attention scores scale by its square).

``freq_factors`` (:data:`~czyx.store.models.rope.FREQ_FACTORS`) is a GGUF file's
``rope_freqs``: the default inverse frequencies divided by per-frequency factors,
as llama.cpp's rope applies them (``theta_i = pos * base^(-2i/d) / ff[i]``). The
factors are a trunk tensor, not config: a rope type here, fed by the decoder with
the stored tensor (:func:`with_freq_factors`), so the file's own values run (the
llama3 parameters they came from are not in the file) and nothing is recomputed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from czyx.inference.errors import UnsupportedModelError
from czyx.inference.models.base import RopeConfig as BaseRopeConfig
from czyx.inference.models.base import Rotary as BaseRotary
from czyx.store.models.rope import FREQ_FACTORS, RopeParams, UnsupportedRopeError, rope_params

F32 = np.float32


@dataclass(frozen=True)
class RopeConfig(BaseRopeConfig):
    """A :class:`~czyx.inference.models.base.RopeConfig` with the full parameters of its type."""

    params: RopeParams | None = None


def rope_config(config: dict, head_dim: int) -> RopeConfig:
    """Read the rope conventions of ``config`` (every type in ``SUPPORTED_ROPE_TYPES``).

    Raises
    ------
    UnsupportedModelError
        For what :func:`czyx.store.models.rope.rope_params` refuses (mount refuses it first).
    """
    try:
        p = rope_params(config, head_dim)
    except UnsupportedRopeError as exc:
        raise UnsupportedModelError(str(exc)) from None
    linear = p.factor if p.rope_type == "linear" and p.factor else 1.0
    return RopeConfig(theta=p.theta, rotary_dim=p.rotary_dim, linear_factor=linear, params=p)


def with_freq_factors(rope: RopeConfig, factors: np.ndarray) -> RopeConfig:
    """``rope`` (of type :data:`~czyx.store.models.rope.FREQ_FACTORS`) with its stored factors.

    Raises
    ------
    UnsupportedModelError
        ``factors`` is not ``rotary_dim // 2`` positive finite numbers.
    """
    ff = np.asarray(factors, F32).reshape(-1)
    if ff.size != rope.rotary_dim // 2 or not (np.isfinite(ff).all() and (ff > 0).all()):
        raise UnsupportedModelError(
            f"rope_freqs: {ff.size} factors for rotary width {rope.rotary_dim}, each must be > 0"
        )
    assert rope.params is not None
    return replace(rope, params=replace(rope.params, freq_factors=tuple(map(float, ff))))


def _exponents(dim: int) -> np.ndarray:
    return np.arange(0, dim, 2, dtype=F32) / F32(dim)


def _default_inv_freq(base: float | np.float32, dim: int) -> np.ndarray:
    return (F32(1.0) / np.power(F32(base), _exponents(dim), dtype=F32)).astype(F32)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq_and_scaling(p: RopeParams, seq_len: int | None = None) -> tuple[np.ndarray, float]:
    """Inverse frequencies ``[rotary_dim // 2]`` (float32) and the attention factor of ``p``.

    ``seq_len`` is what transformers passes at run time: the current sequence
    length for ``dynamic`` (None: ``max_position_embeddings``) and, for
    ``longrope``, a length past the original one selects the long factors.
    """
    dim, base = p.rotary_dim, p.theta
    if p.rope_type == "default":
        return _default_inv_freq(base, dim), 1.0
    if p.rope_type == "linear":
        return (_default_inv_freq(base, dim) / F32(p.factor)).astype(F32), 1.0
    if p.rope_type == "dynamic":
        n = max(seq_len or 0, p.max_position)
        f = F32(p.factor)
        # transformers computes this in float32 (a tensor seq_len) at run time.
        grow = (f * F32(n) / F32(p.max_position) - F32(p.factor - 1.0)) ** F32(dim / (dim - 2))
        return _default_inv_freq(F32(base) * F32(grow), dim), 1.0
    if p.rope_type == "llama3":
        inv = _default_inv_freq(base, dim)
        old = float(p.original_max)
        low_wl, high_wl = old / p.low_freq_factor, old / p.high_freq_factor
        wavelen = F32(2 * math.pi) / inv
        scaled = np.where(wavelen > F32(low_wl), inv / F32(p.factor), inv).astype(F32)
        smooth = (F32(old) / wavelen - F32(p.low_freq_factor)) / F32(
            p.high_freq_factor - p.low_freq_factor
        )
        smoothed = (F32(1.0) - smooth) * scaled / F32(p.factor) + smooth * scaled
        medium = ~(wavelen < F32(high_wl)) & ~(wavelen > F32(low_wl))
        return np.where(medium, smoothed, scaled).astype(F32), 1.0
    if p.rope_type == FREQ_FACTORS:
        if p.freq_factors is None:
            raise UnsupportedModelError("rope type 'freq_factors' without the stored rope_freqs")
        return (_default_inv_freq(base, dim) / np.asarray(p.freq_factors, F32)).astype(F32), 1.0
    if p.rope_type == "yarn":
        return _yarn(p)
    if p.rope_type == "longrope":
        factor = p.factor if p.factor is not None else p.max_position / p.original_max
        att = p.attention_factor
        if att is None:
            att = (
                1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(p.original_max))
            )
        long = seq_len is not None and seq_len > p.original_max
        ext = np.asarray(p.long_factor if long else p.short_factor, F32)
        powed = np.power(F32(base), _exponents(dim), dtype=F32)
        return (F32(1.0) / (ext * powed)).astype(F32), float(att)
    raise UnsupportedModelError(f"rope type {p.rope_type!r} is not implemented")


def _yarn(p: RopeParams) -> tuple[np.ndarray, float]:
    dim, base = p.rotary_dim, p.theta
    factor = p.factor if p.factor is not None else p.max_position / p.original_max
    att = p.attention_factor
    if att is None:
        if p.mscale and p.mscale_all_dim:
            att = float(_yarn_mscale(factor, p.mscale) / _yarn_mscale(factor, p.mscale_all_dim))
        else:
            att = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(p.original_max / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(p.beta_fast), correction_dim(p.beta_slow)
    if p.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=F32) - F32(low)) / F32(high - low), 0, 1).astype(F32)
    pos_freqs = np.power(F32(base), _exponents(dim), dtype=F32)
    extrapolation = F32(1.0) / pos_freqs
    interpolation = F32(1.0) / (F32(factor) * pos_freqs)
    extra_factor = F32(1.0) - ramp
    inv = interpolation * (F32(1.0) - extra_factor) + extrapolation * extra_factor
    return inv.astype(F32), float(att)


class Rotary(BaseRotary):
    """:class:`~czyx.inference.models.base.Rotary` for every supported rope type.

    The tables hold ``cos * attention_factor`` and ``sin * attention_factor``
    (as transformers' rotary forward). ``interleaved`` rotates adjacent
    channel pairs ``(x0, x1), (x2, x3), ...`` (DeepSeek's layout) by
    de-interleaving them first; the output then lists the first members of
    each pair, then the second ones (transformers' DeepSeek-V3 layout;
    DeepSeek-V2 keeps pairs adjacent, a permutation applied alike to queries
    and keys, which leaves every attention score unchanged).
    """

    def __init__(self, rope: RopeConfig, initial: int = 256, interleaved: bool = False) -> None:
        p = rope.params
        if p is None:
            p = RopeParams(
                "linear" if rope.linear_factor != 1.0 else "default",
                rope.theta,
                rope.rotary_dim,
                0,
                factor=rope.linear_factor,
            )
        self.params = p
        self.rotary_dim = p.rotary_dim
        self.interleaved = interleaved
        self.inv_freq, self.attention_scaling = inv_freq_and_scaling(p)
        self._short = self.inv_freq
        self._long: np.ndarray | None = None
        self._max_cached = p.max_position  # dynamic NTK: the longest length seen so far
        self._cos = np.empty((0, p.rotary_dim // 2), F32)
        self._sin = np.empty((0, p.rotary_dim // 2), F32)
        self._grow(initial)

    def _grow(self, n: int) -> None:
        super()._grow(n)  # the unscaled tables of self.inv_freq
        if self.attention_scaling != 1.0:
            self._cos *= F32(self.attention_scaling)
            self._sin *= F32(self.attention_scaling)

    def _set_inv_freq(self, inv: np.ndarray) -> None:
        if inv is not self.inv_freq:
            self.inv_freq = inv
            self._grow(max(self._cos.shape[0], 1))

    def _update(self, seq_len: int) -> None:
        """transformers' ``dynamic_rope_update`` for a forward pass reaching ``seq_len``."""
        p = self.params
        if p.rope_type == "dynamic":
            if seq_len > self._max_cached:
                self._set_inv_freq(inv_freq_and_scaling(p, seq_len)[0])
                self._max_cached = seq_len
            if seq_len < p.max_position and self._max_cached > p.max_position:
                self._set_inv_freq(self._short)
                self._max_cached = p.max_position
        elif p.rope_type == "longrope":
            if seq_len > p.original_max:
                if self._long is None:
                    self._long = inv_freq_and_scaling(p, p.original_max + 1)[0]
                self._set_inv_freq(self._long)
            else:
                self._set_inv_freq(self._short)

    def apply(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Rotate ``x [heads, T, head_dim]`` at ``positions [T]`` (see the class docstring)."""
        if self.params.rope_type in ("dynamic", "longrope"):
            self._update(int(positions.max()) + 1)
        if self.interleaved:
            d = self.rotary_dim
            x = np.concatenate([x[..., 0:d:2], x[..., 1:d:2], x[..., d:]], axis=-1)
        return super().apply(x, positions)
