"""Continuous batching: many sequences stepped together over one decoder and expert cache.

Scope: :func:`forward_batch` runs one forward step over several sequences at
once (each its own KV cache, each a decode token or a chunk of its prompt);
:class:`Scheduler` keeps a bounded queue of requests, admits them under a
sequence count and a KV memory budget, and steps every active sequence
together on one worker thread: decode tokens first, then prefill chunks
(fixed size, so a long prompt never stalls the others for more than a
chunk), sampling each sequence's next token with its own sampler. Nothing
here knows about HTTP; :mod:`czyx.server` puts it behind the OpenAI API.

Why batch: in one step every routed expert that any sequence chose is
acquired from the slot cache once and multiplied once over all the tokens
that chose it, so the expert bytes read (and the trunk weights streamed from
memory) per generated token fall as the batch grows.

Why results do not depend on the batch: BLAS picks its kernel (and with it
the float32 summation order) from a product's shape, so ``W @ X`` with one
column and the same column inside an 8- or 16-column ``X`` differ in the last
bits. Every product here therefore runs in blocks of exactly
:data:`BLOCK` token columns (zero-padded), whose shape never changes;
per-token operations (norms, softmax, RoPE) are row-independent, and
attention runs per sequence over its own chunk, whose boundaries depend on
that sequence alone. A sequence's logits are then bit-identical whichever
sequences share its steps, and so are its greedy tokens. (They are not
bit-identical to :meth:`Engine.decode`, which multiplies one column: that
path is the single-sequence engine's, this one is the server's.)

Where the architecture decodes in C (see :meth:`MoEDecoder.decode_in_c`) and
a sequence's routing is unrestricted, its chunk, a decode token or a prompt
chunk, takes the single-sequence engine's C kernels instead: every token of
the step is a row, and per layer one C call runs every row's attention block
and routing (a prompt chunk's tokens four at a time, one group after
another, so each attends to the ones before it), then (after the union of
the step's experts is acquired once) one runs every row's MoE layer and
residual add (:mod:`czyx.inference.kernels.fused`, ``DecodeKernels.*_batch``);
the embedding and the head are one call each. The Python per layer is
therefore the same whatever the batch. Each call spreads the rows over the
engine's threads and computes each token with the one-token kernels
exactly as :meth:`Engine.decode` does, so a token's logits (and the KV it
writes) are bit-identical to the same token decoded alone, whatever the
batch, the chunking of its prompt and the thread count: a prompt's
prefill is its tokens decoded one by one, at a fraction of the calls. A
rope whose tables depend on the length reached sends prompt chunks to the
numpy step. Whether a chunk takes the C path depends on its own portal and
the model only, never on the other sequences.
"""

from __future__ import annotations

import collections
import functools
import inspect
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from czyx.inference.errors import InferenceError, ScopeRoutingError
from czyx.inference.kernels.linear import Weight, mm_t, take_rows
from czyx.inference.models.base import (
    F32,
    KVCache,
    attention,
    group_by_expert,
    matmul_small,
    silu,
    swiglu_columns,
    swiglu_fused,
)
from czyx.inference.options import SPECULATE_OFF, SpeculateOptions
from czyx.inference.routewatch import RouteFrame, StepWatch
from czyx.inference.sampling import Sampler, SamplingParams
from czyx.inference.speculative import SharedRowCost, Speculator, choose_tokens

_log = logging.getLogger("czyx.inference.batch")

#: Token columns per product: every matmul of the batched path has exactly this width.
BLOCK = 8


class BatchError(InferenceError):
    """A batching request was refused or could not run."""


class QueueFull(BatchError):
    """The scheduler's queue is full; try again later (HTTP 429)."""


class RequestTooLarge(BatchError):
    """A request's context alone exceeds the KV budget (it could never be admitted)."""


class SchedulerClosed(BatchError):
    """The scheduler has stopped; no request is accepted."""


# --------------------------------------------------------------------------- products


def _padded(x: np.ndarray) -> np.ndarray:
    """``x [T, C]`` zero-padded to a whole number of :data:`BLOCK` rows."""
    t = x.shape[0]
    tp = -(-t // BLOCK) * BLOCK
    if tp == t:
        return x
    out = np.zeros((tp, x.shape[1]), F32)
    out[:t] = x
    return out


def linear_rows(x: np.ndarray, w: Weight) -> np.ndarray:
    """``x @ w.T`` for ``x [T, C]`` with every row's result independent of the other rows.

    Float32 weights: blocks of :data:`BLOCK` tokens as columns through
    :func:`matmul_small` (one fixed shape). Packed (quantized) weights: the C
    kernels' single-row path, row by row.
    """
    t = x.shape[0]
    if not isinstance(w, np.ndarray):
        return np.concatenate([mm_t(x[r : r + 1], w) for r in range(t)], axis=0)
    xp = _padded(np.asarray(x, F32))
    out = np.empty((xp.shape[0], w.shape[0]), F32)
    for b in range(0, xp.shape[0], BLOCK):
        out[b : b + BLOCK] = matmul_small(w, np.ascontiguousarray(xp[b : b + BLOCK].T)).T
    return out[:t]


def expert_rows(x: np.ndarray, gate_up: Weight, down: Weight) -> np.ndarray:
    """One routed expert's SwiGLU over the rows ``x [n, H]`` that chose it (row-independent)."""
    n = x.shape[0]
    if not isinstance(gate_up, np.ndarray):
        return np.concatenate([swiglu_fused(x[r : r + 1], gate_up, down) for r in range(n)])
    xp = _padded(x)
    out = np.empty((xp.shape[0], down.shape[0]), F32)
    for b in range(0, xp.shape[0], BLOCK):
        out[b : b + BLOCK] = swiglu_columns(
            np.ascontiguousarray(xp[b : b + BLOCK].T), gate_up, down
        ).T
    return out[:n]


def _blockwise(fn: Callable[[np.ndarray, np.ndarray], np.ndarray], x: np.ndarray, y: np.ndarray):
    """``fn(x, y)`` over padded :data:`BLOCK`-row blocks (an architecture hook's products)."""
    t = x.shape[0]
    xp, yp = _padded(x), _padded(y)
    parts = [fn(xp[b : b + BLOCK], yp[b : b + BLOCK]) for b in range(0, xp.shape[0], BLOCK)]
    return np.concatenate(parts, axis=0)[:t]


# --------------------------------------------------------------------------- the step


def forward_batch(
    model,
    chunks: Sequence[np.ndarray],
    kvs: Sequence[KVCache],
    allowed: Sequence[np.ndarray | None] | None = None,
    c_decode: bool = True,
    all_logits: bool | Sequence[bool] = False,
) -> list[np.ndarray]:
    """One forward step over several sequences together.

    Parameters
    ----------
    model
        A :class:`~inference.models.decoder.MoEDecoder` (its expert cache is shared).
    chunks
        Per sequence, the token ids ``[T_s]`` it processes this step (a decode
        token or a prompt chunk), after its ``kvs[s].length`` cached positions.
    kvs
        Per sequence, its KV cache; each grows by its chunk's length.
    allowed
        Per sequence, None or ``bool [n_layers, n_experts]``: the experts its
        portal permits. Routing then picks the top-k among them only, the
        softmax (and so the weights) taken over the permitted experts alone
        (a portal's class/layer scope narrows routing, never reads outside it).
    c_decode
        Chunks (decode tokens and prompt chunks) take the engine's C decode where
        the model has it (the default); False runs every chunk through the numpy
        step (for comparison).
    all_logits
        Return every token's logits, not only the last one's (speculative
        decoding verifies a chunk of drafted tokens in one step: each token's
        logits are those of the same step without it, the head is row-independent);
        one flag for every sequence, or one per sequence.

    Returns
    -------
    list of numpy.ndarray
        Per sequence, the ``[V]`` float32 logits of its chunk's last token, or with
        ``all_logits`` the ``[T_s, V]`` logits of every token of its chunk.
    """
    if isinstance(all_logits, bool):
        every_row = [all_logits] * len(chunks)
    else:
        every_row = [bool(a) for a in all_logits]
        if len(every_row) != len(chunks):
            raise ValueError("forward_batch needs one all_logits flag per chunk")
    cfg = model.cfg
    if len(chunks) != len(kvs) or not chunks:
        raise ValueError("forward_batch needs one KV cache per chunk, and at least one chunk")
    ids = [np.asarray(c, np.int64).reshape(-1) for c in chunks]
    if any(c.size == 0 for c in ids):
        raise ValueError("forward_batch: a chunk is empty")
    every = ids[0] if len(ids) == 1 else np.concatenate(ids)  # checked at once, whatever the batch
    if (every.view(np.uint64) >= cfg.vocab_size).any():  # (a negative id: past any vocabulary)
        raise ValueError(f"token id out of range 0..{cfg.vocab_size - 1}")
    if allowed is not None and len(allowed) != len(ids):
        raise ValueError("forward_batch needs one allowed-experts entry per chunk")
    # A step with a watched sequence (inference.routewatch) is told each pass's chunks.
    segment = getattr(model.recorder, "segment", None)
    fast = []
    if c_decode and decodes_in_c(model):
        # Prompt chunks too, unless the rope's tables depend on the length reached.
        fast = [
            s
            for s, c in enumerate(ids)
            if (allowed is None or allowed[s] is None) and (c.size == 1 or not model._length_rope)
        ]
    if not fast:
        if segment is not None:
            segment(range(len(ids)), False)
        with model.kernel_threads():  # a prompt's quantized products on the engine's threads
            return _forward_rows(model, ids, kvs, allowed, all_logits=every_row)
    model.experts.advance(int(every.size))
    out: list[np.ndarray | None] = [None] * len(ids)
    if segment is not None:
        segment(fast, True)
    got = _forward_c(
        model, [ids[s] for s in fast], [kvs[s] for s in fast], [every_row[s] for s in fast]
    )
    for s, lg in zip(fast, got, strict=True):
        out[s] = lg
    rest = [s for s in range(len(ids)) if out[s] is None]
    if rest:
        sub = None if allowed is None else [allowed[s] for s in rest]
        if segment is not None:
            segment(rest, False)
        with model.kernel_threads():
            got = _forward_rows(
                model,
                [ids[s] for s in rest],
                [kvs[s] for s in rest],
                sub,
                False,
                [every_row[s] for s in rest],
            )
        for s, lg in zip(rest, got, strict=True):
            out[s] = lg
    return out  # type: ignore[return-value]


def decodes_in_c(model) -> bool:
    """Whether ``model`` decodes a token in the C kernels exactly as its engine does."""
    return (
        model.decode_in_c()
        and getattr(model, "_plain_routing", False)
        and model.route_mask is None
        and type(model).mlp_out is _base_mlp_out()
        and type(model).finish_logits is _base_finish_logits()
    )


@functools.cache
def _base_mlp_out():
    from czyx.inference.models.decoder import MoEDecoder

    return MoEDecoder.mlp_out


@functools.cache
def _base_finish_logits():
    from czyx.inference.models.decoder import MoEDecoder

    return MoEDecoder.finish_logits


def _forward_c(
    model, chunks: list[np.ndarray], kvs: Sequence[KVCache], all_logits: Sequence[bool] = ()
) -> list[np.ndarray]:
    """Chunks of tokens (a decode token, or a prompt chunk, per sequence) through the
    engine's C kernels, all at once.

    Every token is a row of the step. Per layer, whatever the number of rows:
    one C call runs every token's attention block (its own KV cache and
    position) and routing; a decode-only step's tokens together, a step with
    prompt chunks in waves of groups (:func:`_waves`: a prompt's tokens four at
    a time, one wave after another, so each attends to the ones before it).
    Then the union of every row's experts is acquired, each expert once
    (residents first; in parts of at most the cache's :attr:`max_acquire` when
    it exceeds that), and one C call per part runs every row's products with
    the part's experts, the last one each row's weighted sum over its top-k in
    its own order. The embedding and the
    head are one call each. The attention reads each weight row once for a
    group of up to four tokens, the MoE each held expert's rows once for the
    rows that chose it; every output is computed with the one-token kernels'
    operations (the multi-input row kernels give each (row, input) exactly the
    one-input result), so the arithmetic per token is
    :meth:`MoEDecoder._forward_one`'s: the logits and the KV written are the
    engine's decode, bit for bit, whatever the batch, the chunking of a prompt
    and the thread count. ``all_logits[q]``: every row's logits for chunk ``q``, ``[T, V]``.
    """
    if model._length_rope:  # (decode tokens only: forward_batch sends chunks elsewhere)
        got = _forward_c_each(model, [int(c[0]) for c in chunks], kvs)
        return [g[None] if a else g for g, a in zip(got, all_logits or [False] * len(got))]
    cfg = model.cfg
    kern = model.kernels()
    lens = [int(c.size) for c in chunks]
    starts = [kv.length for kv in kvs]
    for kv, s, t in zip(kvs, starts, lens, strict=True):
        kv.reserve(s + t)
    if max(lens) == 1:
        waves = None
        row_kv, row_pos, tokens = list(kvs), None, [int(c[0]) for c in chunks]
        last, rows = None, None  # one row a chunk: every row is its last
    else:
        waves, row_kv, row_pos, tokens, last, rows = _waves(chunks, kvs, starts, kern.pool.threads)
    n = len(tokens)
    bt = kern.begin_batch(row_kv, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, model.rotary, row_pos)
    kern.embed_batch(model.embed, tokens)
    h, x, idx, w = bt.h[:n], bt.x[:n], bt.idx[:n], bt.w[:n]
    cache = model.experts
    table = cache.table
    cap = cache.max_acquire
    window = model.trunk_window
    lookahead = getattr(cache, "lookahead", None)
    args = (model.rotary, cfg.rms_eps, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, *model._c_qkv)
    top_k, renorm = cfg.top_k, cfg.renormalize
    part_misses = top_k if MISSES_PER_PART is None else MISSES_PER_PART
    for i in range(cfg.n_layers):
        lw = window.layer(i) if window is not None else model.layers[i]
        if model.layer_hook is not None:
            model.layer_hook(i, h)
        kern.attention_batch(lw, i, n, cfg.sliding_windows[i], *args, top_k, renorm, waves)
        if lookahead is not None:
            lookahead(i, x)
        model.count_routes(i, idx, w)
        # The experts to hold: the engine's own acquire for one token (its top-k in
        # its order), else the union (hits first), each acquired once for the step,
        # every row's products with a part's experts kept until the last part sums them.
        held = idx[0] if n == 1 else kern.union(n, table[i])
        cuts = _acquire_parts(held, table[i], cap, part_misses) if n > 1 else (0, held.size)
        final = len(cuts) - 2
        for q in range(final + 1):
            part = None if final == 0 else "first" if q == 0 else "last" if q == final else "part"
            _moe_streamed(kern, cache, i, n, held[cuts[q] : cuts[q + 1]], part)
    for kv, s, t in zip(kvs, starts, lens, strict=True):
        kv.length = s + t
    if model.hidden_hook is not None:
        _hand_hidden(model, kvs, starts, bt.h, rows or [np.array([q]) for q in range(n)])
    if rows is not None and any(all_logits):  # those chunks' every row, others' last, in order
        picks = [r if a else r[-1:] for r, a in zip(rows, all_logits, strict=True)]
        if len(picks) > 1:  # (one chunk's every row: rows 0 .. n already, in order)
            order = np.concatenate(picks)
            bt.h[: order.size] = bt.h[order]
        ends = [0, *itertools.accumulate(p.size for p in picks)]
        logits = kern.head_batch(model.final_norm, model.lm_head, cfg.rms_eps, ends[-1]).copy()
        kern.pool.park()
        return [
            model.finish_logits(logits[a:b] if every else logits[a])
            for a, b, every in zip(ends[:-1], ends[1:], all_logits, strict=True)
        ]
    if last is not None:  # each chunk's last row into rows 0 .. len(chunks), for the head
        bt.h[: len(chunks)] = bt.h[last]
    logits = kern.head_batch(model.final_norm, model.lm_head, cfg.rms_eps, len(chunks)).copy()
    # The step's kernels are done: the pool's workers sleep now rather than spin
    # through the scheduler's sampling, events and (served) HTTP writes.
    kern.pool.park()
    return [model.finish_logits(lg) for lg in logits]


#: Misses a step acquires together past its hits (None: the model's top-k, a token's
#: worth; see :func:`_acquire_parts`). ``bench/bench_speculate.py --realshape
#: --rs-parts`` measures other values.
MISSES_PER_PART: int | None = None


def _acquire_parts(held: np.ndarray, resident: np.ndarray, cap: int, top_k: int) -> list[int]:
    """Where a step's acquires of one layer's experts ``held`` (its union, the resident
    ones first) begin and end: the resident experts in one, then the misses in parts of
    at most ``top_k`` (and of the cache's ``cap``).

    Why the misses go a token's worth at a time: acquired together, every miss takes a
    slot the cache kept (a verification step's union, several tokens' experts, can
    evict most of a small cache in one layer); in parts, a part's misses may replace
    the ones an earlier part read and computed, used once and now released, so the
    experts the cache kept across tokens stay (measured in ``bench/SPECULATE-realshape.md``).
    """
    size = held.size
    r = int(np.count_nonzero(resident[held] >= 0))
    if size - r <= top_k and size <= cap:
        return [0, size]
    step = max(1, min(top_k, cap))
    cuts = [0, *range(r if r else step, size, step), size]
    out = [0]
    for c in cuts[1:]:  # (the resident part too may exceed the cache: parts of cap)
        while c - out[-1] > cap:
            out.append(out[-1] + cap)
        if c > out[-1]:
            out.append(c)
    return out


def _moe_streamed(
    kern, cache, layer: int, n: int, held: np.ndarray, part: str | None = None
) -> None:
    """One acquire of a layer's MoE for the step's ``n`` rows: the experts ``held`` (at
    most the cache's ``max_acquire``), each row's residual added with the last part.

    The pipeline of the one-token decode (``MoEDecoder._routed_one``) for a batch:
    the acquire returns once the misses' reads are issued, every row's products
    with the resident experts are computed while they land, then each missing
    expert's as its bytes arrive. These calls are :meth:`DecodeKernels.moe_batch`'s
    parts (``part``: this acquire's own place among a layer's acquires when its
    experts exceed the cache), the weighted sums coming with the layer's last: the
    operations of one call, so the rows are bit-identical whatever the arrival order.
    """
    slots, pending = cache.acquire_streamed(layer, held)
    try:
        if not pending:  # every expert resident (each row's MoE, then its residual add)
            kern.moe_batch(cache, 0, n, held, slots, True, part)
            return
        late = np.zeros(held.size, bool)
        late[pending] = True
        order = np.concatenate([np.flatnonzero(~late), np.asarray(pending, np.int64)])
        experts, at = held[order], slots[order]
        # The resident experts together, then each read alone, in request order.
        cuts = [0, *range(max(held.size - len(pending), 1), held.size + 1)]
        opens = part in (None, "first")  # this acquire begins the layer's products
        closes = part in (None, "last")  # ... and ends them with the weighted sums
        for p in range(len(cuts) - 1):
            a, b = cuts[p], cuts[p + 1]
            if late[order[a]]:
                kern.pool.park()  # the workers would spin through the wait on the readers' core
                cache.wait_ready(int(order[a]))
            first, last = p == 0 and opens, p == len(cuts) - 2 and closes
            sub = None if first and last else "first" if first else "last" if last else "part"
            kern.moe_batch(cache, 0, n, experts[a:b], at[a:b], True, sub)
    finally:
        cache.release()


def _waves(chunks: list[np.ndarray], kvs: Sequence[KVCache], starts: list[int], threads: int):
    """The rows of a step with prompt chunks: ``((waves, groups), row caches, row
    positions, row tokens, each chunk's last row, each chunk's rows)``.

    A prompt chunk's tokens go in groups of up to four consecutive ones (a group's
    rows share each weight row and attend in order), its ``j``-th group in wave
    ``j``; the first wave also holds the one-token chunks, in groups of up to four
    sized so every thread has one (the batched decode's grouping). The groups of a
    wave name different caches, and each token's arithmetic is the one-token
    kernels' whatever its group: rows, groups and waves change only which weight
    rows are shared and what runs in parallel. The layout depends on the chunks'
    sizes alone (:func:`_wave_plan`, kept across steps): a step fills in its caches,
    positions and tokens.
    """
    waves, src, chunk, offset, last, rows = _wave_plan(tuple(c.size for c in chunks), threads)
    row_kv = [kvs[q] for q in chunk]
    row_pos = [starts[q] + j for q, j in zip(chunk, offset, strict=True)]
    every = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
    return waves, row_kv, row_pos, every[src].tolist(), last, rows


@functools.lru_cache(maxsize=256)
def _wave_plan(sizes: tuple[int, ...], threads: int):
    """:func:`_waves`' layout for chunks of ``sizes``: ``((waves, groups), each row's
    index into the chunks' concatenated tokens, its chunk, its offset in that chunk,
    each chunk's last row, each chunk's rows)``; read-only arrays, shared by the steps
    of that shape (a verification step's, a served batch's)."""
    single = [q for q, n in enumerate(sizes) if n == 1]
    multi = [q for q, n in enumerate(sizes) if n > 1]
    base = np.cumsum([0, *sizes[:-1]])
    chunk: list[int] = []
    offset: list[int] = []
    last = np.empty(len(sizes), np.int64)
    rows: list[list[int]] = [[] for _ in sizes]
    groups, waves = [0], [0]

    def put(q: int, j0: int, j1: int) -> None:  # tokens j0 .. j1 of chunk q, as rows
        for j in range(j0, j1):
            rows[q].append(len(chunk))
            chunk.append(q)
            offset.append(j)
        if j1 == sizes[q]:
            last[q] = len(chunk) - 1

    size = min(4, max(1, -(-len(single) // max(threads, 1))))
    for a in range(0, len(single), size):
        for q in single[a : a + size]:
            put(q, 0, 1)
        groups.append(len(chunk))
    for w in range(-(-max((sizes[q] for q in multi), default=0) // 4)):
        for q in multi:
            if 4 * w < sizes[q]:
                put(q, 4 * w, min(4 * w + 4, sizes[q]))
                groups.append(len(chunk))
        waves.append(len(groups) - 1)
    src = np.array([base[q] + j for q, j in zip(chunk, offset, strict=True)], np.int64)
    plan = (
        (np.array(waves, np.int64), np.array(groups, np.int64)),
        src,
        tuple(chunk),
        tuple(offset),
        last,
        [np.array(r, np.int64) for r in rows],
    )
    for arr in (*plan[0], src, last, *plan[5]):
        arr.flags.writeable = False
    return plan


def _forward_c_each(model, tokens: list[int], kvs: Sequence[KVCache]) -> list[np.ndarray]:
    """:func:`_forward_c` one token at a time, for a rope whose tables depend on the
    length reached (dynamic NTK, LongRoPE): each token's attention runs after its own
    tables are set (as :meth:`MoEDecoder.run_layers_one` sets them), so per layer
    each token is one attention, one routing and one MoE call of the one-token
    kernels. The arithmetic per token is :meth:`MoEDecoder._forward_one`'s.
    """
    cfg = model.cfg
    kern = model.kernels()
    n = len(tokens)
    hsz = cfg.hidden_size
    h = np.empty((n, hsz), F32)
    x = np.empty((n, hsz), F32)
    y = np.empty((n, hsz), F32)
    idx = np.empty((n, cfg.top_k), np.int64)
    w = np.empty((n, cfg.top_k), F32)
    starts = [kv.length for kv in kvs]
    for r, (tok, kv) in enumerate(zip(tokens, kvs, strict=True)):
        kv.reserve(starts[r] + 1)
        kern.embed(model.embed, tok)
        h[r] = kern.h
    cache = model.experts
    window = model.trunk_window
    lookahead = getattr(cache, "lookahead", None)
    qkv = model._c_qkv
    length_rope = model._length_rope
    for i in range(cfg.n_layers):
        lw = window.layer(i) if window is not None else model.layers[i]
        if model.layer_hook is not None:
            model.layer_hook(i, h)
        sw = cfg.sliding_windows[i]
        for r in range(n):
            np.copyto(kern.h, h[r])
            if length_rope:  # tables for this token's own length, as run_layers_one sets
                model.rotary._update(starts[r] + 1)
            kern.attention(
                lw, kvs[r].k[i], kvs[r].v[i], starts[r], sw, model.rotary, cfg.rms_eps,
                cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, *qkv,
            )  # fmt: skip
            h[r] = kern.h
            x[r] = kern.x
            kern.route(lw.router, cfg.top_k, cfg.renormalize)
            idx[r] = kern.idx
            w[r] = kern.w
        if lookahead is not None:
            lookahead(i, x)
        model.count_routes(i, idx, w)
        if n == 1:  # the engine's own acquire: the token's top-k, in its order
            slots = cache.acquire(i, idx[0])
            try:
                np.copyto(kern.x, x[0])
                kern.moe(cache, slots, w[0])
                y[0] = kern.y
            finally:
                cache.release()
            h += model.mlp_out(y)
            continue
        for r0, r1, order in _acquire_groups(idx, cache.table[i], cache.max_acquire):
            slots = cache.acquire(i, order)
            try:
                slot_of = np.full(cfg.n_experts, -1, np.int64)
                slot_of[order] = slots
                for r in range(r0, r1):
                    np.copyto(kern.x, x[r])
                    kern.moe(cache, np.ascontiguousarray(slot_of[idx[r]]), w[r])
                    y[r] = kern.y
            finally:
                cache.release()
        h += model.mlp_out(y)
    out = []
    if model.hidden_hook is not None:
        _hand_hidden(model, kvs, starts, h, [np.array([r]) for r in range(n)])
    for r, kv in enumerate(kvs):
        kv.length = starts[r] + 1
        np.copyto(kern.h, h[r])
        kern.head(model.final_norm, model.lm_head, cfg.rms_eps)
        out.append(model.finish_logits(kern.logits.copy()))
    return out


def _hand_hidden(
    model, kvs: Sequence[KVCache], starts: list[int], h: np.ndarray, rows: Sequence[np.ndarray]
) -> None:
    """Give ``model.hidden_hook`` each sequence's pre-norm rows (``h[rows[q]]``: its
    positions from ``starts[q]``), as the one-sequence forward does."""
    for kv, start, r in zip(kvs, starts, rows, strict=True):
        model.hidden_hook(kv, start, h[r])


def _acquire_groups(idx: np.ndarray, resident: np.ndarray, cap: int):
    """Rows of ``idx [n, k]`` in groups ``(r0, r1, experts)`` of consecutive rows whose
    distinct experts fit ``cap`` slots, each group's experts in acquire order
    (residents first, then by expert id).

    One group (every row) when the step's union fits; otherwise consecutive
    rows while their union still fits, so every token holds its whole top-k
    together.
    """
    uniq = np.unique(idx)
    if uniq.size <= cap:
        yield 0, idx.shape[0], uniq[np.argsort(resident[uniq] < 0, kind="stable")]
        return
    r0 = 0
    held: set[int] = set()
    for r, row in enumerate(idx.tolist()):
        if r > r0 and len(held.union(row)) > cap:
            g = np.array(sorted(held), np.int64)
            yield r0, r, g[np.argsort(resident[g] < 0, kind="stable")]
            r0, held = r, set()
        held.update(row)
    g = np.array(sorted(held), np.int64)
    yield r0, idx.shape[0], g[np.argsort(resident[g] < 0, kind="stable")]


def _forward_rows(
    model,
    ids: list[np.ndarray],
    kvs: Sequence[KVCache],
    allowed: Sequence[np.ndarray | None] | None,
    advance: bool = True,
    all_logits: Sequence[bool] = (),
) -> list[np.ndarray]:
    """The numpy step over ``ids`` (row-independent products in :data:`BLOCK` columns);
    the last token's logits per sequence, or with ``all_logits`` every token's."""
    cfg = model.cfg
    lens = [int(c.size) for c in ids]
    offs = np.concatenate([[0], np.cumsum(lens)]).astype(int)
    starts = [kv.length for kv in kvs]
    for kv, s, n in zip(kvs, starts, lens, strict=True):
        kv.reserve(s + n)
    positions = [np.arange(s, s + n) for s, n in zip(starts, lens, strict=True)]
    if advance:
        model.experts.advance(int(offs[-1]))
    h = take_rows(model.embed, np.concatenate(ids))
    window = model.trunk_window
    lookahead = getattr(model.experts, "lookahead", None)
    hooks = _hooks(model)
    for i, lw in enumerate(model.layers):
        if window is not None:
            lw = window.layer(i)
        if model.layer_hook is not None:
            model.layer_hook(i, h)
        x = model.norm(h, lw.input_norm, lw.input_norm_bias)
        if hooks.attention:
            # The architecture's own attention, one sequence at a time (its rows only,
            # so a sequence's result does not depend on what it is batched with).
            h = h + np.concatenate([
                model._attention(i, lw, x[offs[s] : offs[s + 1]], kv, starts[s], positions[s])
                for s, kv in enumerate(kvs)
            ])  # fmt: skip
        else:
            h = h + _attention(model, i, lw, x, kvs, starts, positions, offs)
        x = model.norm(h, lw.post_attn_norm, lw.post_attn_norm_bias)
        if not cfg.sparse_layers[i]:
            gate = linear_rows(x, lw.mlp_gate_proj)
            act = silu(gate) * linear_rows(x, lw.mlp_up_proj)
            h = h + model.mlp_out(linear_rows(act, lw.mlp_down_proj))
            continue
        if lookahead is not None:
            lookahead(i, x)
        masks = [None if a is None else a[i] for a in allowed] if allowed is not None else None
        if masks is not None and not hooks.route_mask and any(m is not None for m in masks):
            raise ScopeRoutingError(
                f"{type(model).__name__} cannot route under a scoped portal (its router has "
                "no mask)"
            )
        routed = _routed(model, i, lw, x, offs, masks, hooks.expert)
        if hooks.routed_extra:
            routed = _blockwise(lambda a, b, lw=lw: model.routed_extra(lw, a, b), x, routed)
        h = h + model.mlp_out(routed)
    for kv, s, n in zip(kvs, starts, lens, strict=True):
        kv.length = s + n
    if model.hidden_hook is not None:
        _hand_hidden(model, kvs, starts, h, [np.arange(a, b) for a, b in itertools.pairwise(offs)])
    if any(all_logits):  # every row of those sequences, the last of the others
        picks = [
            np.arange(offs[j], offs[j + 1]) if all_logits[j] else np.array([offs[j + 1] - 1])
            for j in range(len(ids))
        ]
        hn = model.norm(h[np.concatenate(picks)], model.final_norm, model.final_norm_bias)
        out = model.finish_logits(linear_rows(hn, model.lm_head))
        ends = np.cumsum([0, *(p.size for p in picks)])
        return [
            out[ends[j] : ends[j + 1]] if all_logits[j] else out[ends[j]] for j in range(len(ids))
        ]
    last = h[offs[1:] - 1]
    hn = model.norm(last, model.final_norm, model.final_norm_bias)
    out = model.finish_logits(linear_rows(hn, model.lm_head))
    return [out[j] for j in range(len(ids))]


@dataclass(frozen=True)
class _Hooks:
    """Which steps of a decoder its architecture overrides (the batch then calls them)."""

    attention: bool
    expert: bool
    routed_extra: bool
    route_mask: bool  # its route() takes a scoped portal's mask


def _hooks(model) -> _Hooks:
    return _class_hooks(type(model))


@functools.cache
def _class_hooks(cls: type) -> _Hooks:
    """The steps decoder class ``cls`` overrides; refuses one the batch cannot reproduce.

    The batched step re-implements the base decoder's layer with row-independent
    products and calls the architecture's own hooks for what it changes
    (attention, routing, one expert's MLP, the shared experts, the MLP output
    scale, the logits). An override of a step it cannot call per row group
    would be silently skipped, so it is refused instead.
    """
    from czyx.inference.models.decoder import ATTENTION_STEPS, MoEDecoder

    def over(name: str) -> bool:
        return getattr(cls, name, None) is not getattr(MoEDecoder, name, None)

    unsupported = [n for n in ("_mlp", "run_layers", "forward") if over(n)]
    if over("_routed") and not hasattr(cls, "_expert"):
        unsupported.append("_routed")
    if unsupported:
        raise BatchError(
            f"{cls.__name__}: batched serving cannot reproduce its {', '.join(unsupported)}"
        )
    masks = "mask" in inspect.signature(cls.route).parameters
    attention = any(map(over, ATTENTION_STEPS))  # then its own _attention, per sequence
    return _Hooks(attention, hasattr(cls, "_expert"), over("routed_extra"), masks)


def _attention(model, i, lw, x, kvs, starts, positions, offs) -> np.ndarray:
    """Projections batched (row-independent), RoPE and attention per sequence."""
    cfg = model.cfg
    q = linear_rows(x, lw.q_proj)
    k = linear_rows(x, lw.k_proj)
    v = linear_rows(x, lw.v_proj)
    q, k, v = model.finish_qkv(lw, q, k, v)  # biases, norms and clipping: per row
    hd = cfg.head_dim
    out = np.empty((x.shape[0], cfg.n_heads * hd), F32)
    for s, kv in enumerate(kvs):
        a, b = int(offs[s]), int(offs[s + 1])
        t = b - a
        qs = q[a:b].reshape(t, cfg.n_heads, hd).transpose(1, 0, 2)
        ks = k[a:b].reshape(t, cfg.n_kv_heads, hd).transpose(1, 0, 2)
        vs = v[a:b].reshape(t, cfg.n_kv_heads, hd).transpose(1, 0, 2)
        pos = positions[s]
        qs = model.rotary.apply(qs, pos)
        ks = model.rotary.apply(ks, pos)
        kv.write(i, starts[s], ks, vs)
        end = starts[s] + t
        out[a:b] = attention(qs, kv.k[i][:, :end], kv.v[i][:, :end], pos, cfg.sliding_windows[i])
    out = linear_rows(out, lw.o_proj)
    return out if lw.o_bias is None else out + lw.o_bias  # as the engine's _attention


def _routed(model, i: int, lw, x: np.ndarray, offs, masks, own_expert: bool) -> np.ndarray:
    """The routed experts of every token of the step: each distinct expert acquired once.

    Routing is the architecture's own (:meth:`route`), per sequence, with that
    sequence's ``masks`` entry (a scoped portal's permitted experts, or None);
    ``own_expert``: the architecture computes one expert itself (``_expert``).
    """
    cfg = model.cfg
    cache = model.experts
    routes = [
        model.route(lw, x[offs[s] : offs[s + 1]])
        if masks is None or masks[s] is None
        else model.route(lw, x[offs[s] : offs[s + 1]], masks[s])
        for s in range(len(offs) - 1)
    ]
    idx = np.concatenate([r[0] for r in routes])
    w = np.concatenate([r[1] for r in routes]).astype(F32, copy=False)
    model.count_routes(i, idx, w)
    t = x.shape[0]
    contrib = np.zeros((t, cfg.top_k, cfg.hidden_size), F32)
    # Residents first: a small budget then evicts only after the hits are used.
    pairs, counts, ends, order = group_by_expert(idx, cfg.n_experts, cache.table[i])
    wflat = w.reshape(-1)
    cflat = contrib.reshape(t * cfg.top_k, cfg.hidden_size)
    chunk = cache.max_acquire
    for c0 in range(0, len(order), chunk):
        group = order[c0 : c0 + chunk]
        slots = cache.acquire(i, group)
        try:
            for j, s in enumerate(slots.tolist()):
                gate_up, down = cache.weights(s)
                e = int(group[j])
                sel = pairs[ends[e] - counts[e] : ends[e]]
                xe = x[sel // cfg.top_k]
                if model.weight_expert_input:  # Llama 4: the weight scales the input
                    xe = xe * wflat[sel, None]
                if own_expert:
                    y = _blockwise(
                        lambda a, _b, e=e, g=gate_up, d=down: model._expert(i, e, a, g, d), xe, xe
                    )
                else:
                    y = expert_rows(xe, gate_up, down)
                cflat[sel] = y if model.weight_expert_input else y * wflat[sel, None]
        finally:
            cache.release()
    return contrib.sum(axis=1)  # fixed top-k order, as the single-sequence path


# --------------------------------------------------------------------------- scheduler


def _copy_kv(dst: KVCache, src: KVCache, n: int) -> None:
    """The first ``n`` positions of ``src`` into ``dst`` (which then holds exactly them).

    A hybrid model's cache (:class:`~inference.models.deltanet.HybridCache`) copies
    itself, recurrent state included, and only whole (its state exists only there).
    """
    copy_from = getattr(dst, "copy_from", None)
    if copy_from is not None:
        copy_from(src, n)
        return
    for i in range(len(src.k)):
        dst.k[i][:, :n] = src.k[i][:, :n]
        dst.v[i][:, :n] = src.v[i][:, :n]
    dst.length = n


@dataclass(frozen=True)
class BatchOptions:
    """How a :class:`Scheduler` admits and steps sequences.

    Attributes
    ----------
    max_batch
        Sequences active (holding KV) at once.
    max_queue
        Requests waiting for admission; one more is refused (:class:`QueueFull`).
    prefill_chunk
        Prompt tokens a sequence processes per step (fixed: its chunk
        boundaries, and so its results, never depend on the other sequences).
    step_tokens
        Tokens per step at most: every decode token, then prefill chunks in
        arrival order while they fit (at least one chunk per step).
    kv_bytes
        KV memory budget over the active sequences; a sequence reserves its
        whole context (prompt + max_tokens) at admission. None: unbounded.
    prefix_cache_bytes
        Memory for the KV of finished prompts kept for reuse: a new prompt
        sharing a prefix with one of them starts from its KV instead of
        recomputing it. Only whole prefill chunks from position 0 are reused,
        so the reused positions are exactly those the new sequence would have
        computed (same tokens, same chunk boundaries): results do not change.
        0: no reuse.
    c_decode
        Decode tokens and prompt chunks take the engine's C decode where the
        architecture has it (:func:`forward_batch`); False: the numpy step for
        every chunk (the batched path before it, kept for comparison; results
        then differ from the engine's decode by rounding, still independent of
        the batch).
    speculate
        Speculative decoding of a request that asks nothing else (``czyx serve
        --speculate``): ``off`` or ``lookup`` (prompt lookup; a draft version is
        not served). A decoding sequence's drafts ride in the step as extra rows
        of its chunk, verified together with every other sequence's work.
    """

    max_batch: int = 16
    max_queue: int = 64
    prefill_chunk: int = 32
    step_tokens: int = 256
    kv_bytes: int | None = None
    prefix_cache_bytes: int = 0
    c_decode: bool = True
    speculate: SpeculateOptions = SPECULATE_OFF

    def __post_init__(self) -> None:
        served_speculation(self.speculate)
        if self.max_batch < 1:
            raise ValueError(f"max_batch {self.max_batch} must be at least 1")
        if self.max_queue < 0:
            raise ValueError(f"max_queue {self.max_queue} is negative")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk {self.prefill_chunk} must be at least 1")
        if self.step_tokens < 1:
            raise ValueError(f"step_tokens {self.step_tokens} must be at least 1")
        if self.kv_bytes is not None and self.kv_bytes <= 0:
            raise ValueError(f"kv budget {self.kv_bytes} B must be positive")
        if self.prefix_cache_bytes < 0:
            raise ValueError(f"prefix cache {self.prefix_cache_bytes} B is negative")


def served_speculation(options: SpeculateOptions) -> None:
    """Refuse what the scheduler cannot speculate with (a draft version, the MTP layer)."""
    if options.draft_ref is not None or options.mode == "mtp":
        raise ValueError(
            f"speculate: {options.mode} is not served (the server drafts by prompt lookup: "
            "off or lookup)"
        )


@dataclass(frozen=True)
class Token:
    """Event: a sequence chose ``token`` (``index``: 0 for its first generated token)."""

    token: int
    index: int
    time: float


@dataclass(frozen=True)
class FinalState:
    """A finished sequence kept for saving (``keep_state``): every token of its history
    (restored, prompt, generated) is in ``kv``, and ``logits`` are the next position's."""

    tokens: list[int]
    kv: KVCache
    logits: np.ndarray
    sampler: Sampler


@dataclass(frozen=True)
class Done:
    """Event: a sequence ended. ``reason``: "stop" (end-of-sequence id), "length",
    "cancelled" or "error" (then ``error`` says why). ``restored``: positions it
    resumed from a saved state instead of computing; ``final``: its state when
    submitted with ``keep_state`` (and it ended by "stop" or "length")."""

    reason: str
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    restored: int = 0
    final: FinalState | None = None
    reused: int = 0  # prompt positions taken from the prefix cache


Event = Token | Done | RouteFrame  # (RouteFrame: only to a sequence submitted with watch)


class Handle:
    """A submitted request: its events (a thread-safe queue) and :meth:`cancel`.

    ``on_event`` (when given at submit) is called from the scheduler's thread
    with each event as well; it must not block.
    """

    def __init__(self, rid: int, scheduler: Scheduler, on_event: Callable[[Event], None] | None):
        import queue

        self.id = rid
        self._scheduler = scheduler
        # A SimpleQueue: its put is one C call (no Python condition), and the
        # scheduler's thread makes one per generated token.
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._on_event = on_event
        self.cancelled = False
        self.submitted = time.perf_counter()

    def _emit(self, ev: Event) -> None:
        self._events.put(ev)
        if self._on_event is not None:
            self._on_event(ev)

    def cancel(self) -> None:
        """Stop the request: its sequence (and KV) is freed before the next step."""
        self.cancelled = True
        self._scheduler._wake()

    def events(self, timeout: float = 60.0):
        """Yield events until :class:`Done`; each wait is bounded by ``timeout`` seconds."""
        import queue

        while True:
            try:
                ev = self._events.get(timeout=timeout)
            except queue.Empty:
                raise BatchError(f"request {self.id}: no event in {timeout} s") from None
            yield ev
            if isinstance(ev, Done):
                return

    def result(self, timeout: float = 60.0) -> tuple[list[int], Done]:
        """Every generated token and the final :class:`Done` (blocking, bounded)."""
        toks: list[int] = []
        for ev in self.events(timeout):
            if isinstance(ev, Token):
                toks.append(ev.token)
            elif isinstance(ev, Done):
                return toks, ev
        raise BatchError("unreachable")  # pragma: no cover


@dataclass
class _Seq:
    handle: Handle
    prompt: np.ndarray
    max_tokens: int
    sampler: Sampler
    eos: frozenset[int]
    kv_need: int
    kv: KVCache | None = None
    fed: int = 0  # prompt tokens already processed
    generated: list[int] = field(default_factory=list)
    history: tuple[np.ndarray, KVCache] | None = None  # restored (tokens, KV)
    keep_state: bool = False
    closing: str | None = None  # keep_state: the end reason, once the last token is fed
    reused: int = 0  # prompt positions taken from the prefix cache
    allowed: np.ndarray | None = None  # bool [n_layers, n_experts] a scoped portal permits
    watch: bool = False  # a RouteFrame before each decode step's Token (routewatch)
    spec: Speculator | None = None  # speculative decoding (prompt lookup), or None
    text: list[int] = field(default_factory=list)  # with spec: every token so far
    drafts: list[int] = field(default_factory=list)  # this step's drafted tokens


@dataclass(frozen=True)
class SchedulerStats:
    """Counters of a scheduler (a snapshot)."""

    waiting: int
    active: int
    steps: int
    step_tokens: int  # tokens processed over all steps
    decode_tokens: int  # decode-step tokens (generated after the first of each sequence)
    generated: int  # tokens generated (sampled)
    last_batch: int  # sequences in the last step
    kv_used: int
    kv_budget: int | None
    busy_seconds: float  # time spent in forward steps
    prefix_hits: int = 0  # sequences that started from a cached prefix
    prefix_tokens: int = 0  # prompt positions reused instead of computed
    prefix_entries: int = 0
    prefix_bytes: int = 0
    drafted: int = 0  # tokens drafted (speculative decoding)
    accepted: int = 0  # drafted tokens accepted


@dataclass
class StepCounters:
    """A scheduler's running step totals (updated under its lock): the fields of
    :class:`SchedulerStats` that every scheduler counts the same way."""

    steps: int = 0
    step_tokens: int = 0
    decode_tokens: int = 0
    generated: int = 0
    busy_seconds: float = 0.0

    def step(self, tokens: int, seconds: float) -> None:
        """One forward step over ``tokens`` tokens, computed in ``seconds``."""
        self.steps += 1
        self.step_tokens += tokens
        self.busy_seconds += seconds


class Scheduler:
    """Continuous batching over one model: a worker thread stepping every active sequence.

    Parameters
    ----------
    model
        The decoder (``Engine.model``); its expert cache is shared by all sequences.
    options
        :class:`BatchOptions`.
    on_step
        Called (from the worker) after each step with ``(sequences, tokens, seconds)``.
    driven
        False (the default): the scheduler steps on a worker thread of its own.
        True: it starts no thread; its owner calls :meth:`step_once` while there
        is work (an event loop, say, that would otherwise pay a thread hop per
        step to receive the events). Events, ``on_step`` and the end of every
        sequence then happen on the caller's thread, inside :meth:`step_once`.
    on_wake
        Called after a change that may give the scheduler work (a submit, a
        cancel, :meth:`close`), on the thread that made it: a driver's cue to
        call :meth:`step_once` again. Must not block.
    """

    def __init__(
        self,
        model,
        options: BatchOptions = BatchOptions(),
        on_step: Callable[[int, int, float], None] | None = None,
        *,
        driven: bool = False,
        on_wake: Callable[[], None] | None = None,
    ) -> None:
        _hooks(model)  # an architecture the batched step cannot reproduce: refused now
        self.model = model
        self.options = options
        self.on_step = on_step
        cfg = model.cfg
        # A hybrid model keeps KV in its attention layers only, plus a fixed recurrent state.
        self.kv_bytes_per_token = 2 * model.kv_layers * cfg.n_kv_heads * cfg.head_dim * 4
        self.kv_bytes_fixed = int(model.recurrent_nbytes)
        self._lock = threading.Condition()
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._active: list[_Seq] = []
        self._ids = itertools.count(1)
        self._closed = False
        self._kv_used = 0
        self._counts = StepCounters()
        self._row_cost = SharedRowCost()  # what a drafted row costs in these steps
        self._last_batch = 0
        # Finished prompts' KV, oldest first: (prompt ids, KV cache, reusable positions).
        self._prefixes: collections.OrderedDict[int, tuple[np.ndarray, KVCache, int]] = (
            collections.OrderedDict()
        )
        self._prefix_bytes = 0
        self._prefix_hits = self._prefix_tokens = 0
        # Sequences submitted with watch, not yet finished: a step looks at this count
        # only, so requests that do not watch pay nothing per token.
        self._watching = 0
        self._drafted = self._accepted = 0
        self.on_wake = on_wake
        self._thread: threading.Thread | None = None
        if not driven:
            self._thread = threading.Thread(target=self._run, name="czyx-batch", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ public

    def submit(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        sampling: SamplingParams = SamplingParams(),  # noqa: B008 - frozen
        eos_ids: Sequence[int] = (),
        on_event: Callable[[Event], None] | None = None,
        history: tuple[Sequence[int], KVCache] | None = None,
        keep_state: bool = False,
        allowed: np.ndarray | None = None,
        watch: bool = False,
        speculate: SpeculateOptions | None = None,
    ) -> Handle:
        """Queue a request; its events follow on the returned :class:`Handle`.

        ``history`` resumes a saved sequence: its tokens and a KV cache holding
        exactly them; the prompt continues after them (nothing recomputed).
        ``keep_state``: once the sequence ends, its last token is fed too (one
        more step), so :class:`Done` carries a complete :class:`FinalState` to save.
        ``allowed``: ``bool [n_layers, n_experts]``, the experts this request may
        route to (a scoped portal); each sparse layer must keep at least top-k.
        ``watch``: before each decode step's :class:`Token`, a
        :class:`~czyx.inference.routewatch.RouteFrame` with the routing of the token
        that step fed (the live expert view; requests without it pay nothing for it).
        ``speculate``: this request's speculative decoding (None: the options'
        default); greedy tokens are unchanged, sampled ones keep their
        distribution. Not with ``keep_state``, nor on a model whose rope depends
        on the length reached (those decode without drafts).

        Raises
        ------
        QueueFull
            ``max_queue`` requests already wait.
        RequestTooLarge
            Its context (prompt + max_tokens) exceeds the whole KV budget.
        ValueError
            An empty prompt, a token id outside the vocabulary, ``max_tokens < 1``.
        """
        ids = np.asarray(list(prompt), np.int64)
        vocab = self.model.cfg.vocab_size
        if ids.size == 0:
            raise ValueError("the prompt is empty: nothing to condition on")
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"prompt token id out of range 0..{vocab - 1}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens {max_tokens} must be at least 1")
        if allowed is not None:
            cfg = self.model.cfg
            allowed = np.asarray(allowed, bool)
            if allowed.shape != (cfg.n_layers, cfg.n_experts):
                raise ValueError(
                    f"allowed experts of shape {allowed.shape}, the model has "
                    f"{(cfg.n_layers, cfg.n_experts)}"
                )
            counts = allowed.sum(axis=1)
            short = [i for i, s in enumerate(cfg.sparse_layers) if s and counts[i] < cfg.top_k]
            if short:
                raise ValueError(
                    f"the permitted experts leave layer {short[0]} with {int(counts[short[0]])}, "
                    f"fewer than top-{cfg.top_k}"
                )
        hist = None
        if history is not None:
            h_ids = np.asarray(list(history[0]), np.int64)
            if history[1].length != h_ids.size:
                raise ValueError(
                    f"history of {h_ids.size} tokens with a KV cache of {history[1].length}"
                )
            hist = (h_ids, history[1])
        spec_opts = self.options.speculate if speculate is None else speculate
        served_speculation(spec_opts)
        spec = None
        if spec_opts.enabled and not keep_state and not self.model._length_rope:
            spec = Speculator.lookup(spec_opts, measure=False)  # step times are shared
        restored = 0 if hist is None else int(hist[0].size)
        need = (restored + int(ids.size) + int(max_tokens) + 1) * self.kv_bytes_per_token
        need += self.kv_bytes_fixed
        budget = self.options.kv_bytes
        if budget is not None and need > budget:
            raise RequestTooLarge(
                f"context of {restored} + {ids.size} + {max_tokens} tokens needs {need} B of KV, "
                f"over the budget of {budget} B"
            )
        with self._lock:
            if self._closed:
                raise SchedulerClosed("the scheduler is closed")
            if len(self._waiting) >= self.options.max_queue and not self._can_admit_now(need):
                raise QueueFull(
                    f"{len(self._waiting)} requests wait and {len(self._active)} run: queue full"
                )
            h = Handle(next(self._ids), self, on_event)
            seq = _Seq(h, ids, int(max_tokens), Sampler(sampling), frozenset(eos_ids), need)
            seq.history = hist
            seq.keep_state = bool(keep_state)
            seq.allowed = allowed
            seq.watch = bool(watch)
            self._watching += seq.watch
            if spec is not None:
                seq.spec = spec
                seq.text = [*([] if hist is None else hist[0].tolist()), *ids.tolist()]
            self._waiting.append(seq)
            self._lock.notify_all()
        if self.on_wake is not None:
            self.on_wake()
        return h

    def stats(self) -> SchedulerStats:
        """A snapshot of the counters."""
        with self._lock:
            return SchedulerStats(
                waiting=len(self._waiting),
                active=len(self._active),
                last_batch=self._last_batch,
                kv_used=self._kv_used,
                kv_budget=self.options.kv_bytes,
                **asdict(self._counts),
                prefix_hits=self._prefix_hits,
                prefix_tokens=self._prefix_tokens,
                prefix_entries=len(self._prefixes),
                prefix_bytes=self._prefix_bytes,
                drafted=self._drafted,
                accepted=self._accepted,
            )

    def close(self, timeout: float = 30.0) -> None:
        """Stop: every pending sequence ends "cancelled"; waits for the worker (bounded).

        A driven scheduler ends them now, on the calling thread: call it from the
        driver's thread (or once the driver stopped), never during its :meth:`step_once`.
        """
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        else:
            self.step_once()
        if self.on_wake is not None:
            self.on_wake()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (no request is accepted)."""
        return self._closed

    def step_once(self) -> bool:
        """One iteration of the worker's loop, on the calling thread: drop cancelled
        sequences, admit waiting ones, plan and run one step (its events emitted here).

        For a ``driven`` scheduler (its owner's loop calls it while it returns True;
        :attr:`on_wake` says when to start again). Returns False when there was no
        work (nothing active or admissible, or closed: then every pending sequence
        ended "cancelled"), True when it ran a step.
        """
        with self._lock:
            work = self._take_work()
        if not work:
            return False
        self._step(work)
        return True

    # ------------------------------------------------------------------ worker

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify_all()
        if self.on_wake is not None:
            self.on_wake()

    def _can_admit_now(self, need: int) -> bool:
        """Whether a new request would be admitted at the next step (nothing ahead of it)."""
        if self._waiting or len(self._active) >= self.options.max_batch:
            return False
        budget = self.options.kv_bytes
        return budget is None or self._kv_used + need <= budget

    def _admit(self) -> None:
        """Move waiting requests to active while sequences and KV allow (FIFO, no skipping)."""
        budget = self.options.kv_bytes
        while self._waiting and len(self._active) < self.options.max_batch:
            seq = self._waiting[0]
            if budget is not None and self._kv_used + seq.kv_need > budget:
                break
            self._waiting.popleft()
            self._kv_used += seq.kv_need
            restored = 0 if seq.history is None else int(seq.history[0].size)
            cap = restored + int(seq.prompt.size + seq.max_tokens) + 1
            seq.kv = self.model.new_kv(capacity=cap)
            if seq.history is not None:
                _copy_kv(seq.kv, seq.history[1], restored)
            else:
                self._reuse_prefix(seq)
            self._active.append(seq)

    # -- prefix reuse (under the lock) ---------------------------------------------------

    def _reusable(self, n_prompt: int) -> int:
        """Positions of a prompt of ``n_prompt`` tokens that whole chunks cover, leaving
        at least its last token to compute (its logits are the first sample's)."""
        c = self.options.prefill_chunk
        return (max(n_prompt - 1, 0) // c) * c

    def _reuse_prefix(self, seq: _Seq) -> None:
        """Start ``seq`` from the longest cached prefix of its prompt (whole chunks only)."""
        if not self._prefixes:
            return
        limit = self._reusable(int(seq.prompt.size))
        best, best_key = 0, None
        for key, (ids, _, valid) in self._prefixes.items():
            m = min(limit, valid, int(ids.size))
            if m <= best:
                continue
            neq = np.flatnonzero(ids[:m] != seq.prompt[:m])
            common = int(neq[0]) if neq.size else m
            common -= common % self.options.prefill_chunk
            if common > best:
                best, best_key = common, key
        if best_key is None:
            return
        _, kv, _ = self._prefixes[best_key]
        self._prefixes.move_to_end(best_key)
        _copy_kv(seq.kv, kv, best)
        seq.fed = best
        seq.reused = best
        self._prefix_hits += 1
        self._prefix_tokens += best

    def _keep_prefix(self, seq: _Seq) -> None:
        """Keep a finished sequence's KV for reuse (its chunk-aligned prompt part)."""
        budget = self.options.prefix_cache_bytes
        c = self.options.prefill_chunk
        valid = min(int(seq.prompt.size) // c * c, int(seq.fed))  # whole chunks only
        if budget <= 0 or seq.kv is None or seq.history is not None or valid <= 0:
            return
        if hasattr(seq.kv, "recurrent_arrays"):
            return  # a hybrid cache's recurrent state exists at its end only, not at `valid`
        kv = seq.kv
        nbytes = sum(int(a.nbytes) for a in (*kv.k, *kv.v))
        if nbytes > budget:
            return
        self._prefixes[seq.handle.id] = (seq.prompt.copy(), kv, valid)
        self._prefix_bytes += nbytes
        while self._prefix_bytes > budget and self._prefixes:
            _, (_, old, _) = self._prefixes.popitem(last=False)
            self._prefix_bytes -= sum(int(a.nbytes) for a in (*old.k, *old.v))

    def _finish(
        self, seq: _Seq, reason: str, error: str | None = None, final: FinalState | None = None
    ) -> None:
        if seq.watch:
            seq.watch = False
            self._watching -= 1
        if seq.kv is not None:
            self._kv_used -= seq.kv_need
            if reason in ("stop", "length") and final is None:
                self._keep_prefix(seq)  # (a saved state's KV belongs to its FinalState)
            seq.kv = None
        restored = 0 if seq.history is None else int(seq.history[0].size)
        seq.history = None
        seq.handle._emit(
            Done(
                reason, int(seq.prompt.size), len(seq.generated), error, restored, final, seq.reused
            )
        )

    def _end(self, seq: _Seq, reason: str) -> None:
        """End by "stop"/"length": at once, or (``keep_state``) after feeding the last token."""
        if seq.keep_state:
            seq.closing = reason  # the next step feeds the last token, then finishes
            return
        self._active.remove(seq)
        self._finish(seq, reason)

    def _reap_cancelled(self) -> None:
        for seq in [s for s in self._waiting if s.handle.cancelled]:
            self._waiting.remove(seq)
            self._finish(seq, "cancelled")
        for seq in [s for s in self._active if s.handle.cancelled]:
            self._active.remove(seq)
            self._finish(seq, "cancelled")

    def _plan(self) -> list[tuple[_Seq, np.ndarray]]:
        """This step's work: every decoding sequence's token, then prefill chunks that fit.

        A greedy sequence's draft length weighs the row cost measured on the shared
        steps (:class:`SharedRowCost`; its tokens do not depend on the lengths); a
        sampled one's follows its acceptance alone, so its seed reproduces it."""
        work: list[tuple[_Seq, np.ndarray]] = []
        budget = self.options.step_tokens
        decoding = [s for s in self._active if s.fed == s.prompt.size and s.generated]
        row_cost = None  # fitted once a greedy drafter asks (a step without drafting: never)
        for seq in decoding:
            seq.drafts = []
            if seq.spec is not None and seq.closing is None:
                if seq.sampler.params.temperature == 0.0:
                    if row_cost is None:
                        row_cost = self._row_cost.cost(len(decoding))
                    seq.spec.length.cost = row_cost
                room = min(seq.max_tokens - len(seq.generated), budget) - 1
                k = min(seq.spec.length.next(), room)
                if k > 0:
                    seq.drafts = seq.spec.drafter.propose(seq.text, k)[:k]
            work.append((seq, np.array([seq.generated[-1], *seq.drafts], np.int64)))
            budget -= 1 + len(seq.drafts)
        for seq in self._active:
            if seq.fed < seq.prompt.size:
                chunk = seq.prompt[seq.fed : seq.fed + self.options.prefill_chunk]
                if work and chunk.size > budget:
                    break
                work.append((seq, chunk))
                budget -= chunk.size
        return work

    def _take_work(self) -> list[tuple[_Seq, np.ndarray]] | None:
        """Under the lock: reap cancelled sequences, admit, plan. None once closed (every
        pending sequence then ended "cancelled")."""
        self._reap_cancelled()
        if self._closed:
            for seq in [*self._waiting, *self._active]:
                self._finish(seq, "cancelled")
            self._waiting.clear()
            self._active.clear()
            return None
        self._admit()
        return self._plan()

    def _run(self) -> None:
        while True:
            with self._lock:
                work = self._take_work()
                if work is None:
                    return
                if not work:
                    self._lock.wait(timeout=1.0)
                    continue
            self._step(work)

    def _step(self, work: list[tuple[_Seq, np.ndarray]]) -> None:
        try:
            self._step_work(work)
        except Exception as exc:  # fail closed: the step's sequences end with the error
            # (a read that failed its checksum, or a bug: logged either way; none hangs)
            _log.exception("a scheduler step failed; its sequences end with the error")
            with self._lock:
                for seq, _ in work:
                    if seq in self._active:
                        self._active.remove(seq)
                        self._finish(seq, "error", f"{type(exc).__name__}: {exc}")

    def _step_work(self, work: list[tuple[_Seq, np.ndarray]]) -> None:
        t0 = time.perf_counter()
        allowed = [s.allowed for s, _ in work]
        verify = [bool(s.drafts) and s.fed == s.prompt.size for s, _ in work]
        tracked = [s.kv for (s, _), v in zip(work, verify, strict=True) if v]
        for kv in tracked:  # the positions a verify reaches: where its rejections cut back to
            kv.track()
        watch = self._watch_step(work) if self._watching else None
        try:
            logits = forward_batch(
                self.model,
                [c for _, c in work],
                [s.kv for s, _ in work],
                allowed if any(a is not None for a in allowed) else None,
                self.options.c_decode,
                verify if any(verify) else False,
            )
        finally:
            for kv in tracked:
                kv.track(False)
            if watch is not None:
                self.model.recorder = watch[0]
        now = time.perf_counter()
        n_tokens = sum(int(c.size) for _, c in work)
        if watch is not None:
            self._emit_frames(work, watch, n_tokens, now - t0)
        with self._lock:
            self._counts.step(n_tokens, now - t0)
            if all(s.fed == s.prompt.size for s, _ in work):  # a decode step: it prices a row
                self._row_cost.add(n_tokens, now - t0)
            self._last_batch = len(work)
            for (seq, chunk), lg in zip(work, logits, strict=True):
                if seq.closing is not None:  # its last token is now in the KV: keep the state
                    hist = [] if seq.history is None else seq.history[0].tolist()
                    final = FinalState(
                        [*hist, *seq.prompt.tolist(), *seq.generated], seq.kv, lg, seq.sampler
                    )
                    self._active.remove(seq)
                    self._finish(seq, seq.closing, final=final)
                    continue
                decoding = seq.fed == seq.prompt.size
                if decoding and seq.drafts:
                    self._verify(seq, chunk, lg, now)
                    continue
                if decoding:
                    self._counts.decode_tokens += 1
                else:
                    seq.fed += int(chunk.size)
                    if seq.fed < seq.prompt.size:
                        continue  # more prompt to go: no token yet
                if seq.handle.cancelled:
                    continue  # reaped before the next step
                try:
                    tok = seq.sampler(lg)
                except Exception as exc:  # fail closed: this sequence alone ends, with the error
                    self._active.remove(seq)
                    self._finish(seq, "error", f"{type(exc).__name__}: {exc}")
                    continue
                self._emit_token(seq, tok, now)
        if self.on_step is not None:
            self.on_step(len(work), n_tokens, now - t0)

    def _watch_step(self, work: list[tuple[_Seq, np.ndarray]]):
        """A step with watching sequences: their decode chunks get a route recorder for the
        step. Returns (the recorder it replaced, the watch, the cache counters before) or
        None when no watched sequence decodes this step."""
        watched = [j for j, (s, c) in enumerate(work) if s.watch and c.size == 1 and s.generated]
        if not watched:
            return None
        model = self.model
        cache = model.experts
        sw = StepWatch(cache, [int(c.size) for _, c in work], watched)
        before = (int(cache.bytes_read), int(cache.hits), int(cache.misses))
        prev, model.recorder = model.recorder, sw
        return prev, sw, before

    def _emit_frames(self, work, watch, n_tokens: int, seconds: float) -> None:
        """Each watched decode chunk's :class:`RouteFrame`, before the step's tokens."""
        _, sw, (b0, h0, m0) = watch
        cache = self.model.experts
        step = {
            "step_sequences": len(work),
            "step_tokens": n_tokens,
            "bytes_read": int(cache.bytes_read) - b0,
            "hits": int(cache.hits) - h0,
            "misses": int(cache.misses) - m0,
            "seconds": seconds,
        }
        for j in sorted(sw.kept):
            seq, chunk = work[j]
            index = len(seq.generated) - 1
            seq.handle._emit(sw.frame(j, index, int(chunk[0]), **step))

    def _emit_token(self, seq: _Seq, tok: int, now: float) -> bool:
        """Under the lock: ``seq`` chose ``tok``; True when that ended it."""
        seq.generated.append(tok)
        if seq.spec is not None:
            seq.text.append(tok)
        self._counts.generated += 1
        seq.handle._emit(Token(tok, len(seq.generated) - 1, now))
        if tok in seq.eos:
            self._end(seq, "stop")
            return True
        if len(seq.generated) >= seq.max_tokens:
            self._end(seq, "length")
            return True
        return False

    def _verify(self, seq: _Seq, chunk: np.ndarray, rows: np.ndarray, now: float) -> None:
        """Under the lock: a decoding sequence's pending token and drafts were stepped;
        ``rows`` are their logits. The tokens are chosen as
        :func:`~czyx.inference.speculative.speculative_decode` chooses them (each
        draft by :meth:`Sampler.verify` until one is rejected, then the last row's
        token when none was), and the KV of the rejected drafts is cut back."""
        drafts, seq.drafts = seq.drafts, []
        if seq.handle.cancelled:
            return  # reaped before the next step
        keep = seq.kv.length - int(chunk.size) + 1  # the pending token's position, kept

        def emit(tok: int) -> bool:
            self._counts.decode_tokens += 1
            return self._emit_token(seq, tok, now)

        try:
            accepted, kept, ended = choose_tokens(seq.sampler, rows.__getitem__, drafts, emit)
            keep += kept
        except Exception as exc:  # fail closed: this sequence alone ends, with the error
            if seq in self._active:
                self._active.remove(seq)
                self._finish(seq, "error", f"{type(exc).__name__}: {exc}")
            return
        self._drafted += len(drafts)
        self._accepted += accepted
        seq.spec.length.update(len(drafts), accepted)
        if not ended and seq.kv is not None and seq.kv.length > keep:
            seq.kv.truncate(keep)
