"""Numerical building blocks shared by every MoE decoder: float32 numpy only.

Scope: RMSNorm, SwiGLU, rotary position embeddings (default and linear
scaling, full or partial rotary width), grouped-query attention over a KV
cache (causal, optional sliding window) and softmax top-k routing with or
without renormalisation. Each follows the Hugging Face transformers
implementation of the same operation (read from transformers 5.x), so our
logits match theirs to float32 rounding.

Nothing here knows about the store, the slot cache or an architecture.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from czyx.inference.errors import ScopeRoutingError, UnsupportedModelError
from czyx.inference.kernels.linear import GateUp, Weight, mm_t

F32 = np.float32
#: A calibration hook: called with a matrix's input rows (see inference.calibration).
Observe = Callable[[np.ndarray], None] | None


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Root-mean-square norm over the last axis, then the elementwise weight.

    As transformers: ``weight * (x * rsqrt(mean(x**2) + eps))``, in float32.
    """
    var = np.mean(np.square(x), axis=-1, keepdims=True)
    out = x * (F32(1.0) / np.sqrt(var + F32(eps)))
    out *= weight  # in place: the same products as ``weight * (...)``, one array fewer
    return out


def silu(x: np.ndarray) -> np.ndarray:
    """``x * sigmoid(x)``, computed as ``x / (1 + exp(-x))`` (no overflow warning path)."""
    with np.errstate(over="ignore"):
        return x / (F32(1.0) + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    """The logistic function, float32."""
    with np.errstate(over="ignore"):
        return F32(1.0) / (F32(1.0) + np.exp(-x))


def swiglu(
    x: np.ndarray, gate: Weight, up: Weight, down: Weight, observe: Observe = None
) -> np.ndarray:
    """A SwiGLU MLP: ``down @ (silu(gate @ x) * (up @ x))`` for row vectors ``x [T, H]``.

    ``gate``/``up`` are ``[I, H]`` and ``down`` is ``[H, I]`` (the checkpoint's
    row-major layout); the transposes are BLAS flags, not copies. Any of them
    may be a packed quantized matrix (:mod:`inference.kernels.linear`).
    ``observe``, when given, sees the down projection's input (calibration).
    """
    act = silu(mm_t(x, gate)) * mm_t(x, up)
    if observe is not None:
        observe(act)
    return mm_t(act, down)


#: Largest ``M * N * K`` of one float32 BLAS call in :func:`matmul_small`. OpenBLAS's
#: SkylakeX/Zen kernels multiply without packing up to 100**3; an expert's
#: ``[2I, H] @ [H, n]`` for a few tokens is far above that, and packing its
#: weight (read once, from memory) costs more than the product itself.
SMALL_GEMM = 1_000_000


def matmul_small(w: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``w [M, K] @ b [K, N]`` as row blocks of ``w`` small enough for BLAS's unpacked path.

    Each block is a multiple of 16 rows (whole register tiles) with
    ``rows * N * K <= SMALL_GEMM``. A weight times a few columns (an expert
    in prefill, 4-32 tokens) runs faster this way than as one call (figures:
    ``bench/RATIONALE.md``; engine speed: ``bench/bench_engine.py``). The
    whole blocks go to BLAS as one stacked ``[M // rows, rows, K] @ [K, N]``
    matmul (numpy loops over the stack in C: no Python call per block), the
    remainder as one more call.
    With one column, or too many for a 16-row block, it is one ordinary
    call. Results depend only on the shapes and memory layout (so tiered and
    resident runs, which share both, stay bit-identical).
    """
    m, k = w.shape
    n = b.shape[1]
    if out is None:
        out = np.empty((m, n), F32)
    rows = SMALL_GEMM // max(n * k, 1)
    rows -= rows % 16
    if n == 1 or rows < 16 or rows >= m:
        return np.matmul(w, b, out=out)
    whole = m - m % rows
    if w.flags.c_contiguous and out.flags.c_contiguous:
        np.matmul(
            w[:whole].reshape(whole // rows, rows, k),
            b,
            out=out[:whole].reshape(whole // rows, rows, n),
        )
    else:  # a strided weight or output cannot be stacked without a copy
        for r in range(0, whole, rows):
            np.matmul(w[r : r + rows], b, out=out[r : r + rows])
    if whole < m:
        np.matmul(w[whole:], b, out=out[whole:])
    return out


def silu_mul_(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """``gate <- silu(gate) * up`` in place (one scratch array, no other temporaries)."""
    tmp = np.negative(gate)
    with np.errstate(over="ignore"):
        np.exp(tmp, out=tmp)
    tmp += F32(1.0)
    np.divide(gate, tmp, out=gate)
    gate *= up
    return gate


def swiglu_columns(
    xt: np.ndarray, gate_up: np.ndarray, down: np.ndarray, observe: Observe = None
) -> np.ndarray:
    """SwiGLU of tokens given as columns: ``xt [H, n]`` -> ``[H, n]`` (float32 weights).

    ``gate_up`` is the stacked ``[2I, H]`` matrix and ``down`` ``[H, I]``; both
    products go through :func:`matmul_small`. ``observe`` sees the down
    projection's input as rows ``[n, I]`` (a transposed view).
    """
    inter = gate_up.shape[0] // 2
    gu = matmul_small(gate_up, xt)  # [2I, n]
    act = silu_mul_(gu[:inter], gu[inter:])
    if observe is not None:
        observe(act.T)
    return matmul_small(down, act)


def swiglu_fused(
    x: np.ndarray, gate_up: Weight | GateUp, down: Weight, observe: Observe = None
) -> np.ndarray:
    """SwiGLU with gate and up stacked as one ``[2I, H]`` matrix: one matmul instead of two.

    The expert extent stores gate then up contiguously, so the slot already
    holds this stacked matrix; using it halves the BLAS calls per expert.
    Float32 weights run in column form (:func:`swiglu_columns`), returning a
    transposed view ``[T, H]``: OpenBLAS runs a tall weight times a few
    columns faster than a few rows times a transposed weight
    (``bench/RATIONALE.md``), and the gate and up halves come out as
    contiguous row blocks.
    """
    if isinstance(gate_up, np.ndarray):
        return swiglu_columns(np.ascontiguousarray(x.T), gate_up, down, observe).T
    # Packed (quantized) weights: the C kernels take rows of x.
    inter = gate_up.shape[0] // 2
    gu = mm_t(x, gate_up)
    act = silu(gu[:, :inter]) * gu[:, inter:]
    if observe is not None:
        observe(act)
    return mm_t(act, down)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """A numerically stable softmax along ``axis`` (float32)."""
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


def route_topk(
    router_logits: np.ndarray, top_k: int, renormalize: bool, mask: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Softmax over the experts, then the ``top_k`` largest probabilities per token.

    Parameters
    ----------
    router_logits
        ``[T, E]`` float32 router outputs.
    top_k
        Experts per token.
    renormalize
        Divide the chosen probabilities by their sum (Mixtral always;
        Qwen-MoE and OLMoE when ``norm_topk_prob``).
    mask
        Optional ``bool [E]``: the experts a scoped portal permits. Forbidden
        experts' logits become ``-inf`` before the softmax, so the top-k is taken
        over the permitted experts only and the probabilities are renormalised
        over them; the caller guarantees at least ``top_k`` are permitted.

    Returns
    -------
    (indices, weights)
        ``[T, top_k]`` int64 expert indices in descending probability order
        (as ``torch.topk``) and their float32 weights.
    """
    logits = forbid_experts(router_logits.astype(F32, copy=False), mask)
    probs = softmax(logits, axis=-1)
    n = probs.shape[-1]
    if top_k < n:
        part = np.argpartition(-probs, top_k - 1, axis=-1)[:, :top_k]
    else:
        part = np.broadcast_to(np.arange(n), probs.shape).copy()
    vals = np.take_along_axis(probs, part, axis=-1)
    # Descending order among the chosen, ties broken by the lower index like torch.topk.
    order = np.lexsort((part, -vals), axis=-1)
    idx = np.take_along_axis(part, order, axis=-1)
    w = np.take_along_axis(vals, order, axis=-1)
    if renormalize:
        w = w / np.sum(w, axis=-1, keepdims=True)
    return idx.astype(np.int64, copy=False), w.astype(F32, copy=False)


# --------------------------------------------------------------------------- rope


def forbid_experts(scores: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """Routing ``scores [T, E]`` with the experts a scoped portal forbids at ``-inf``.

    ``mask`` is ``bool [E]`` (the permitted experts) or None (all permitted:
    ``scores`` itself). A portal's caveat must narrow the *choice*, not only the
    reads, or routing picks an expert the run then cannot read.
    """
    return scores if mask is None else np.where(mask, scores, F32(-np.inf))


def refuse_forbidden(idx: np.ndarray, mask: np.ndarray | None) -> None:
    """Refuse a routing whose chosen experts ``idx`` include one ``mask`` forbids.

    A top-k over forbidden-at-``-inf`` scores still picks a forbidden expert
    when too few permitted ones are left to fill it (a group-limited selection
    can leave too few); such a token is refused, never routed outside the grant.

    Raises
    ------
    ScopeRoutingError
    """
    if mask is not None and not mask[idx].all():
        raise ScopeRoutingError("the portal's classes cannot fill this token's top-k")


def group_by_expert(
    idx: np.ndarray, n_experts: int, resident: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The ``(token, k)`` routes of ``idx [T, k]`` grouped by expert, for one pass per expert.

    Returns ``(pairs, counts, ends, order)``: ``pairs`` the flat route indices sorted
    (stably) by expert, so expert ``e``'s routes are ``pairs[ends[e] - counts[e] :
    ends[e]]``; ``order`` the distinct experts, residents first (``resident[e] >= 0``,
    a layer's row of the cache table), so a small budget evicts only after the hits
    are used. Shared by the single-sequence and the batched prefill.
    """
    flat = idx.ravel()
    pairs = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=n_experts)
    ends = np.cumsum(counts)
    uniq = np.flatnonzero(counts)
    order = uniq[np.argsort(resident[uniq] < 0, kind="stable")]
    return pairs, counts, ends, order


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, normalised from a checkpoint config.

    ``rotary_dim`` is the number of leading channels of each head that rotate
    (``head_dim * partial_rotary_factor``); the rest pass through unchanged.
    ``linear_factor`` divides positions (the "linear" rope type); 1.0 otherwise.
    """

    theta: float
    rotary_dim: int
    linear_factor: float = 1.0


def rope_config(config: dict[str, Any], head_dim: int) -> RopeConfig:
    """Read the rope conventions of a config: transformers 5.x ``rope_parameters``
    or the older top-level ``rope_theta``/``rope_scaling``/``partial_rotary_factor``.

    Raises
    ------
    UnsupportedModelError
        For rope types other than ``default`` and ``linear`` (yarn, llama3, ...).
    """
    params = dict(config.get("rope_parameters") or {})
    legacy = config.get("rope_scaling") or {}
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", legacy.get("rope_type", legacy.get("type", "default")))
    factor = float(params.get("factor", legacy.get("factor", 1.0)) or 1.0)
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if rope_type not in ("default", "linear"):
        raise UnsupportedModelError(
            f"config rope type {rope_type!r} is not implemented (default and linear are)"
        )
    rot = int(head_dim * float(partial))
    if rot <= 0 or rot % 2 or rot > head_dim:
        raise UnsupportedModelError(
            f"config partial_rotary_factor={partial} gives rotary width {rot} for head_dim "
            f"{head_dim}; it must be even and within the head"
        )
    return RopeConfig(
        theta=float(theta),
        rotary_dim=rot,
        linear_factor=factor if rope_type == "linear" else 1.0,
    )


class Rotary:
    """Cos/sin tables for rotary embeddings, grown on demand, applied in place of a copy.

    Matches transformers: ``inv_freq = 1 / theta**(arange(0, d, 2) / d)`` in
    float32, ``freqs = position * inv_freq``, halves concatenated, and
    ``x * cos + rotate_half(x) * sin`` on the rotary channels.
    """

    def __init__(self, rope: RopeConfig, initial: int = 256) -> None:
        d = rope.rotary_dim
        exps = np.arange(0, d, 2, dtype=F32) / F32(d)
        inv = F32(1.0) / np.power(F32(rope.theta), exps, dtype=F32)
        self.inv_freq = (inv / F32(rope.linear_factor)).astype(F32)
        self.rotary_dim = d
        self._cos = np.empty((0, d), F32)
        self._sin = np.empty((0, d), F32)
        self._grow(initial)

    def _grow(self, n: int) -> None:
        # Half-width tables: the full-width ones are the same half twice.
        pos = np.arange(n, dtype=F32)
        freqs = pos[:, None] * self.inv_freq[None, :]
        self._cos = np.cos(freqs).astype(F32)
        self._sin = np.sin(freqs).astype(F32)

    def apply(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Rotate ``x [heads, T, head_dim]`` for token ``positions [T]``; returns a new array.

        With ``x1, x2`` the two rotary halves, ``x1*cos - x2*sin`` and
        ``x2*cos + x1*sin``: the same products and sums as transformers'
        ``x*cos + rotate_half(x)*sin``, written into one output without the
        concatenated ``rotate_half`` copy. ``x`` may be a strided view.
        """
        need = int(positions.max()) + 1
        if need > self._cos.shape[0]:
            self._grow(max(need, 2 * self._cos.shape[0]))
        cos = self._cos[positions]  # [T, d/2]
        sin = self._sin[positions]
        d = self.rotary_dim
        half = d // 2
        x1, x2 = x[..., :half], x[..., half:d]
        out = np.empty(x.shape, F32)
        o1, o2 = out[..., :half], out[..., half:d]
        np.multiply(x1, cos, out=o1)
        o1 -= x2 * sin
        np.multiply(x2, cos, out=o2)
        o2 += x1 * sin
        if d < x.shape[-1]:
            out[..., d:] = x[..., d:]
        return out


# --------------------------------------------------------------------------- attention


class KVCache:
    """Per-layer key/value arrays ``[n_kv_heads, capacity, head_dim]``, grown by doubling.

    Keys are stored after RoPE, as transformers' cache does, so decode never
    re-rotates history.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int = 64) -> None:
        self.n_layers = n_layers
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.length = 0
        shape = (n_kv_heads, capacity, head_dim)
        self.k = [np.zeros(shape, F32) for _ in range(n_layers)]
        self.v = [np.zeros(shape, F32) for _ in range(n_layers)]

    @property
    def capacity(self) -> int:
        """Positions the arrays can hold without growing."""
        return self.k[0].shape[1]

    def reserve(self, total: int) -> None:
        """Make room for ``total`` positions (doubling, so appends are amortised O(1))."""
        cap = self.capacity
        if total <= cap:
            return
        new = max(total, 2 * cap)
        for i in range(self.n_layers):
            for arrs in (self.k, self.v):
                grown = np.zeros((self.n_kv_heads, new, self.head_dim), F32)
                grown[:, :cap] = arrs[i][:, :cap]
                arrs[i] = grown

    def write(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store ``k``/``v`` ``[n_kv, T, head_dim]`` at positions ``start .. start+T``."""
        t = k.shape[1]
        self.k[layer][:, start : start + t] = k
        self.v[layer][:, start : start + t] = v

    def truncate(self, length: int) -> None:
        """Forget positions from ``length`` on (the arrays keep their capacity)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a KV cache of length {self.length} to {length}")
        self.length = length

    def track(self, on: bool = True) -> None:
        """Make every position a later forward reaches one :meth:`truncate` may return to.

        Nothing to do here: a KV cache can be cut at any position. A hybrid model's
        cache (:class:`~czyx.inference.models.deltanet.HybridCache`) snapshots its
        recurrent state instead, so speculative decoding calls ``track()`` then
        ``truncate(start + accepted)`` on either.
        """


def attention(
    q: np.ndarray,
    k_all: np.ndarray,
    v_all: np.ndarray,
    q_positions: np.ndarray,
    sliding_window: int | None,
    chunk: int | None = None,
) -> np.ndarray:
    """Grouped-query causal attention of new queries over cached keys/values.

    Parameters
    ----------
    q
        ``[n_heads, T, head_dim]`` rotated queries at ``q_positions``.
    k_all, v_all
        ``[n_kv_heads, L, head_dim]``: every key/value from position 0 to L-1
        (including the new ones).
    q_positions
        ``[T]`` absolute positions of the queries.
    sliding_window
        When set, a query at ``p`` sees keys at ``j`` with ``p - j < window``
        (transformers' sliding-window mask).
    chunk
        When set, a query at ``p`` sees only keys of its own chunk,
        ``j // chunk == p // chunk`` (Llama 4's chunked attention).

    Returns
    -------
    ``[T, n_heads * head_dim]``.
    """
    n_heads, t, hd = q.shape
    n_kv, length, _ = k_all.shape
    groups = n_heads // n_kv
    scale = F32(hd**-0.5)
    qg = q.reshape(n_kv, groups * t, hd)
    scores = (qg @ k_all.transpose(0, 2, 1)).reshape(n_kv, groups, t, length)
    scores *= scale
    keys = np.arange(length)
    masked = keys[None, :] > q_positions[:, None]
    if sliding_window:
        masked |= (q_positions[:, None] - keys[None, :]) >= sliding_window
    if chunk:
        masked |= (keys[None, :] // chunk) != (q_positions[:, None] // chunk)
    if masked.any():  # built once per call, broadcast over heads, applied in place
        np.copyto(scores, F32(-np.inf), where=masked[None, None])
    # Softmax in place: the same operations as softmax(), without temporaries.
    scores -= np.max(scores, axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= np.sum(scores, axis=-1, keepdims=True)
    probs = scores.reshape(n_kv, groups * t, length)
    out = (probs @ v_all).reshape(n_heads, t, hd)
    return out.transpose(1, 0, 2).reshape(t, n_heads * hd)
