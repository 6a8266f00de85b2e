"""The Python face of ``inference._czk``: thread pool, weight descriptors, decode calls.

Scope: wrapping the engine's decode kernels (``inference/kernels/czk.c``) so a
decode step costs a few C calls per layer: :class:`Pool` owns the engine's
threads; :func:`describe` fills a C descriptor for a weight as held (a float32,
float16 or bfloat16 array, or a packed q2/q3/q4/q8 :class:`PackedMatrix`)
without copying it; :class:`ExpertTable` describes every slot of an expert
cache once (a slot's views follow whatever is later read into it);
:class:`DecodeKernels` holds one decoder's preallocated buffers and runs the
attention block, the routing, the MoE layer and the head of one token, or of
a batch of tokens each from its own sequence (its ``*_batch`` methods on a
:class:`DecodeBatch`: one call per layer for the whole batch, each token
computed by the one-token kernels on one of the pool's threads, so exactly as
alone).

The numerics of each call are stated in ``czk.c``; results do not depend on
the thread count. Without the compiled extension :func:`have_czk` is False
and the decoder keeps its numpy path.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from czyx.inference.errors import InferenceError
from czyx.inference.kernels.ops import PackedMatrix

try:
    from czyx.inference._czk import ffi as _ffi
    from czyx.inference._czk import lib as _lib
except ImportError:  # pragma: no cover - exercised where the extension is not built
    _ffi = None
    _lib = None

F32 = np.float32
KIND_F32, KIND_F16, KIND_BF16, KIND_Q = 0, 1, 2, 3
#: The kernels' SIMD levels, lowest first.
LEVELS = ("portable", "avx2", "avx512vnni")


class KernelError(InferenceError):
    """A decode kernel refused its arguments (inconsistent shapes or formats)."""


def have_czk() -> bool:
    """Whether the compiled decode kernels are importable."""
    return _lib is not None


def level() -> str:
    """The SIMD path the kernels take: ``"avx512vnni"``, ``"avx2"`` or ``"portable"``."""
    if _lib is None:
        return "none"
    return LEVELS[_lib.czk_level()]


def set_level_cap(name: str) -> None:
    """Use at most SIMD path ``name`` (one of :data:`LEVELS`): for tests and benchmarks."""
    if name not in LEVELS:
        raise ValueError(f"unknown SIMD level {name!r}; one of {LEVELS}")
    _lib.czk_set_cap(LEVELS.index(name))


def set_min_work(macs: int) -> None:
    """Multiply-adds below which a loop stays on the calling thread (tests force splits)."""
    _lib.czk_set_min_work(int(macs))


def set_attn_share(on: bool) -> None:
    """Whether the batched attention shares weight rows between tokens (the default)
    or runs each token's one-token kernel: the same results; for benchmarks and tests."""
    _lib.czk_set_attn_share(int(bool(on)))


def default_threads() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


class Pool:
    """The engine's worker threads (``threads - 1`` pthreads plus the caller).

    Workers spin briefly after each loop, then sleep on a condition variable
    (at once after :meth:`park`); :meth:`close` joins them (also at garbage
    collection).
    """

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = int(threads)
        self._lock = threading.Lock()
        self.ptr = _lib.czk_pool_new(self.threads)
        if self.ptr == _ffi.NULL:
            raise MemoryError("czk_pool_new failed")

    def park(self) -> None:
        """The caller runs no loop on the pool for a while: workers still spinning
        after the last loop sleep now (the next loop wakes them)."""
        ptr = self.ptr
        if ptr is not None:
            _lib.czk_pool_park(ptr)

    def close(self) -> None:
        """Join the workers (idempotent)."""
        with self._lock:
            if self.ptr is not None and self.ptr != _ffi.NULL:
                _lib.czk_pool_free(self.ptr)
            self.ptr = None

    def __del__(self) -> None:
        if _lib is not None and getattr(self, "ptr", None) is not None:
            self.close()


def _ptr(a: np.ndarray) -> Any:
    return _ffi.cast("void *", _ffi.from_buffer(a))


def _fptr(a: np.ndarray) -> Any:
    return _ffi.cast("float *", _ffi.from_buffer(a))


def describe(w: np.ndarray | PackedMatrix, out: Any, bf16: bool = False) -> list[Any]:
    """Fill the ``czk_mat`` ``out`` for weight ``w``; returns what must stay alive.

    ``w`` is a 2-D C-contiguous float32/float16 array, a uint16 array of
    bfloat16 bits (``bf16=True``) or a :class:`PackedMatrix`.

    Raises
    ------
    KernelError
        For another dtype, a non-contiguous array or a non-2-D shape.
    """
    if isinstance(w, PackedMatrix):
        out.kind = KIND_Q
        out.bits = w.fmt.bits
        out.group = w.fmt.group_size
        out.rows, out.cols = w.shape
        out.data = _ptr(w.codes)
        out.scales = _ffi.cast("const uint16_t *", _ptr(w.scales))
        out.mins = _ffi.cast("const uint16_t *", _ptr(w.mins))
        return [w]
    if not isinstance(w, np.ndarray) or w.ndim != 2 or not w.flags.c_contiguous:
        raise KernelError(f"a kernel weight must be a C-contiguous 2-D array, got {type(w)}")
    if w.dtype == np.float32:
        out.kind = KIND_F32
    elif w.dtype == np.float16:
        out.kind = KIND_F16
    elif w.dtype == np.uint16 and bf16:
        out.kind = KIND_BF16
    else:
        raise KernelError(f"no kernel for weight dtype {w.dtype} (bf16={bf16})")
    out.bits = 0
    out.group = 0
    out.rows, out.cols = w.shape
    out.data = _ptr(w)
    out.scales = _ffi.NULL
    out.mins = _ffi.NULL
    return [w]


class ExpertTable:
    """``(gate, up, down)`` descriptors of every slot of an expert cache, made once.

    The descriptors point into the slots (zero-copy): f32/f16/bf16 slots are
    described as stored (the cache's float32 widening is bypassed), quantized
    slots through the cache's packed views.
    """

    def __init__(self, cache: Any) -> None:
        n = int(cache.n_slots)
        self.n_slots = n
        self.table = _ffi.new("czk_mat[]", 3 * max(n, 1))
        self._keep: list[Any] = []
        fmt = str(cache.format)
        consumer = cache.consumer
        for s in range(n):
            if isinstance(cache.weights(s)[1], PackedMatrix):
                gate_up, down = cache.weights(s)
                parts = (gate_up.gate, gate_up.up, down)
            else:
                parts = consumer.expert_views(cache.slot_bytes(s))
            for j, p in enumerate(parts):
                self._keep += describe(p, self.table[3 * s + j], bf16=fmt == "bf16")
        if getattr(cache, "tier_map", None) is not None:
            # A slot refilled at the other precision gets that precision's descriptors
            # (before its read completes; the kernels only see slots a layer holds).
            tiers = cache._tier_weights
            self._tiers = [_ffi.new("czk_mat[]", 3 * max(n, 1)) for _ in tiers]
            for t, weights in enumerate(tiers):
                for s, (gate_up, down) in enumerate(weights):
                    for j, p in enumerate((gate_up.gate, gate_up.up, down)):
                        self._keep += describe(p, self._tiers[t][3 * s + j])
            cache.on_retier(self.retier)

    def retier(self, slot: int, tier: int) -> None:
        """Slot ``slot`` now holds an expert at ``tier``: its descriptors become that tier's."""
        src = self._tiers[tier]
        for j in range(3):
            self.table[3 * slot + j] = src[3 * slot + j]


class _AttnDesc:
    __slots__ = ("kc", "keep", "layer", "pk", "pv", "struct", "vc")


class DecodeKernels:
    """One decoder's decode-step buffers and kernel calls (one token at a time).

    Parameters
    ----------
    hidden, vocab, top_k
        The model's sizes.
    threads
        Threads of the engine's pool.
    """

    def __init__(self, hidden: int, vocab: int, top_k: int, threads: int) -> None:
        self.pool = Pool(threads)
        self.hidden = hidden
        self.top_k = top_k
        self.h = np.zeros(hidden, F32)
        self.x = np.zeros(hidden, F32)
        self.y = np.zeros(hidden, F32)
        self.logits = np.zeros(vocab, F32)
        self.router_logits = np.zeros(4096, F32)
        self.idx = np.zeros(top_k, np.int64)
        self.w = np.zeros(top_k, F32)
        self.h2, self.x2, self.y2 = self.h[None], self.x[None], self.y[None]
        self._ph, self._px, self._py = _fptr(self.h), _fptr(self.x), _fptr(self.y)
        self._plog, self._prl = _fptr(self.logits), _fptr(self.router_logits)
        self._pidx = _ffi.cast("int64_t *", _ffi.from_buffer(self.idx))
        self._pw = _fptr(self.w)
        self._work = np.zeros(0, np.uint8)
        self._pwork: Any = None
        self._mv_cols = hidden
        self._reserve(int(_lib.czk_work_bytes(hidden)))
        self._mats: dict[int, tuple[Any, Any]] = {}
        self._attn: dict[int, _AttnDesc] = {}
        self._attn_len = 0
        self._experts: tuple[Any, ExpertTable, int, int, int] | None = None
        self._rope: tuple[Any, Any, Any, int] | None = None
        self._batch: DecodeBatch | None = None
        self._batch_top = 0
        self._waves_held: tuple | None = None  # (waves, rows, pointers): _wave_pointers
        # Scratch per token of the batched head (the normed row, then its quantization).
        self._head_need = 4 * hidden + 128 + int(_lib.czk_work_bytes(hidden)) if _lib else 0

    def close(self) -> None:
        """Join the pool's threads."""
        self.pool.close()

    def _reserve(self, nbytes: int) -> Any:
        if self._work.size < nbytes:
            self._work = np.zeros(max(nbytes, 2 * self._work.size), np.uint8)
            self._pwork = _ptr(self._work)
        return self._pwork

    # ------------------------------------------------------------------ pieces

    def _desc(self, w: np.ndarray | PackedMatrix) -> Any:
        """The descriptor of a weight, made once per weight object."""
        hit = self._mats.get(id(w))
        if hit is not None and hit[0] is w:
            return hit[1]
        m = _ffi.new("czk_mat *")
        describe(w, m)
        self._mats[id(w)] = (w, m)
        return m

    def matvec(self, w: np.ndarray | PackedMatrix, x: np.ndarray, y: np.ndarray) -> None:
        """``y = w @ x`` (float32 contiguous vectors)."""
        self._matvec(self._desc(w), _fptr(x), _fptr(y))

    def _matvec(self, m: Any, px: Any, py: Any) -> None:
        if m.cols > self._mv_cols:
            self._mv_cols = m.cols
            self._reserve(int(_lib.czk_work_bytes(m.cols)))
        if _lib.czk_matvec(self.pool.ptr, m, px, py, self._pwork):
            raise KernelError(f"czk_matvec refused a [{m.rows}, {m.cols}] weight")

    def _rope_to(self, rotary: Any, pos: int) -> tuple[Any, Any, Any, int]:
        """The rotary tables as the C calls take them (cos, its and sin's pointers, row
        length), grown first to hold position ``pos``; rebuilt only when the tables were
        replaced."""
        if pos >= rotary._cos.shape[0]:
            rotary._grow(max(pos + 1, 2 * rotary._cos.shape[0]))
        rope = self._rope
        if rope is None or rope[0] is not rotary._cos:
            rope = self._rope = (
                rotary._cos,
                _fptr(rotary._cos),
                _fptr(rotary._sin),
                rotary._cos.shape[1],
            )
        return rope

    def attention(
        self,
        lw: Any,
        kcache: np.ndarray,
        vcache: np.ndarray,
        pos: int,
        window: int | None,
        rotary: Any,
        eps: float,
        n_heads: int,
        n_kv: int,
        head_dim: int,
        qk_norm: int = 0,
        clip: float | None = None,
    ) -> None:
        """The attention half of layer ``lw`` on :attr:`h` (in place); :attr:`x` gets the
        post-attention RMSNorm of the new ``h``. ``kcache``/``vcache``: the layer's
        ``[n_kv, capacity, head_dim]`` float32 caches. ``qk_norm``: RMS norms of q and k
        with the layer's ``q_norm``/``k_norm`` after the projections (1: over all heads
        at once, as OLMoE; 2: each head on its own, as Qwen3-MoE; 0: none); ``clip``:
        q, k and v clamped to ``[-clip, clip]`` after them (None: no clamp). The
        layer's ``o_bias``, when it has one, is added to the output projection."""
        d = self._attn.get(id(lw))
        if d is None or d.layer is not lw:
            d = self._describe_attn(
                lw, eps, n_heads, n_kv, head_dim, rotary.rotary_dim, qk_norm, clip
            )
        if d.kc is not kcache or d.vc is not vcache:
            d.kc, d.vc = kcache, vcache
            d.pk, d.pv = _fptr(kcache), _fptr(vcache)
        rope = self._rope_to(rotary, pos)
        if pos >= self._attn_len:
            self._attn_len = max(2 * pos, 256)
            self._reserve(int(_lib.czk_attn_work_bytes(d.struct, self.hidden, self._attn_len)))
        off = pos * rope[3]
        rc = _lib.czk_attn_decode(
            self.pool.ptr, d.struct, self.hidden, self._ph, self._px, d.pk, d.pv,
            kcache.shape[1], pos, window or 0, rope[1] + off, rope[2] + off, self._pwork,
        )  # fmt: skip
        if rc:
            raise KernelError(f"czk_attn_decode refused layer {lw.index} at position {pos}")

    def _describe_attn(
        self,
        lw: Any,
        eps: float,
        n_heads: int,
        n_kv: int,
        head_dim: int,
        rot: int,
        qk_norm: int,
        clip: float | None,
    ) -> _AttnDesc:
        if qk_norm not in (0, 1, 2):
            raise KernelError(f"qk_norm must be 0, 1 or 2, got {qk_norm!r}")
        if clip is not None and not clip > 0:
            raise KernelError(f"clip must be positive, got {clip!r}")
        s = _ffi.new("czk_attn *")
        keep: list[Any] = []
        s.n_heads, s.n_kv, s.head_dim, s.rot = n_heads, n_kv, head_dim, rot
        s.eps = eps
        s.scale = F32(head_dim**-0.5)
        s.qk_norm = qk_norm
        s.clip = 0.0 if clip is None else float(clip)
        for name in ("q", "k", "v", "o"):
            keep += describe(getattr(lw, f"{name}_proj"), getattr(s, name))
        norms = (lw.q_norm, lw.k_norm) if qk_norm else (None, None)
        if qk_norm and (norms[0] is None or norms[1] is None):
            raise KernelError(f"layer {lw.index} has no q_norm/k_norm for qk_norm={qk_norm}")
        for field, arr in (
            ("in_norm", lw.input_norm),
            ("post_norm", lw.post_attn_norm),
            ("qb", lw.q_bias),
            ("kb", lw.k_bias),
            ("vb", lw.v_bias),
            ("q_norm", norms[0]),
            ("k_norm", norms[1]),
            ("ob", lw.o_bias),
        ):
            if arr is None:
                setattr(s, field, _ffi.NULL)
                continue
            a = np.ascontiguousarray(arr, dtype=F32)
            keep.append(a)
            setattr(s, field, _fptr(a))
        d = _AttnDesc()
        d.keep, d.layer, d.struct = keep, lw, s
        d.kc = d.vc = d.pk = d.pv = None
        self._attn[id(lw)] = d
        return d

    def route(self, router: np.ndarray | PackedMatrix, top_k: int, renorm: bool) -> None:
        """Router logits of :attr:`x`, then softmax top-k into :attr:`idx` / :attr:`w`."""
        m = self._desc(router)
        n = m.rows
        if n > self.router_logits.size or top_k > self.top_k:
            raise KernelError(f"routing {n} experts top-{top_k} exceeds the kernels' buffers")
        self._matvec(m, self._px, self._prl)
        if _lib.czk_topk(self._prl, n, top_k, int(renorm), self._pidx, self._pw):
            raise KernelError(f"czk_topk refused {n} experts, top {top_k}")

    def _expert_table(self, cache: Any) -> tuple[Any, ExpertTable, int, int, int]:
        """``(cache, descriptors, n_experts, H, I)`` of ``cache``'s slots, made once."""
        ex = self._experts
        if ex is None or ex[0] is not cache:
            table = ExpertTable(cache)
            first = table.table[0]
            h, i = int(first.cols), int(first.rows)
            self._reserve(int(_lib.czk_moe_work_bytes(self.top_k, h, i)))
            self._reserve(int(_lib.czk_moe_one_work_bytes(self.top_k, h, i)))
            ex = self._experts = (cache, table, int(cache.n_experts), h, i)
        return ex

    def moe(self, cache: Any, slots: np.ndarray, weights: np.ndarray) -> None:
        """:attr:`y` = the weighted sum of the experts in ``slots`` applied to :attr:`x`.

        ``slots`` int64 and ``weights`` float32, contiguous (the cache's acquire
        result and :attr:`w`).
        """
        ex = self._expert_table(cache)
        if len(slots) > self.top_k:
            raise KernelError(f"{len(slots)} experts for one token, top-k is {self.top_k}")
        rc = _lib.czk_moe(
            self.pool.ptr, len(slots), ex[1].table,
            _ffi.cast("int64_t *", _ffi.from_buffer(slots)), _fptr(weights), self._px, self._py,
            self._pwork,
        )  # fmt: skip
        if rc:
            raise KernelError("czk_moe refused the layer's experts (shapes or formats differ)")

    def moe_streamed(
        self,
        cache: Any,
        slots: np.ndarray,
        weights: np.ndarray,
        pending: Sequence[int],
        wait: Callable[[int], None],
    ) -> None:
        """:meth:`moe` while the bytes of the experts at positions ``pending`` still arrive.

        The resident experts are computed first, then each pending one as soon
        as ``wait(j)`` returns (the cache's :meth:`wait_ready`), so a read
        overlaps the arithmetic of the experts already in. The outputs are
        added in top-k order at the end: bit-identical to :meth:`moe`.
        """
        ex = self._expert_table(cache)
        n = len(slots)
        if n > self.top_k:
            raise KernelError(f"{n} experts for one token, top-k is {self.top_k}")
        late = np.zeros(n, bool)
        late[list(pending)] = True
        order = [j for j in range(n) if not late[j]] + list(pending)
        table, inter, x, work = ex[1].table, ex[4], self._px, self._pwork
        for j in order:
            if late[j]:
                # The workers would spin through the wait on a core the readers need.
                self.pool.park()
                wait(j)
            if _lib.czk_moe_one(self.pool.ptr, n, j, table, int(slots[j]), inter, x, work):
                raise KernelError("czk_moe_one refused an expert (shapes or formats differ)")
        _lib.czk_moe_sum(n, ex[3], _fptr(weights), work, self._py)

    def embed(self, table: np.ndarray | PackedMatrix, token: int) -> None:
        """:attr:`h` = row ``token`` of the embedding (a packed table: that row dequantized)."""
        if isinstance(table, np.ndarray):
            np.copyto(self.h, table[token])
            return
        if _lib.czk_row(self._desc(table), token, self._ph):
            raise KernelError(f"czk_row refused row {token} of a {table.shape} table")

    def head(self, final_norm: np.ndarray, lm_head: np.ndarray | PackedMatrix, eps: float) -> None:
        """:attr:`logits` = lm_head(rmsnorm(:attr:`h`))."""
        m = self._desc(lm_head)
        hit = self._mats.get(id(final_norm))
        if hit is None or hit[0] is not final_norm:
            hit = self._mats[id(final_norm)] = (final_norm, _fptr(final_norm))
        _lib.czk_rmsnorm(self._ph, hit[1], self.hidden, eps, self._px)
        self._matvec(m, self._px, self._plog)

    # ------------------------------------------------------------ batched decode

    def begin_batch(
        self,
        kvs: Any,
        n_layers: int,
        n_kv: int,
        head_dim: int,
        rotary: Any,
        positions: Sequence[int] | None = None,
    ) -> DecodeBatch:
        """Start a batched step of one token per row, row ``r`` a token of KV cache ``kvs[r]``.

        Each cache must have room for its rows' positions (``kv.reserve``). Fills
        the step's positions (``positions[r]``, default each cache's length: one
        decode token per sequence), capacities and KV pointers, grows the rope
        tables to the furthest position, and returns the buffers (rows ``0 ..
        len(kvs)``). Several rows may share a cache (a prompt chunk's tokens, at
        consecutive positions): their attention then runs in row order
        (:meth:`attention_batch`'s ``waves``). The rope tables must not depend on the
        length reached (a dynamic or LongRoPE rope decodes one sequence at a time:
        :meth:`attention`).
        """
        n = len(kvs)
        bt = self._batch
        if bt is None or bt.cap < n or bt.n_layers != n_layers:
            cap = max(n, 8, 2 * bt.cap if bt is not None else 0)
            bt = self._batch = DecodeBatch(self.hidden, self.logits.size, self.top_k, n_layers, cap)
        r = 0
        while r < n:  # a run of rows of one cache (a prompt chunk's) at once
            kv, e = kvs[r], r + 1
            while e < n and kvs[e] is kv:
                e += 1
            bt.kvp[r:e] = _kv_pointers(kv, n_layers, n_kv, head_dim)
            bt.kvcap[r:e] = kv.k[0].shape[1]
            r = e
        if positions is None:
            positions = [kv.length for kv in kvs]
        bt.pos[:n] = positions
        top = max(positions)
        self._rope_to(rotary, top)
        self._batch_top = top
        return bt

    def embed_batch(self, table: np.ndarray | PackedMatrix, tokens: list[int]) -> None:
        """Rows ``0 .. len(tokens)`` of the batch's ``h`` = the tokens' embedding rows."""
        bt = self._batch
        n = len(tokens)
        if isinstance(table, np.ndarray):
            bt.h[:n] = table[tokens]  # (float16 rows widened exactly, as embed's copy)
            return
        bt.tokens[:n] = tokens
        if _lib.czk_rows_take(self._desc(table), n, bt.p_tokens, bt.p_h):
            raise KernelError(f"czk_rows_take refused rows of a {table.shape} table")

    def attention_batch(
        self,
        lw: Any,
        layer: int,
        n: int,
        window: int | None,
        rotary: Any,
        eps: float,
        n_heads: int,
        n_kv: int,
        head_dim: int,
        qk_norm: int = 0,
        clip: float | None = None,
        top_k: int = 0,
        renorm: bool = False,
        waves: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        """:meth:`attention` then (``top_k`` > 0) :meth:`route` for the batch's first ``n``
        tokens, in one call: layer ``layer`` of each token's own KV cache at its own
        position; ``h`` in place, ``x`` the post-attention norm, ``idx`` / ``w`` the
        routes on ``x`` by ``lw.router``. Each token's arithmetic is those methods'.

        ``waves`` (``(waves, groups)``, int64 offsets): the rows run in groups of at
        most four, ``groups[g] .. groups[g + 1]``, whose rows share each weight row and
        attend in row order (so a group may be consecutive tokens of one sequence),
        and the groups in waves, ``waves[j] .. waves[j + 1]``, one wave after another
        (a prompt's groups in consecutive waves); the groups of a wave must name
        different caches. Without, the ``n`` rows are one wave: each names its own
        cache."""
        d = self._attn.get(id(lw))
        if d is None or d.layer is not lw:
            d = self._describe_attn(
                lw, eps, n_heads, n_kv, head_dim, rotary.rotary_dim, qk_norm, clip
            )
        bt = self._batch
        if bt.attn_len <= self._batch_top:  # scratch holds scores for attn_len positions
            length = max(2 * self._batch_top, 256)
            bt.reserve_work(int(_lib.czk_attn_work_bytes(d.struct, self.hidden, length)))
            bt.attn_len = length
        router = _ffi.NULL
        if top_k:
            router = self._desc(lw.router)
            if top_k > self.top_k:
                raise KernelError(f"routing top-{top_k} exceeds the kernels' top-{self.top_k}")
            bt.reserve_router(router.rows)
        rope = self._rope
        nl = bt.n_layers
        if waves is None:
            rc = _lib.czk_attn_decode_batch(
                self.pool.ptr, d.struct, self.hidden, n, bt.p_h, bt.p_x, bt.p_kvp + layer,
                bt.p_kvp + nl + layer, 2 * nl, bt.p_kvcap, bt.p_pos, window or 0, rope[1],
                rope[2], rope[3], rope[0].shape[0], router, top_k, int(renorm), bt.p_rl,
                bt.p_idx, bt.p_w, bt.p_work, bt.wstride,
            )  # fmt: skip
        else:
            nw, p_wv, p_gr = self._wave_pointers(waves, n)
            rc = _lib.czk_attn_decode_waves(
                self.pool.ptr, d.struct, self.hidden, nw, p_wv, p_gr, bt.p_h, bt.p_x,
                bt.p_kvp + layer, bt.p_kvp + nl + layer, 2 * nl, bt.p_kvcap, bt.p_pos,
                window or 0, rope[1], rope[2], rope[3], rope[0].shape[0], router, top_k,
                int(renorm), bt.p_rl, bt.p_idx, bt.p_w, bt.p_work, bt.wstride,
            )  # fmt: skip
        if rc:
            entry = "czk_attn_decode_batch" if waves is None else "czk_attn_decode_waves"
            raise KernelError(f"{entry} refused layer {lw.index} for {n} tokens")

    def _wave_pointers(self, waves: tuple[np.ndarray, np.ndarray], n: int) -> tuple:
        """``(wave count, waves pointer, groups pointer)``, checked once per step: a
        step passes the same ``waves`` to every layer."""
        held = self._waves_held
        if held is not None and held[0] is waves and held[1] == n:
            return held[2]
        wv, gr = waves
        if (
            wv.dtype != np.int64
            or gr.dtype != np.int64
            or not (wv.flags.c_contiguous and gr.flags.c_contiguous)
            or wv[-1] != gr.size - 1
            or gr[-1] != n
        ):
            raise KernelError(f"waves and groups must be int64 offsets, the rows ending at {n}")
        ptrs = (
            wv.size - 1,
            _ffi.cast("int64_t *", _ffi.from_buffer(wv)),
            _ffi.cast("int64_t *", _ffi.from_buffer(gr)),
        )
        self._waves_held = (waves, n, ptrs)  # (the arrays stay alive with the tuple)
        return ptrs

    def union(self, n: int, resident: np.ndarray) -> np.ndarray:
        """The distinct experts of the batch's first ``n`` routes, those resident first
        (``resident``: a cache table's int32 row, slot or -1), each part ascending: the
        order a step acquires them in. A view of the batch's buffer."""
        bt = self._batch
        if resident.dtype != np.int32 or not resident.flags.c_contiguous:
            raise KernelError("union takes the cache table's int32 row")
        m = _lib.czk_union(
            bt.p_idx, n * self.top_k, _ffi.cast("int32_t *", _ffi.from_buffer(resident)),
            resident.size, bt.p_union,
        )  # fmt: skip
        if m < 0:
            raise KernelError(f"a routed expert outside 0..{resident.size - 1}")
        return bt.union[:m]

    def moe_batch(
        self,
        cache: Any,
        r0: int,
        r1: int,
        experts: np.ndarray,
        slots: np.ndarray,
        add: bool,
        part: str | None = None,
    ) -> None:
        """:meth:`moe` for the batch's rows ``r0 .. r1``: row ``r``'s experts ``idx[r]`` (in
        that order), expert ``experts[j]`` held at ``slots[j]`` (the acquire's result),
        weights ``w[r]``, into ``y[r]``; ``add``: then ``h[r] += y[r]`` (the residual).

        The products run expert by expert, each expert's rows read once for every row
        that chose it; each row's result is exactly :meth:`moe`'s for that row alone.

        ``part`` (the rows' experts over several acquires, when they exceed the cache):
        ``"first"`` and ``"part"`` compute the (row, expert) products of the experts held
        now and keep them, a row's other experts skipped (``"first"`` forgets what
        earlier calls kept); ``"last"`` does the same, then every row's weighted sum from
        all the kept products, in top-k order: the operations of one call. A product no
        call since the ``"first"`` computed refuses the ``"last"`` call (KernelError,
        ``y`` and ``h`` unchanged)."""
        ex = self._expert_table(cache)
        bt = self._batch
        if bt.moe_table is not ex[1]:  # scratch for a whole batch of rows (not per row)
            first = ex[1].table[0]
            need = int(_lib.czk_moe_batch_work_bytes(bt.cap, self.top_k, first.cols, first.rows))
            bt.reserve_work(-(-need // bt.cap))
            bt.moe_table = ex[1]
        if (
            experts.dtype != np.int64
            or slots.dtype != np.int64
            or experts.shape != slots.shape
            or not (experts.flags.c_contiguous and slots.flags.c_contiguous)
        ):
            raise KernelError("moe_batch takes int64 experts and their slots, one each")
        if part not in (None, "first", "part", "last"):
            raise KernelError(f"moe_batch part: None, 'first', 'part' or 'last', not {part!r}")
        k, h = self.top_k, self.hidden
        rc = _lib.czk_moe_batch(
            self.pool.ptr, r1 - r0, k, ex[1].table, ex[1].n_slots, ex[2],
            _ffi.cast("int64_t *", _ffi.from_buffer(experts)),
            _ffi.cast("int64_t *", _ffi.from_buffer(slots)), experts.size, bt.p_idx + r0 * k,
            bt.p_w + r0 * k, bt.p_x + r0 * h, bt.p_y + r0 * h,
            bt.p_h + r0 * h if add else _ffi.NULL, h, bt.p_work, bt.work.size,
            _ffi.NULL if part is None else bt.pairs(k, h) + r0 * k * h,
            _ffi.NULL if part is None else bt.pairs_done(k, r0, r1, part == "first"),
            int(part not in ("first", "part")),
        )  # fmt: skip
        if rc:
            raise KernelError("czk_moe_batch refused the experts (slots, shapes or formats)")

    def head_batch(
        self, final_norm: np.ndarray, lm_head: np.ndarray | PackedMatrix, eps: float, n: int
    ) -> np.ndarray:
        """:meth:`head` for the batch's first ``n`` rows of ``h``; returns ``logits[:n]``
        (a view of the batch's buffer, valid until the next batched step)."""
        m = self._desc(lm_head)
        hit = self._mats.get(id(final_norm))
        if hit is None or hit[0] is not final_norm:
            hit = self._mats[id(final_norm)] = (final_norm, _fptr(final_norm))
        bt = self._batch
        if bt.wstride < self._head_need:
            bt.reserve_work(self._head_need)
        if _lib.czk_head_batch(
            self.pool.ptr, n, bt.p_h, self.hidden, hit[1], eps, m, bt.p_logits, bt.p_work,
            bt.wstride,
        ):  # fmt: skip
            raise KernelError(f"czk_head_batch refused a [{m.rows}, {m.cols}] head")
        return bt.logits[:n]


class DecodeBatch:
    """Buffers of a batched decode step: B tokens (each its own sequence) per call.

    Preallocated for a maximum batch (grown by doubling, never per call): the
    residual streams :attr:`h`, the MoE inputs :attr:`x` and outputs :attr:`y`
    ``[B, hidden]``, the routes :attr:`idx` / :attr:`w` ``[B, top_k]``, the
    logits ``[B, vocab]``, each token's position, KV capacity and KV pointers,
    and one scratch region per token (``wstride`` bytes each). The batched
    entry points of ``czk.c`` read and write their first ``n`` rows.
    """

    def __init__(self, hidden: int, vocab: int, top_k: int, n_layers: int, cap: int) -> None:
        self.cap = cap
        self.n_layers = n_layers
        self.h = np.zeros((cap, hidden), F32)
        self.x = np.zeros((cap, hidden), F32)
        self.y = np.zeros((cap, hidden), F32)
        self.idx = np.zeros((cap, top_k), np.int64)
        self.w = np.zeros((cap, top_k), F32)
        self.logits = np.zeros((cap, vocab), F32)
        self.tokens = np.zeros(cap, np.int64)
        self.pos = np.zeros(cap, np.int64)
        self.kvcap = np.zeros(cap, np.int64)
        self.kvp = np.zeros((cap, 2 * n_layers), np.uintp)
        self.router_logits = np.zeros(0, F32)
        self.dpairs = np.zeros(0, F32)
        self.pdone = np.zeros(0, np.uint8)
        self.p_pdone: Any = None
        self.p_dpairs: Any = None
        self.union = np.zeros(4096, np.int64)
        self.p_union = _ffi.cast("int64_t *", _ffi.from_buffer(self.union))
        self.moe_table: Any = None
        self.p_h, self.p_x, self.p_y = _fptr(self.h), _fptr(self.x), _fptr(self.y)
        self.p_idx = _ffi.cast("int64_t *", _ffi.from_buffer(self.idx))
        self.p_w = _fptr(self.w)
        self.p_logits = _fptr(self.logits)
        self.p_tokens = _ffi.cast("int64_t *", _ffi.from_buffer(self.tokens))
        self.p_pos = _ffi.cast("int64_t *", _ffi.from_buffer(self.pos))
        self.p_kvcap = _ffi.cast("int64_t *", _ffi.from_buffer(self.kvcap))
        self.p_kvp = _ffi.cast("uintptr_t *", _ffi.from_buffer(self.kvp))
        self.p_rl: Any = None
        self.work = np.zeros(0, np.uint8)
        self.p_work: Any = None
        self.wstride = 0
        self.attn_len = 0

    def reserve_work(self, nbytes: int) -> None:
        """At least ``nbytes`` of scratch per token (rounded to cache lines, doubling)."""
        if nbytes <= self.wstride:
            return
        stride = max(-(-int(nbytes) // 64) * 64, 2 * self.wstride)
        self.work = np.zeros(self.cap * stride, np.uint8)
        self.p_work = _ptr(self.work)
        self.wstride = stride

    def pairs(self, top_k: int, hidden: int) -> Any:
        """The per-(row, expert) products of a MoE layer computed in parts, ``[cap *
        top_k, hidden]`` (allocated on first use)."""
        if self.dpairs.size != self.cap * top_k * hidden:
            self.dpairs = np.zeros(self.cap * top_k * hidden, F32)
            self.p_dpairs = _fptr(self.dpairs)
        return self.p_dpairs

    def pairs_done(self, top_k: int, r0: int, r1: int, clear: bool) -> Any:
        """Which of rows ``r0 .. r1``'s products :meth:`pairs` holds (``uint8 [cap *
        top_k]``, set by the C call); ``clear``: none yet (a layer's first part)."""
        if self.pdone.size != self.cap * top_k:
            self.pdone = np.zeros(self.cap * top_k, np.uint8)
            self.p_pdone = _ffi.cast("uint8_t *", _ffi.from_buffer(self.pdone))
        if clear:
            self.pdone[r0 * top_k : r1 * top_k] = 0
        return self.p_pdone + r0 * top_k

    def reserve_router(self, n_experts: int) -> None:
        """Router logits of ``n_experts`` per token."""
        if self.router_logits.size != self.cap * n_experts:
            self.router_logits = np.zeros(self.cap * n_experts, F32)
            self.p_rl = _fptr(self.router_logits)


def _kv_pointers(kv: Any, n_layers: int, n_kv: int, head_dim: int) -> np.ndarray:
    """The addresses of ``kv``'s per-layer K then V arrays (kept on ``kv`` until it grows).

    A :class:`~czyx.inference.models.base.KVCache` replaces every layer's arrays
    together when it grows, so its first K and last V arrays identify the set.

    Raises
    ------
    KernelError
        For arrays that are not float32 C-contiguous ``[n_kv, capacity, head_dim]``.
    """
    hit = getattr(kv, "_czk_ptrs", None)
    if hit is not None and hit[0] is kv.k[0] and hit[1] is kv.v[-1]:
        return hit[2]
    arrs = [*kv.k, *kv.v]
    cap = kv.k[0].shape[1] if kv.k else 0
    if len(arrs) != 2 * n_layers or any(
        a.dtype != F32 or not a.flags.c_contiguous or a.shape != (n_kv, cap, head_dim) for a in arrs
    ):
        raise KernelError(
            f"a KV cache for the batched decode must hold {n_layers} float32 "
            f"[{n_kv}, capacity, {head_dim}] arrays per K and V"
        )
    ptrs = np.array([a.ctypes.data for a in arrs], np.uintp)
    kv._czk_ptrs = (kv.k[0], kv.v[-1], ptrs)
    return ptrs


_scope = threading.local()


@contextmanager
def pool_scope(pool: Pool | None) -> Iterator[None]:
    """Within the block, this thread's :func:`quant_matmul` calls run on ``pool``'s threads.

    The engine enters it around a prompt's layers, so the prefill's products
    use the threads its decode kernels own (a pool runs one caller's loop at a
    time; another thread's call meanwhile runs on that thread alone). ``None``:
    the calling thread only. Results do not depend on the pool.
    """
    prev = getattr(_scope, "pool", None)
    _scope.pool = pool
    try:
        yield
    finally:
        _scope.pool = prev


def _scope_ptr() -> Any:
    pool = getattr(_scope, "pool", None)
    ptr = None if pool is None else pool.ptr
    return _ffi.NULL if ptr is None else ptr


def quant_matmul(w: PackedMatrix, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``x @ w.T`` for ``x float32 [T, cols]`` with the decode kernel's int8 inputs.

    Every row of the result is exactly what :meth:`DecodeKernels.matvec` gives for
    that row of ``x`` (each token quantized on its own, the same operations per
    output), so a token's product does not depend on the batch it came in; the
    matrix's codes are loaded once per four tokens. Rows are split over the
    threads of the :func:`pool_scope` in force (one thread without one); the
    result does not depend on it.

    Raises
    ------
    KernelError
        For a weight that is not a :class:`PackedMatrix` or mismatched shapes.
    """
    if not isinstance(w, PackedMatrix):
        raise KernelError(f"quant_matmul takes a packed matrix, got {type(w).__name__}")
    rows, cols = w.shape
    x = np.ascontiguousarray(x, dtype=F32)
    if x.ndim != 2 or x.shape[1] != cols:
        raise KernelError(f"quant_matmul: x shape {x.shape} != (T, {cols})")
    t = x.shape[0]
    if out is None:
        out = np.empty((t, rows), F32)
    elif out.shape != (t, rows) or out.dtype != F32 or not out.flags.c_contiguous:
        raise KernelError(f"quant_matmul: out must be float32 C-contiguous ({t}, {rows})")
    if t == 0 or rows == 0:
        return out
    m = _ffi.new("czk_mat *")
    describe(w, m)
    work = np.empty(int(_lib.czk_matmul_work_bytes(t, cols)), np.uint8)
    if _lib.czk_matmul(_scope_ptr(), m, _fptr(x), t, _fptr(out), _ptr(work)):
        raise KernelError(f"czk_matmul refused a [{rows}, {cols}] {w.fmt.name} weight")
    return out
