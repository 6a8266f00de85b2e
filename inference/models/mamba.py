"""Mamba (selective state space) layers, as Jamba has them: numpy reference and C kernels.

Per token, after ``in_proj`` splits the input into ``x`` and a gate ``z``
(transformers' ``JambaMambaMixer`` and ``mamba_selective_state_update``)::

    x = silu(causal_conv(x) + conv_bias)
    dt_r, B, C = split(x_proj @ x);  dt_r, B, C = rms_norm(dt_r), rms_norm(B), rms_norm(C)
    d = softplus(dt_proj @ dt_r + dt_bias)
    s = s * exp(d * A) + (d * B) * x                    (s: [I, d_state], A = -exp(A_log))
    y = (s @ C + x * D) * silu(z)

The convolution (:func:`conv_silu`) and the scan (:func:`scan`) run in C
(``czk_conv_silu``, ``czk_mamba_scan``) token by token over a prompt or one
decoded token, in place on the layer's state; the ``*_reference`` functions
are their numpy references. The state is the same size whatever the length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from czyx.inference.errors import RecurrentStateError, UnsupportedModelError
from czyx.inference.models.base import F32, silu
from czyx.inference.models.deltanet import softplus

try:
    from czyx.inference._czk import ffi as _ffi
    from czyx.inference._czk import lib as _lib
except ImportError:  # pragma: no cover - exercised where the extension is not built
    _ffi = _lib = None


@dataclass(frozen=True)
class MambaDims:
    """The widths of a Jamba Mamba layer."""

    inner: int  # I = mamba_expand * hidden_size
    d_state: int
    d_conv: int
    dt_rank: int

    @property
    def conv_shape(self) -> tuple[int, int]:
        """The convolution state: the previous ``d_conv - 1`` inputs."""
        return (self.d_conv - 1, self.inner)

    @property
    def state_shape(self) -> tuple[int, ...]:
        """The selective scan's state."""
        return (self.inner, self.d_state)

    @classmethod
    def from_config(cls, c: dict[str, Any]) -> MambaDims:
        """Read the ``mamba_*`` fields (transformers' defaults where absent)."""
        hidden = int(c["hidden_size"])
        rank = c.get("mamba_dt_rank", "auto")
        rank = math.ceil(hidden / 16) if rank in (None, "auto") else int(rank)
        d = cls(
            int(c.get("mamba_expand", 2)) * hidden,
            int(c.get("mamba_d_state", 16)),
            int(c.get("mamba_d_conv", 4)),
            rank,
        )
        if min(d.inner, d.d_state, d.d_conv, d.dt_rank) <= 0:
            raise UnsupportedModelError(f"Mamba dims {d} must be positive")
        return d


def conv_silu_reference(
    x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, conv_state: np.ndarray
) -> np.ndarray:
    """``silu(causal depthwise conv(x) + bias)`` over ``x [T, C]``; ``conv_state [K-1, C]``
    is advanced in place. The reference of ``czk_conv_silu`` (sums in the same order)."""
    t_len, k = x.shape[0], w.shape[1]
    out = np.empty(x.shape, F32)
    for t in range(t_len):
        window = np.concatenate([conv_state, x[t : t + 1]], axis=0)
        acc = np.zeros(x.shape[1], F32)
        for j in range(k):
            acc += w[:, j] * window[j]
        if bias is not None:
            acc += bias
        out[t] = silu(acc)
        conv_state[...] = window[1:]
    return out


def scan_reference(
    x: np.ndarray,
    dt: np.ndarray,
    dt_bias: np.ndarray,
    neg_a: np.ndarray,
    b: np.ndarray,
    c: np.ndarray,
    d_skip: np.ndarray,
    z: np.ndarray,
    state: np.ndarray,
) -> np.ndarray:
    """The selective scan over ``T`` tokens in numpy (the reference of ``czk_mamba_scan``).

    ``x``, ``dt``, ``z [T, I]``, ``b``, ``c [T, N]``, ``state [I, N]`` (advanced in place);
    ``neg_a [I, N]`` is ``-exp(A_log)`` (:func:`neg_a_of`, computed once per layer).
    """
    out = np.empty(x.shape, F32)
    for t in range(x.shape[0]):
        d = softplus((dt[t] + dt_bias).astype(F32))
        da = np.exp(d[:, None] * neg_a)
        state[...] = state * da + (d[:, None] * b[t][None, :]) * x[t][:, None]
        acc = np.zeros(x.shape[1], F32)
        for n in range(state.shape[1]):
            acc += state[:, n] * c[t, n]
        out[t] = (acc + x[t] * d_skip) * silu(z[t])
    return out


def neg_a_of(a_log: np.ndarray) -> np.ndarray:
    """``A = -exp(A_log)`` in float32: a layer's constant, computed once (the scan's input)."""
    return np.ascontiguousarray(-np.exp(np.asarray(a_log, F32)), F32)


def have_mamba_kernels() -> bool:
    """Whether the compiled Mamba kernels are available."""
    return _lib is not None and hasattr(_lib, "czk_mamba_scan")


def _p(a: np.ndarray) -> Any:
    return _ffi.cast("float *", _ffi.from_buffer(a))


def _state(arr: np.ndarray, shape: tuple[int, ...], what: str) -> None:
    if arr.dtype != F32 or not arr.flags.c_contiguous or arr.shape != shape:
        raise RecurrentStateError(f"{what}: array {arr.shape} {arr.dtype} is not f32 {shape}")


def conv_silu(
    x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, conv_state: np.ndarray
) -> np.ndarray:
    """:func:`conv_silu_reference` in C (``czk_conv_silu``)."""
    if not have_mamba_kernels():
        return conv_silu_reference(x, w, bias, conv_state)
    t, ch = x.shape
    k = w.shape[1]
    _state(conv_state, (k - 1, ch), "conv_silu state")
    _state(w, (ch, k), "conv_silu weight")
    x = np.ascontiguousarray(x, F32)
    out = np.empty((t, ch), F32)
    b = _ffi.NULL if bias is None else _p(np.ascontiguousarray(bias, F32))
    if _lib.czk_conv_silu(t, ch, k, _p(x), ch, _p(w), b, _p(conv_state), _p(out)):
        raise RecurrentStateError(f"czk_conv_silu refused its arguments ({t} x {ch}, k={k})")
    return out


def scan(
    x: np.ndarray,
    dt: np.ndarray,
    dt_bias: np.ndarray,
    neg_a: np.ndarray,
    b: np.ndarray,
    c: np.ndarray,
    d_skip: np.ndarray,
    z: np.ndarray,
    state: np.ndarray,
    pool: Any = None,
) -> np.ndarray:
    """:func:`scan_reference` in C (``czk_mamba_scan``); ``pool`` a ``czk_pool *`` to spread
    the channels over (None: this thread; the result does not depend on it)."""
    if not have_mamba_kernels():
        return scan_reference(x, dt, dt_bias, neg_a, b, c, d_skip, z, state)
    t, inner = x.shape
    n = state.shape[1]
    _state(state, (inner, n), "mamba scan state")
    x, dt, b, c, z = (np.ascontiguousarray(a, F32) for a in (x, dt, b, c, z))
    dt_bias, neg_a, d_skip = (np.ascontiguousarray(a, F32) for a in (dt_bias, neg_a, d_skip))
    out = np.empty((t, inner), F32)
    rc = _lib.czk_mamba_scan(
        _ffi.NULL if pool is None else pool,
        t, inner, n, _p(x), _p(dt), _p(dt_bias), _p(neg_a), _p(b), _p(c), _p(d_skip),
        _p(z), inner, _p(state), _p(out),
    )  # fmt: skip
    if rc:
        raise RecurrentStateError(f"czk_mamba_scan refused its arguments ({t} x {inner} x {n})")
    return out
