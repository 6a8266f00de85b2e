"""The work one node does in a sharded model, without any transport: the Ray actors'
payload (:mod:`inference.distributed.ray_cluster`), also runnable in one process.

Scope: two shapes of splitting one model version over nodes, each node
opening its *own* store through the portal it was handed
(:class:`~inference.opened.OpenedModel`), so only activations cross nodes.

* :class:`LayerStage` (pipeline): holds the trunk of a contiguous layer range
  (the rest is dropped after loading) and the experts of those layers behind
  its own slot cache; ``forward`` takes token ids (first stage) or the
  residual stream ``[T, H]`` and returns the residual stream after its last
  layer, or the logits (last stage). KV caches are per request id, so
  several requests can be in flight through the pipeline.
* :class:`ExpertShard` (expert-parallel by class range): runs the whole trunk
  for the requests given to it, and holds the routed experts of a class
  range (a range of key class bytes: the router byte under the identity
  permutation) in its own store and slot cache. At each sparse layer the
  routed hidden states of the chosen experts go to the shards owning their
  classes (``dispatch``); each returns its ``(token, k)`` contributions
  (:meth:`ExpertShard.partial`), which are placed into the fixed
  ``[T, top_k, H]`` buffer and summed in top-k order.

Why the results equal the single-process engine bit for bit: a stage runs
the engine's own layer-range steps (:meth:`~inference.models.decoder.MoEDecoder.run_layers`
for several tokens, :meth:`~inference.models.decoder.MoEDecoder.run_layers_one`
for one token through the C decode kernels), the very code
:meth:`~inference.models.decoder.MoEDecoder.forward` loops over, so it cannot
drift from it; only the residual stream crosses between stages. Where
:meth:`~inference.engine.Engine.prefill` runs a prompt through the batched C
step (:func:`~inference.engine.prompt_in_c`: each token's arithmetic the C
decode's), a stage and a shard run the prompt's tokens one at a time through
their one-token step, which is that arithmetic. A shard runs
the engine's whole forward with one step swapped, the routed experts: each expert's
product runs on the same rows, in the same column form and with the same
weights as :meth:`~inference.models.decoder.MoEDecoder._routed` (this module
mirrors its two paths: one token, and a batch grouped by expert), and the
partial outputs are summed in the same fixed top-k order, whatever node
computed them. The tests compare against the single-process engine.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from czyx.inference.engine import Engine, prompt_in_c
from czyx.inference.errors import UnsupportedModelError
from czyx.inference.kernels import fused
from czyx.inference.kernels.linear import mm_t, take_rows
from czyx.inference.models.base import (
    F32,
    group_by_expert,
    swiglu_columns,
    swiglu_fused,
)
from czyx.inference.opened import OpenedModel
from czyx.inference.options import EngineOptions

#: A routed call to the experts of other shards: ``(layer, x rows, idx, w, mode)``
#: for each owning shard -> list of ``(flat (row, k) indices, [n, H] values)``.
Dispatch = Callable[
    [int, dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]], str],
    dict[int, tuple[np.ndarray, np.ndarray]],
]


def _open_engine(
    store_dir: str,
    ref: str,
    token: str | None,
    cache_fraction: float | None,
    lazy: bool,
    own: Callable[[OpenedModel, Any], int],
) -> tuple[OpenedModel, Engine, bool]:
    """Open this node's store through its portal and an engine whose slot budget is
    ``cache_fraction`` (None: all) of the experts this node uses, ``own(opened, cfg)``
    of them (never below one token's top-k); and whether that budget holds them all."""
    from czyx.inference.models import decoder_class

    if cache_fraction is not None and not 0.0 < cache_fraction <= 1.0:
        raise ValueError(f"cache fraction {cache_fraction} is not in (0, 1]")
    opened = OpenedModel(store_dir, ref, token, lazy_trunk=lazy)
    try:
        info = opened.consumer.info
        cfg = decoder_class(info.arch).parse_config(info)
        frac = 1.0 if cache_fraction is None else cache_fraction
        n_own = own(opened, cfg)
        slots = max(cfg.top_k, int(n_own * frac))
        engine = Engine(
            opened.consumer,
            cache_bytes=slots * int(info.expert_slot_nbytes),
            options=EngineOptions(stream=False),  # synchronous reads: no prefetch threads
        )
    except BaseException:
        opened.close()
        raise
    return opened, engine, slots >= n_own


def _class_map(opened: OpenedModel, n_layers: int, n_experts: int) -> np.ndarray:
    """``[layer, router byte] -> key class`` of the opened version (its layout)."""
    from czyx.space import Selector
    from czyx.store.models.expert_layout import layout_from_manifest

    manifest = opened.store.manifest(Selector(opened.consumer.info.selector))
    layout = layout_from_manifest(manifest)
    return np.asarray(
        layout.class_array(np.arange(n_layers)[:, None], np.arange(n_experts)[None, :])
    )


class _EngineNode:
    """What a stage and a shard share: an engine over an opened store, its cache
    counters and the release order (engine, then store)."""

    engine: Engine
    opened: OpenedModel

    def _with_cache_counters(self, own: dict[str, int]) -> dict[str, int]:
        """``own`` counters followed by this node's cache hits and misses."""
        st = self.engine.stats()
        return {**own, "hits": st.hits, "misses": st.misses}

    def close(self) -> None:
        """Release the engine, then the store."""
        try:
            self.engine.close()
        finally:
            self.opened.close()


class LayerStage(_EngineNode):
    """One pipeline stage: layers ``lo..hi-1`` of the model (see the module docstring).

    Parameters
    ----------
    store_dir, ref, token
        This node's store, the version (``NAME@VERSION``) and the portal it was handed.
    lo, hi
        The layer range ``[lo, hi)``; the first stage embeds, the last one
        applies the final norm and the LM head.
    cache_fraction
        This stage's expert slot budget as a fraction of the routed experts of its
        layers (None: all of them fit; never below one token's top-k).
    """

    def __init__(
        self,
        store_dir: str,
        ref: str,
        token: str | None,
        lo: int,
        hi: int,
        *,
        cache_fraction: float | None = None,
    ) -> None:
        def own(_: OpenedModel, cfg: Any) -> int:  # the routed experts of this stage's layers
            return sum(cfg.sparse_layers[lo:hi]) * cfg.n_experts

        self.opened, self.engine, self.resident = _open_engine(
            store_dir, ref, token, cache_fraction, lazy=True, own=own
        )
        model = self.engine.model
        n = model.cfg.n_layers
        if not 0 <= lo < hi <= n:
            self.close()
            raise ValueError(f"layer range [{lo}, {hi}) is not inside 0..{n}")
        self.lo, self.hi = lo, hi
        self.first, self.last = lo == 0, hi == n
        # Hold only this stage's layers (the lazy consumer handed them over: dropping
        # them frees them). Embedding and head stay where they are used.
        for i in range(n):
            if not lo <= i < hi:
                model.layers[i] = None
        if not self.first:
            model.embed = None
        if not self.last:
            model.lm_head = model.final_norm = None
        self.kv: dict[Any, Any] = {}
        self.bytes_in = self.bytes_out = self.calls = 0

    def forward(self, req: Any, x: np.ndarray) -> np.ndarray:
        """Run request ``req``'s next tokens through this stage's layers.

        ``x`` is ``[T]`` token ids on the first stage, else the residual stream
        ``[T, H]`` float32. Returns the residual stream ``[T, H]``, or on the last
        stage the logits ``[V]`` of the last token.
        """
        model = self.engine.model
        kv = self.kv.get(req)
        if kv is None:
            kv = self.kv[req] = model.new_kv()
        x = np.asarray(x)
        self.bytes_in += x.nbytes
        self.calls += 1
        t = x.shape[0] if not self.first else x.reshape(-1).shape[0]
        kv.reserve(kv.length + t)
        self.engine.cache.advance(t)
        with self.engine._blas:  # BLAS held to one thread, as in Engine.prefill/decode
            if t == 1 and model.observer is None and fused.have_czk():
                out = self._forward_one(x, kv)
            elif prompt_in_c(model, t, self.resident):  # as Engine.prefill: decode's arithmetic
                outs = [self._forward_one(x[i : i + 1], kv) for i in range(t)]
                out = outs[-1] if self.last else np.concatenate(outs)
            else:
                out = self._forward_batch(x, kv)
        self.bytes_out += out.nbytes
        return out

    def _forward_batch(self, x: np.ndarray, kv: Any) -> np.ndarray:
        """Several tokens: :meth:`MoEDecoder.run_layers` (the engine's own step) over this
        stage's layers, between the engine's embedding and head."""
        model = self.engine.model
        h = take_rows(model.embed, x.astype(np.int64).reshape(-1)) if self.first else x
        start, t = kv.length, h.shape[0]
        h = model.run_layers(h, kv, start, self.lo, self.hi)
        kv.length = start + t
        if self.last:
            hn = model.norm(h[-1:], model.final_norm, model.final_norm_bias)
            return model.finish_logits(mm_t(hn, model.lm_head))[0]
        return h

    def _forward_one(self, x: np.ndarray, kv: Any) -> np.ndarray:
        """One token: :meth:`MoEDecoder.run_layers_one` (the engine's own C decode step)
        over this stage's layers, the residual stream entering and leaving through
        ``kern.h``."""
        model, cfg = self.engine.model, self.engine.model.cfg
        kern = model.kernels()
        start = kv.length
        if not self.first:
            np.copyto(kern.h, x.reshape(-1))
        else:
            kern.embed(model.embed, int(x.reshape(-1)[0]))
        model.run_layers_one(kern, kv, start, self.lo, self.hi)
        kv.length = start + 1
        if self.last:
            kern.head(model.final_norm, model.lm_head, cfg.rms_eps)
            return model.finish_logits(kern.logits.copy())
        return kern.h2.copy()

    def end(self, req: Any) -> None:
        """Forget request ``req`` (its KV cache)."""
        self.kv.pop(req, None)

    def counters(self) -> dict[str, int]:
        """Activation bytes in and out and calls so far, and this stage's cache counters."""
        return self._with_cache_counters(
            {"bytes_in": self.bytes_in, "bytes_out": self.bytes_out, "calls": self.calls}
        )


def class_owners(class_map: np.ndarray, ranges: Sequence[tuple[int, int]]) -> np.ndarray:
    """``owner[layer, router byte]`` -> shard index, from each shard's class range.

    ``class_map[layer, byte]`` is the key class of that expert. Raises
    ``ValueError`` if a class is owned by no shard or by two.
    """
    owner = np.full(class_map.shape, -1, np.int64)
    for s, (lo, hi) in enumerate(ranges):
        mine = (class_map >= lo) & (class_map <= hi)
        if (owner[mine] >= 0).any():
            raise ValueError(f"class range {lo}-{hi} overlaps another shard's")
        owner[mine] = s
    if (owner < 0).any():
        layer, e = np.argwhere(owner < 0)[0]
        raise ValueError(f"class {class_map[layer, e]} (layer {layer}) is owned by no shard")
    return owner


class ExpertShard(_EngineNode):
    """One expert-parallel node: the whole trunk, the experts of one class range.

    Parameters
    ----------
    store_dir, ref, token
        This node's store (it may hold only a subset of the experts: ``czyx pull
        --classes``), the version and the portal it was handed.
    index
        This shard's position in ``ranges``.
    ranges
        Every shard's inclusive class range, in shard order.
    cache_fraction
        The expert slot budget as a fraction of the routed experts of this
        shard's classes (None: all of them fit; never below one token's top-k).
    """

    def __init__(
        self,
        store_dir: str,
        ref: str,
        token: str | None,
        index: int,
        ranges: Sequence[tuple[int, int]],
        *,
        cache_fraction: float | None = None,
    ) -> None:
        ranges = [(int(a), int(b)) for a, b in ranges]
        owner: dict[str, np.ndarray] = {}

        def own(opened: OpenedModel, cfg: Any) -> int:  # the experts of this shard's classes
            owner["map"] = class_owners(_class_map(opened, cfg.n_layers, cfg.n_experts), ranges)
            sparse = np.asarray(cfg.sparse_layers, bool)
            return int((owner["map"][sparse] == index).sum())

        self.opened, self.engine, self.resident = _open_engine(
            store_dir, ref, token, cache_fraction, lazy=False, own=own
        )
        model = self.engine.model
        if model.weight_expert_input:  # _expert_partial weights the outputs, as the base
            self.close()
            raise UnsupportedModelError(
                f"{model.arch}: an expert shard cannot serve experts whose input is weighted"
            )
        self.owner = owner["map"]
        self.index = index
        self.dispatch: Dispatch | None = None
        self.kv: dict[Any, Any] = {}
        # Expert products and the slot cache are single-threaded; peers' partial
        # calls and this node's own forward take turns on them.
        self._lock = threading.Lock()
        self._peer_kern: Any = None  # decode kernels serving peers' one-token calls
        self.bytes_sent = self.bytes_received = self.remote_calls = 0
        model._routed = types.MethodType(_make_routed(self), model)

    def forward(self, req: Any, tokens: np.ndarray) -> np.ndarray:
        """Run request ``req``'s next ``tokens`` through the model; the last token's logits."""
        kv = self.kv.get(req)
        if kv is None:
            kv = self.kv[req] = self.engine.model.new_kv()
        ids = np.asarray(tokens, np.int64).reshape(-1)
        with self._lock:
            self.engine.cache.advance(len(ids))
        model = self.engine.model
        with self.engine._blas:  # BLAS held to one thread, as in Engine.prefill/decode
            if ids.size > 1 and prompt_in_c(model, ids.size, self.resident):
                for i in range(ids.size):  # as Engine.prefill: decode's arithmetic
                    out = model.forward(ids[i : i + 1], kv)
                return out
            return model.forward(ids, kv)

    def end(self, req: Any) -> None:
        """Forget request ``req``."""
        self.kv.pop(req, None)

    def partial(
        self,
        layer: int,
        x: np.ndarray,
        idx: np.ndarray,
        w: np.ndarray,
        mode: str,
        kern: Any = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Contributions of this shard's experts to routed rows ``x [n, H]``.

        ``idx``/``w`` are those rows' top-k experts and weights; ``mode`` is the
        path the single-process engine takes for the whole batch: ``"c"`` (one
        token through the C decode kernels), ``"one"`` (one token, numpy) or
        ``"batch"``. Returns ``(flat indices row * top_k + k, values [m, H])``
        for the pairs whose expert this shard owns, each ``weight * expert(x_row)``
        computed as that path computes it. ``kern``: the decode kernels to use in
        ``"c"`` mode (default: this shard's own set for peers' calls, apart from
        the one its forward uses).
        """
        if mode not in ("c", "one", "batch"):
            raise ValueError(f"partial: unknown mode {mode!r}")
        with self._lock:
            if mode == "c" and kern is None:
                if self._peer_kern is None:
                    cfg = self.engine.cfg
                    self._peer_kern = fused.DecodeKernels(
                        cfg.hidden_size, cfg.vocab_size, cfg.top_k, self.engine.threads
                    )
                kern = self._peer_kern
            with self.engine._blas:
                return _expert_partial(
                    self.engine, layer, x, idx, w, mode, self.owner[layer], self.index, kern
                )

    def counters(self) -> dict[str, int]:
        """Activation bytes sent to / received from peers, remote calls, cache counters."""
        return self._with_cache_counters(
            {
                "bytes_sent": self.bytes_sent,
                "bytes_received": self.bytes_received,
                "remote_calls": self.remote_calls,
            }
        )


def _make_routed(shard: ExpertShard) -> Callable[..., np.ndarray]:
    """The decoder's routed-expert step (``MoEDecoder._routed``), with the experts of
    other shards computed there and the partial outputs summed here in top-k order."""

    def routed(model: Any, i: int, lw: Any, x: np.ndarray) -> np.ndarray:
        cfg = model.cfg
        mask = None if model.route_mask is None else model.route_mask[i]
        kern = model._kernels
        if kern is not None and x is kern.x2 and mask is None and model._plain_routing:
            kern.route(lw.router, cfg.top_k, cfg.renormalize)  # the C decode path's routing
            idx, w, mode = kern.idx[None].copy(), kern.w[None].copy(), "c"
        else:
            idx, w = model.route(lw, x, mask)
            mode = "one" if x.shape[0] == 1 else "batch"
        model.count_routes(i, idx, w)
        t, k = idx.shape
        owners = shard.owner[i][idx]  # [t, k]
        jobs: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
        for s in np.unique(owners).tolist():
            rows = np.flatnonzero((owners == s).any(axis=1))
            jobs[s] = (rows, x[rows], idx[rows], w[rows])
        contrib = np.zeros((t, k, cfg.hidden_size), F32)
        cflat = contrib.reshape(t * k, cfg.hidden_size)
        remote = {s: j for s, j in jobs.items() if s != shard.index}
        pending = None
        if remote:
            if shard.dispatch is None:
                raise RuntimeError("expert shard has peers' experts to call but no dispatch")
            shard.bytes_sent += sum(
                j[1].nbytes + j[2].nbytes + j[3].nbytes for j in remote.values()
            )
            shard.remote_calls += len(remote)
            pending = shard.dispatch(i, {s: j[1:] for s, j in remote.items()}, mode)
        results = {}
        if shard.index in jobs:
            _, xr, ir, wr = jobs[shard.index]
            results[shard.index] = shard.partial(i, xr, ir, wr, mode, kern if mode == "c" else None)
        if pending is not None:
            for s, (sel, vals) in pending().items():
                shard.bytes_received += vals.nbytes + sel.nbytes
                results[s] = (sel, vals)
        for s, (sel, vals) in results.items():
            rows = jobs[s][0]
            cflat[rows[sel // k] * k + sel % k] = vals  # (local row, k) -> (global row, k)
        if mode == "c":
            # czk_moe's sum: y = w0*d0, then y += wj*dj in top-k order (no FMA).
            y = contrib[:, 0].copy()
            for j in range(1, k):
                y += contrib[:, j]
            return y
        # Fixed top-k order: the same sum as the single-process engine.
        return contrib.sum(axis=1)

    return routed


def _expert_partial(
    engine: Engine,
    layer: int,
    x: np.ndarray,
    idx: np.ndarray,
    w: np.ndarray,
    mode: str,
    owner_row: np.ndarray,
    me: int,
    kern: Any = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Mirror of ``MoEDecoder._routed``'s expert work (its three paths) over the
    experts ``me`` owns."""
    cache = engine.cache
    n, k = idx.shape
    hidden = x.shape[1]
    mine = owner_row[idx] == me  # [n, k]
    sel_all = np.flatnonzero(mine.ravel())
    out = np.zeros((n * k, hidden), F32)
    if mode == "c":
        # One C MoE call per owned expert, weight applied in C: y = w * d exactly as
        # the first term of czk_moe's accumulation.
        np.copyto(kern.x, x[0])
        for kk in np.flatnonzero(mine[0]).tolist():
            slots = cache.acquire(layer, idx[0, kk : kk + 1])
            try:
                kern.moe(cache, np.ascontiguousarray(slots, np.int64), w[0, kk : kk + 1].copy())
            finally:
                cache.release()
            out[kk] = kern.y
        return sel_all, out[sel_all]
    if mode == "one":
        order = idx[0][mine[0]]
        js = np.flatnonzero(mine[0])
    else:
        # Filtering the residents-first order keeps it stable: the same order as
        # filtering first, then sorting.
        pairs, counts, ends, order = group_by_expert(idx, engine.cfg.n_experts, cache.table[layer])
        order = order[owner_row[order] == me]
        wflat = w.reshape(-1)
        xt = np.ascontiguousarray(x.T)
    chunk = cache.max_acquire
    for c0 in range(0, len(order), chunk):
        group = order[c0 : c0 + chunk]
        slots = cache.acquire(layer, group)
        try:
            for j, s in enumerate(slots.tolist()):
                gate_up, down = cache.weights(s)
                e = int(group[j])
                if mode == "one":
                    kk = int(js[c0 + j])
                    y = swiglu_fused(x, gate_up, down)
                    out[kk] = y[0] * w[0, kk]
                    continue
                sel = pairs[ends[e] - counts[e] : ends[e]]
                rows = sel // k
                if isinstance(gate_up, np.ndarray):
                    y = swiglu_columns(np.take(xt, rows, axis=1), gate_up, down).T
                else:
                    y = swiglu_fused(x[rows], gate_up, down)
                out[sel] = y * wflat[sel, None]
        finally:
            cache.release()
    return sel_all, out[sel_all]


def greedy(
    step: Callable[[Any, np.ndarray], np.ndarray],
    prompt: Sequence[int],
    max_tokens: int,
    req: Any = 0,
) -> tuple[list[int], list[np.ndarray]]:
    """Greedy decoding through ``step(req, tokens) -> logits``: ``(tokens, logits)``."""
    logits = step(req, np.asarray(prompt, np.int64))
    toks, out = [int(np.argmax(logits))], [logits]
    while len(toks) < max_tokens:
        logits = step(req, np.array([toks[-1]], np.int64))
        toks.append(int(np.argmax(logits)))
        out.append(logits)
    return toks, out
