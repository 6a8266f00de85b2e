"""Gated DeltaNet linear attention (Qwen3-Next): its recurrent cache and the layer in numpy.

Scope: the per-layer recurrent state of a hybrid model (:class:`HybridCache`: the
attention layers' KV, plus per linear layer a causal-convolution state and a
DeltaNet state), snapshots of it for rollback, and the linear-attention layer's
arithmetic: :func:`gdn_reference` (numpy, token by token: the test reference of
the C kernel ``czk_gdn``) and :func:`gdn` (the C kernel where it is compiled).

The recurrence, per value head ``h`` and token (transformers'
``torch_recurrent_gated_delta_rule``)::

    S <- S * exp(g);  delta = (v - k S) * beta;  S <- S + k (x) delta;  o = q S

with ``q``, ``k`` L2-normalised (and ``q`` scaled by ``dk ** -0.5``), ``beta =
sigmoid(b)`` and ``g = -exp(A_log) * softplus(a + dt_bias)``. A token costs the
same whatever the length reached: the state is ``[n_v_heads, dk, dv]`` floats.
Prompts run the same recurrence token by token (transformers' prompt path is the
chunked form of the same sums; they agree to float32 rounding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from czyx.inference.errors import RecurrentStateError, UnsupportedModelError
from czyx.inference.models.base import F32, KVCache, rms_norm, sigmoid, silu

try:
    from czyx.inference._czk import ffi as _ffi
    from czyx.inference._czk import lib as _lib
except ImportError:  # pragma: no cover - exercised where the extension is not built
    _ffi = _lib = None

#: Snapshots a :class:`HybridCache` keeps for :meth:`HybridCache.truncate` (oldest dropped).
MAX_SNAPSHOTS = 64


@dataclass(frozen=True)
class DeltaNetDims:
    """The widths of a gated-DeltaNet layer, read from a Qwen3-Next config."""

    n_k_heads: int
    n_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        """Channels of the queries (and of the keys)."""
        return self.n_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        """Channels of the values (and of the output gate ``z``)."""
        return self.n_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal convolution: queries, keys and values."""
        return 2 * self.key_dim + self.value_dim

    @property
    def conv_shape(self) -> tuple[int, int]:
        """A linear layer's convolution state: the previous ``kernel - 1`` inputs."""
        return (self.conv_kernel - 1, self.conv_dim)

    @property
    def state_shape(self) -> tuple[int, ...]:
        """A linear layer's recurrent state."""
        return (self.n_v_heads, self.k_head_dim, self.v_head_dim)

    @classmethod
    def from_config(cls, c: dict[str, Any]) -> DeltaNetDims:
        """Read the ``linear_*`` fields (transformers' defaults where absent)."""
        d = cls(
            int(c.get("linear_num_key_heads", 16)),
            int(c.get("linear_num_value_heads", 32)),
            int(c.get("linear_key_head_dim", 128)),
            int(c.get("linear_value_head_dim", 128)),
            int(c.get("linear_conv_kernel_dim", 4)),
        )
        if min(d.n_k_heads, d.n_v_heads, d.k_head_dim, d.v_head_dim, d.conv_kernel) <= 0:
            raise UnsupportedModelError(f"linear attention dims {d} must be positive")
        if d.n_v_heads % d.n_k_heads:
            raise UnsupportedModelError(
                f"linear_num_value_heads={d.n_v_heads} is not a multiple of "
                f"linear_num_key_heads={d.n_k_heads}"
            )
        return d


@dataclass(frozen=True)
class RecurrentSnapshot:
    """A :class:`HybridCache`'s recurrent state at ``length`` positions (copies)."""

    length: int
    conv: tuple[np.ndarray, ...]
    state: tuple[np.ndarray, ...]


class HybridCache(KVCache):
    """The cache of a hybrid model: KV of its attention layers, state of its linear ones.

    ``k``/``v`` hold the attention layers only, in layer order (``n_layers`` is
    their count), so code written for a :class:`KVCache` (session KV, the batch
    scheduler's copies) sees the attention KV as usual. Per linear layer,
    ``conv[j]`` is ``[kernel - 1, conv_dim]`` (the previous convolution inputs,
    oldest first) and ``state[j]`` is ``[n_v_heads, dk, dv]``.

    The same cache serves Jamba's Mamba layers (``dims`` a
    :class:`~inference.models.mamba.MambaDims`: conv ``[d_conv - 1, I]``, state
    ``[I, d_state]``).

    The recurrent state exists only at the length reached, so the cache cannot
    be cut back like a KV cache. Rollback (speculative decoding) goes through
    snapshots: :meth:`checkpoint` copies the state at the current length, and
    :meth:`truncate` (or :meth:`rollback`) to that length restores it; a cut to
    a length without a snapshot raises :class:`RecurrentStateError`. Snapshots
    past a restored length are dropped (their positions are about to be
    rewritten). ``truncate(0)`` always works (a fresh sequence).

    For speculative decoding, :meth:`track` makes every position a forward
    reaches a snapshot (a verify pass over several drafted tokens runs its
    linear layers token by token, the same arithmetic as one call): after it,
    ``truncate(start + accepted)`` rewinds to any of them without recomputing.
    """

    def __init__(
        self,
        n_attn_layers: int,
        n_kv_heads: int,
        head_dim: int,
        n_linear_layers: int,
        dims: Any,
        capacity: int = 64,
    ) -> None:
        super().__init__(n_attn_layers, n_kv_heads, head_dim, capacity)
        self._cap = capacity
        self.dims = dims  # DeltaNetDims or MambaDims: their conv_shape and state_shape
        self.conv = [np.zeros(dims.conv_shape, F32) for _ in range(n_linear_layers)]
        self.state = [np.zeros(dims.state_shape, F32) for _ in range(n_linear_layers)]
        self._snaps: dict[int, RecurrentSnapshot] = {}
        self.tracking = False
        # Per position reached while tracking: each linear layer's (conv, state) copies,
        # filled layer by layer during a forward; a snapshot once every layer has it.
        self._tracked: dict[int, list[tuple[np.ndarray, np.ndarray] | None]] = {}

    def track(self, on: bool = True) -> None:
        """Snapshot every position reached from now on (``False``: stop, drop the pending ones)."""
        self.tracking = bool(on)
        if not on:
            self._tracked.clear()

    def record(self, j: int, position: int) -> None:
        """Keep linear layer ``j``'s state as it is after ``position`` positions (tracking)."""
        slots = self._tracked.setdefault(position, [None] * self.n_linear_layers)
        slots[j] = (self.conv[j].copy(), self.state[j].copy())
        if all(x is not None for x in slots):
            del self._tracked[position]
            self._snaps.pop(position, None)
            self._snaps[position] = RecurrentSnapshot(
                position, tuple(x[0] for x in slots), tuple(x[1] for x in slots)
            )
            while len(self._snaps) > MAX_SNAPSHOTS:
                self._snaps.pop(next(iter(self._snaps)))

    @property
    def capacity(self) -> int:
        """Positions the attention arrays can hold without growing."""
        return self._cap

    def reserve(self, total: int) -> None:
        """Make room for ``total`` positions in the attention layers (doubling)."""
        if total > self._cap:
            if self.n_layers:
                super().reserve(total)
            self._cap = max(total, 2 * self._cap)

    @property
    def n_linear_layers(self) -> int:
        """Linear-attention layers (one conv and one DeltaNet state each)."""
        return len(self.state)

    def recurrent_arrays(self) -> tuple[np.ndarray, ...]:
        """Every recurrent array in a fixed order: layer by layer, conv state then state."""
        return tuple(a for pair in zip(self.conv, self.state, strict=True) for a in pair)

    def recurrent_nbytes(self) -> int:
        """Bytes of the recurrent state (constant in the length)."""
        return sum(int(a.nbytes) for a in self.recurrent_arrays())

    def load_recurrent(self, arrays: tuple[np.ndarray, ...] | list[np.ndarray]) -> None:
        """Copy ``arrays`` (as :meth:`recurrent_arrays` orders them) into the state.

        Raises
        ------
        RecurrentStateError
            A count or shape that is not this cache's.
        """
        mine = self.recurrent_arrays()
        if len(arrays) != len(mine):
            raise RecurrentStateError(
                f"{len(arrays)} recurrent arrays for a cache of {len(mine)} "
                f"({self.n_linear_layers} linear layers)"
            )
        for i, (dst, src) in enumerate(zip(mine, arrays, strict=True)):
            if tuple(src.shape) != dst.shape:
                raise RecurrentStateError(
                    f"recurrent array {i} has shape {tuple(src.shape)}, the cache {dst.shape}"
                )
            dst[...] = src

    def copy_from(self, src: HybridCache, n: int) -> None:
        """Hold exactly ``src``'s first ``n`` positions (``n`` must be its whole length).

        Raises
        ------
        RecurrentStateError
            ``n`` is not ``src.length``: the recurrent state exists only there.
        """
        if n != src.length:
            raise RecurrentStateError(
                f"a hybrid cache copies whole ({src.length} positions), not its first {n}"
            )
        self.reserve(n)
        for i in range(len(src.k)):
            self.k[i][:, :n] = src.k[i][:, :n]
            self.v[i][:, :n] = src.v[i][:, :n]
        self.load_recurrent(src.recurrent_arrays())
        self.length = n
        self._snaps.clear()

    def checkpoint(self) -> RecurrentSnapshot:
        """Snapshot the recurrent state at the current length (kept for :meth:`truncate`)."""
        snap = RecurrentSnapshot(
            self.length,
            tuple(a.copy() for a in self.conv),
            tuple(a.copy() for a in self.state),
        )
        self._snaps.pop(self.length, None)
        self._snaps[self.length] = snap
        while len(self._snaps) > MAX_SNAPSHOTS:
            self._snaps.pop(next(iter(self._snaps)))
        return snap

    def restore(self, snap: RecurrentSnapshot) -> None:
        """Go back to ``snap`` (taken on this cache, at most the current length).

        Raises
        ------
        RecurrentStateError
            The snapshot is ahead of the cache or has other shapes.
        """
        if not 0 <= snap.length <= self.length:
            raise RecurrentStateError(
                f"cannot restore a snapshot at {snap.length} positions on a cache at {self.length}"
            )
        self.load_recurrent([a for pair in zip(snap.conv, snap.state) for a in pair])
        self.length = snap.length
        self._snaps = {n: s for n, s in self._snaps.items() if n <= snap.length}
        self._tracked.clear()

    def truncate(self, length: int) -> None:
        """Go back to ``length`` positions: 0, the current length, or a checkpointed one.

        Raises
        ------
        RecurrentStateError
            No snapshot at ``length`` (:meth:`checkpoint` it first).
        """
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a KV cache of length {self.length} to {length}")
        if length == self.length:
            return
        if length == 0:
            for a in self.recurrent_arrays():
                a.fill(0.0)
            self.length = 0
            self._snaps.clear()
            self._tracked.clear()
            return
        snap = self._snaps.get(length)
        if snap is None:
            raise RecurrentStateError(
                f"cannot rewind a hybrid cache from {self.length} to {length} positions: its "
                f"recurrent state exists only where checkpoint() was called "
                f"(at {sorted(self._snaps) or 'none'})"
            )
        self.restore(snap)

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` positions (a checkpoint must exist there; see :meth:`truncate`)."""
        self.truncate(self.length - int(n))


# --------------------------------------------------------------------------- the layer


def split_projections(
    qkvz: np.ndarray, ba: np.ndarray, d: DeltaNetDims
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Untangle ``in_proj_qkvz [T, 2kd + 2vd]`` and ``in_proj_ba [T, 2nv]`` outputs.

    Both are laid out per key-head group (transformers'
    ``fix_query_key_value_ordering``): group ``g`` holds its query, key, its
    ``nv / nk`` value heads and their gates; then its betas and decays.
    Returns ``mixed [T, conv_dim]`` (all queries, keys, values), ``z [T, nv, dv]``,
    ``b [T, nv]`` and ``a [T, nv]``.
    """
    t = qkvz.shape[0]
    nk, dk, dv = d.n_k_heads, d.k_head_dim, d.v_head_dim
    r = d.n_v_heads // nk
    g = qkvz.reshape(t, nk, 2 * dk + 2 * r * dv)
    q = g[:, :, :dk].reshape(t, d.key_dim)
    k = g[:, :, dk : 2 * dk].reshape(t, d.key_dim)
    v = g[:, :, 2 * dk : 2 * dk + r * dv].reshape(t, d.value_dim)
    z = g[:, :, 2 * dk + r * dv :].reshape(t, d.n_v_heads, dv)
    gba = ba.reshape(t, nk, 2 * r)
    b = np.ascontiguousarray(gba[:, :, :r].reshape(t, d.n_v_heads))
    a = np.ascontiguousarray(gba[:, :, r:].reshape(t, d.n_v_heads))
    mixed = np.ascontiguousarray(np.concatenate([q, k, v], axis=1), dtype=F32)
    return mixed, z, b, a


def softplus(x: np.ndarray) -> np.ndarray:
    """``log(1 + exp(x))``, and ``x`` itself above 20 (torch's threshold)."""
    with np.errstate(over="ignore"):
        return np.where(x > F32(20.0), x, np.log1p(np.exp(np.minimum(x, F32(20.0))))).astype(F32)


def gdn_reference(
    mixed: np.ndarray,
    b: np.ndarray,
    a: np.ndarray,
    conv_w: np.ndarray,
    a_log: np.ndarray,
    dt_bias: np.ndarray,
    conv_state: np.ndarray,
    state: np.ndarray,
    d: DeltaNetDims,
) -> np.ndarray:
    """The convolution and the gated delta rule over ``T`` tokens, in numpy, token by token.

    ``mixed [T, conv_dim]``, ``b``/``a [T, nv]``, ``conv_w [conv_dim, K]``;
    ``conv_state [K-1, conv_dim]`` and ``state [nv, dk, dv]`` are updated in
    place. Returns ``[T, nv, dv]``. The reference of the C kernel (``czk_gdn``),
    with its sums in the same order.
    """
    t_len = mixed.shape[0]
    nk, nv, dk, dv, kk = d.n_k_heads, d.n_v_heads, d.k_head_dim, d.v_head_dim, d.conv_kernel
    r = nv // nk
    out = np.empty((t_len, nv, dv), F32)
    scale = F32(1.0) / np.sqrt(F32(dk))
    beta = sigmoid(b.astype(F32))
    decay = np.exp(-np.exp(a_log.astype(F32)) * softplus((a + dt_bias).astype(F32)))
    for t in range(t_len):
        window = np.concatenate([conv_state, mixed[t : t + 1]], axis=0)  # [K, C]
        acc = np.zeros(d.conv_dim, F32)
        for j in range(kk):
            acc += conv_w[:, j] * window[j]
        y = silu(acc)
        conv_state[...] = window[1:]
        qk = y[: 2 * d.key_dim].reshape(2 * nk, dk)
        ss = np.zeros(2 * nk, F32)
        for i in range(dk):
            ss += qk[:, i] * qk[:, i]
        qk = qk * (F32(1.0) / np.sqrt(ss + F32(1e-6)))[:, None]
        q = np.repeat(qk[:nk] * scale, r, axis=0)  # [nv, dk]
        k = np.repeat(qk[nk:], r, axis=0)
        v = y[2 * d.key_dim :].reshape(nv, dv)
        state *= decay[t][:, None, None]
        mem = (state * k[:, :, None]).sum(axis=1)  # [nv, dv], summed over dk in order
        delta = (v - mem) * beta[t][:, None]
        state += k[:, :, None] * delta[:, None, :]
        out[t] = (state * q[:, :, None]).sum(axis=1)
    return out


def have_gdn_kernel() -> bool:
    """Whether the compiled ``czk_gdn`` kernel is available."""
    return _lib is not None and hasattr(_lib, "czk_gdn")


def gdn(
    mixed: np.ndarray,
    b: np.ndarray,
    a: np.ndarray,
    conv_w: np.ndarray,
    a_log: np.ndarray,
    dt_bias: np.ndarray,
    conv_state: np.ndarray,
    state: np.ndarray,
    d: DeltaNetDims,
    pool: Any = None,
) -> np.ndarray:
    """:func:`gdn_reference` in the C kernel ``czk_gdn`` (the reference where it is not built).

    ``pool``: a ``czk_pool *`` (the decode kernels' threads) to spread the value heads
    over, or None (this thread); the result does not depend on it.

    Raises
    ------
    RecurrentStateError
        An array that is not float32 C-contiguous of the expected shape (the
        kernel writes the states in place), or the kernel refused its sizes.
    """
    if not have_gdn_kernel():
        return gdn_reference(mixed, b, a, conv_w, a_log, dt_bias, conv_state, state, d)
    t = mixed.shape[0]
    need = (
        (conv_state, (d.conv_kernel - 1, d.conv_dim)),
        (state, (d.n_v_heads, d.k_head_dim, d.v_head_dim)),
        (conv_w, (d.conv_dim, d.conv_kernel)),
    )
    for arr, shape in need:
        if arr.dtype != F32 or not arr.flags.c_contiguous or arr.shape != shape:
            raise RecurrentStateError(f"gdn: array {arr.shape} {arr.dtype} is not f32 {shape}")
    mixed = np.ascontiguousarray(mixed, F32)
    b = np.ascontiguousarray(b, F32)
    a = np.ascontiguousarray(a, F32)
    a_log = np.ascontiguousarray(a_log, F32)
    dt_bias = np.ascontiguousarray(dt_bias, F32)
    out = np.empty((t, d.n_v_heads, d.v_head_dim), F32)

    def p(x: np.ndarray) -> Any:
        return _ffi.cast("float *", _ffi.from_buffer(x))

    rc = _lib.czk_gdn(
        _ffi.NULL if pool is None else pool,
        t, d.n_k_heads, d.n_v_heads, d.k_head_dim, d.v_head_dim, d.conv_kernel,
        p(mixed), p(b), p(a), p(conv_w), p(a_log), p(dt_bias), p(conv_state), p(state), p(out),
    )  # fmt: skip
    if rc:
        raise RecurrentStateError(f"czk_gdn refused its arguments ({d}, {t} tokens)")
    return out


def run_recurrent(
    kv: HybridCache,
    j: int,
    start: int,
    t: int,
    step: Any,
) -> np.ndarray:
    """``step(lo, hi)`` over a layer's ``t`` new tokens: one call, or (while ``kv`` tracks)
    one call per token with layer ``j``'s state recorded after each (the same arithmetic:
    the kernels run a prompt token by token either way)."""
    if not kv.tracking:
        return step(0, t)
    outs = []
    for s in range(t):
        outs.append(step(s, s + 1))
        kv.record(j, start + s + 1)
    return np.concatenate(outs)


def gated_rms_norm(x: np.ndarray, gate: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Qwen3-Next's ``RMSNormGated``: ``weight * rms_normalised(x) * silu(gate)`` per head."""
    return rms_norm(x, weight, eps) * silu(gate)
