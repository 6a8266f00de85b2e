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

Why the results equal the single-process engine bit for bit: each expert's
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

from czyx.inference.engine import Engine
from czyx.inference.kernels.linear import mm_t, take_rows
from czyx.inference.models.base import F32, rms_norm, route_topk, swiglu_columns, swiglu_fused
from czyx.inference.opened import OpenedModel

#: A routed call to the experts of other shards: ``(layer, x rows, idx, w, decode)``
#: for each owning shard -> list of ``(flat (row, k) indices, [n, H] values)``.
Dispatch = Callable[
    [int, dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]], bool],
    dict[int, tuple[np.ndarray, np.ndarray]],
]


def _open_engine(
    store_dir: str,
    ref: str,
    token: str | None,
    cache_fraction: float | None,
    lazy: bool,
    own: Callable[[OpenedModel, Any], int],
) -> tuple[OpenedModel, Engine]:
    """Open this node's store through its portal and an engine whose slot budget is
    ``cache_fraction`` (None: all) of the experts this node uses, ``own(opened, cfg)``
    of them (never below one token's top-k)."""
    from czyx.inference.models import decoder_class

    if cache_fraction is not None and not 0.0 < cache_fraction <= 1.0:
        raise ValueError(f"cache fraction {cache_fraction} is not in (0, 1]")
    opened = OpenedModel(store_dir, ref, token, lazy_trunk=lazy)
    try:
        info = opened.consumer.info
        cfg = decoder_class(info.arch).parse_config(info)
        frac = 1.0 if cache_fraction is None else cache_fraction
        slots = max(cfg.top_k, int(own(opened, cfg) * frac))
        engine = Engine(
            opened.consumer, cache_bytes=slots * int(info.expert_slot_nbytes), stream=None
        )
    except BaseException:
        opened.close()
        raise
    return opened, engine


def _class_map(opened: OpenedModel, n_layers: int, n_experts: int) -> np.ndarray:
    """``[layer, router byte] -> key class`` of the opened version (its layout)."""
    from czyx.space import Selector
    from czyx.store.models.expert_layout import layout_from_manifest

    manifest = opened.store.manifest(Selector(opened.consumer.info.selector))
    layout = layout_from_manifest(manifest)
    return np.asarray(
        layout.class_array(np.arange(n_layers)[:, None], np.arange(n_experts)[None, :])
    )


class LayerStage:
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

        self.opened, self.engine = _open_engine(
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
        model, cfg = self.engine.model, self.engine.model.cfg
        kv = self.kv.get(req)
        if kv is None:
            kv = self.kv[req] = model.new_kv()
        x = np.asarray(x)
        self.bytes_in += x.nbytes
        self.calls += 1
        h = take_rows(model.embed, x.astype(np.int64).reshape(-1)) if self.first else x
        start, t = kv.length, h.shape[0]
        kv.reserve(start + t)
        positions = np.arange(start, start + t)
        self.engine.cache.advance(t)
        for i in range(self.lo, self.hi):
            lw = model.layers[i]
            y = rms_norm(h, lw.input_norm, cfg.rms_eps)
            h = h + model._attention(i, lw, y, kv, start, positions)
            y = rms_norm(h, lw.post_attn_norm, cfg.rms_eps)
            h = h + model._mlp(i, lw, y)
        kv.length = start + t
        if self.last:
            out = mm_t(rms_norm(h[-1:], model.final_norm, cfg.rms_eps), model.lm_head)[0]
        else:
            out = h
        self.bytes_out += out.nbytes
        return out

    def end(self, req: Any) -> None:
        """Forget request ``req`` (its KV cache)."""
        self.kv.pop(req, None)

    def counters(self) -> dict[str, int]:
        """Activation bytes in and out and calls so far, and this stage's cache counters."""
        st = self.engine.stats()
        return {
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "calls": self.calls,
            "hits": st.hits,
            "misses": st.misses,
        }

    def close(self) -> None:
        """Release the engine, then the store."""
        try:
            self.engine.close()
        finally:
            self.opened.close()


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


class ExpertShard:
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

        self.opened, self.engine = _open_engine(
            store_dir, ref, token, cache_fraction, lazy=False, own=own
        )
        model = self.engine.model
        self.owner = owner["map"]
        self.index = index
        self.dispatch: Dispatch | None = None
        self.kv: dict[Any, Any] = {}
        # Expert products and the slot cache are single-threaded; peers' partial
        # calls and this node's own forward take turns on them.
        self._lock = threading.Lock()
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
        return self.engine.model.forward(ids, kv)

    def end(self, req: Any) -> None:
        """Forget request ``req``."""
        self.kv.pop(req, None)

    def partial(
        self, layer: int, x: np.ndarray, idx: np.ndarray, w: np.ndarray, decode: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """Contributions of this shard's experts to routed rows ``x [n, H]``.

        ``idx``/``w`` are those rows' top-k experts and weights; ``decode`` says
        whether the whole batch was one token (the engine's one-token path).
        Returns ``(flat indices row * top_k + k, values [m, H])`` for the pairs
        whose expert this shard owns, each ``expert(x_row) * weight``.
        """
        with self._lock:
            return _expert_partial(
                self.engine, layer, x, idx, w, decode, self.owner[layer], self.index
            )

    def counters(self) -> dict[str, int]:
        """Activation bytes sent to / received from peers, remote calls, cache counters."""
        st = self.engine.stats()
        return {
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "remote_calls": self.remote_calls,
            "hits": st.hits,
            "misses": st.misses,
        }

    def close(self) -> None:
        """Release the engine, then the store."""
        try:
            self.engine.close()
        finally:
            self.opened.close()


def _make_routed(shard: ExpertShard) -> Callable[..., np.ndarray]:
    """The decoder's routed-expert step, with experts of other shards computed there."""

    def routed(model: Any, i: int, lw: Any, x: np.ndarray) -> np.ndarray:
        cfg = model.cfg
        idx, w = route_topk(mm_t(x, lw.router), cfg.top_k, cfg.renormalize)
        model.route_counts[i] += np.bincount(idx.ravel(), minlength=cfg.n_experts)
        t, k = idx.shape
        decode = t == 1
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
            pending = shard.dispatch(i, {s: j[1:] for s, j in remote.items()}, decode)
        results = {}
        if shard.index in jobs:
            rows, xr, ir, wr = jobs[shard.index]
            results[shard.index] = shard.partial(i, xr, ir, wr, decode)
        if pending is not None:
            got = pending()
            for s, (sel, vals) in got.items():
                shard.bytes_received += vals.nbytes + sel.nbytes
                results[s] = (sel, vals)
        for s, (sel, vals) in results.items():
            rows = jobs[s][0]
            # (local row, k) -> (global row, k)
            cflat[rows[sel // k] * k + sel % k] = vals
        # Fixed top-k order: the same sum as the single-process engine.
        return contrib.sum(axis=1)

    return routed


def _expert_partial(
    engine: Engine,
    layer: int,
    x: np.ndarray,
    idx: np.ndarray,
    w: np.ndarray,
    decode: bool,
    owner_row: np.ndarray,
    me: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Mirror of ``MoEDecoder._routed``'s expert loop over the experts ``me`` owns."""
    cache = engine.cache
    n, k = idx.shape
    hidden = x.shape[1]
    mine = owner_row[idx] == me  # [n, k]
    sel_all = np.flatnonzero(mine.ravel())
    out = np.zeros((n * k, hidden), F32)
    if decode:
        order = idx[0][mine[0]]
        js = np.flatnonzero(mine[0])
    else:
        flat = idx.ravel()
        pairs = np.argsort(flat, kind="stable")
        counts = np.bincount(flat, minlength=engine.cfg.n_experts)
        ends = np.cumsum(counts)
        uniq = np.flatnonzero(counts)
        uniq = uniq[owner_row[uniq] == me]
        order = uniq[np.argsort(cache.table[layer, uniq] < 0, kind="stable")]
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
                if decode:
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
