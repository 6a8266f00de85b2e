"""Expert-cache policies replayed on routing traces at fixed budgets.

Scope: the request stream an engine issues (token by token, layer by layer,
the k experts of a layer together) and five residency policies over a cache
of ``budget`` expert slots, each returning the hit/miss of every request so
other measures (seeks, bytes) can be computed on the misses:

- ``lru``: least recently used;
- ``hotness``: decaying frequency (each access adds 1, scores halve every
  ``half_life`` tokens; evict the lowest);
- ``slru``: segmented LRU (a probation segment and a protected segment of
  ``protected_frac`` of the budget; a second hit promotes);
- ``pinned``: a hot set learned on another trace (the most used experts)
  holds ``pin_frac`` of the budget and is never evicted; LRU for the rest.
  With a usage-sorted class order the pinned set is a class prefix per layer;
- ``belady``: Belady's MIN with bypass (evict the item used furthest in the
  future, or do not admit the incoming one if it is that item): the offline
  optimum, an upper bound for every other policy.

and, outside :data:`POLICIES` (it needs the layer structure, not just the
request stream), :func:`nextuse`: the engine's ``nextuse`` policy replayed
in the engine's order (a layer's resident experts first, then its misses,
never evicting an expert the same layer group holds).

All policies start cold and are demand-driven; ids are ``layer * E + expert``.
Replay is sequential by nature, so it is a plain loop over requests with O(1)
(or O(log B) for the heap policies) work each.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from czyx.inference.eviction import HALF_LIFE_TOKENS, START_HALF_LIFE_TOKENS, WARMUP_TOKENS
from czyx.inference.locality.errors import LocalityError
from czyx.inference.trace import RoutingTrace

POLICIES = ("lru", "hotness", "slru", "pinned", "belady")


def request_stream(trace: RoutingTrace) -> tuple[np.ndarray, np.ndarray]:
    """Flatten a trace into (ids, token index) per request, in engine order.

    Returns
    -------
    tuple of np.ndarray
        int64 ``[T*L*k]`` expert ids ``layer * E + expert`` and the token of each.
    """
    L, E, k = trace.n_layers, trace.n_experts, trace.top_k
    ids = trace.experts.astype(np.int64) + (np.arange(L, dtype=np.int64) * E)[None, :, None]
    tok = np.repeat(np.arange(trace.n_tokens, dtype=np.int64), L * k)
    return ids.reshape(-1), tok


def next_use(ids: np.ndarray) -> np.ndarray:
    """For each request, the index of the next request for the same id (``len(ids)`` if none)."""
    n = len(ids)
    order = np.lexsort((np.arange(n), ids))  # by id, then position
    nxt = np.full(n, n, dtype=np.int64)
    same = ids[order[1:]] == ids[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def lru(ids: np.ndarray, budget: int) -> np.ndarray:
    """Hit mask of an LRU cache of ``budget`` slots."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = np.zeros(len(ids), dtype=bool)
    for i, x in enumerate(ids.tolist()):
        if x in cache:
            cache.move_to_end(x)
            hits[i] = True
        else:
            if len(cache) >= budget:
                cache.popitem(last=False)
            cache[x] = None
    return hits


def hotness(
    ids: np.ndarray, tokens: np.ndarray, budget: int, half_life: float = 32.0
) -> np.ndarray:
    """Hit mask of a decaying-frequency cache (scores halve every ``half_life`` tokens).

    Scores are kept in the log domain relative to time zero, ``lv = log(s) +
    t * ln2 / half_life``, so the eviction order never needs rescaling.
    """
    rate = math.log(2.0) / half_life
    n_ids = int(ids.max()) + 1 if len(ids) else 0
    lv = np.full(n_ids, -np.inf)  # remembered for evicted experts too
    cached = np.zeros(n_ids, dtype=bool)
    heap: list[tuple[float, int]] = []
    size = 0
    hits = np.zeros(len(ids), dtype=bool)
    for i, (x, t) in enumerate(zip(ids.tolist(), tokens.tolist())):
        now = t * rate
        old = lv[x]
        s = math.exp(old - now) if old > -np.inf else 0.0
        new = math.log(s + 1.0) + now
        if cached[x]:
            hits[i] = True
        else:
            if size >= budget:
                while True:  # lazy deletion: skip entries whose score has moved on
                    v, y = heapq.heappop(heap)
                    if cached[y] and lv[y] == v:
                        break
                cached[y] = False
                size -= 1
            cached[x] = True
            size += 1
        lv[x] = new
        heapq.heappush(heap, (new, x))
    return hits


def slru(ids: np.ndarray, budget: int, protected_frac: float = 0.8) -> np.ndarray:
    """Hit mask of a segmented LRU with a protected segment of ``protected_frac * budget``."""
    cap_prot = max(0, min(budget - 1, int(budget * protected_frac)))
    prob: OrderedDict[int, None] = OrderedDict()
    prot: OrderedDict[int, None] = OrderedDict()
    hits = np.zeros(len(ids), dtype=bool)
    for i, x in enumerate(ids.tolist()):
        if x in prot:
            prot.move_to_end(x)
            hits[i] = True
        elif x in prob:
            hits[i] = True
            del prob[x]
            prot[x] = None
            if len(prot) > cap_prot:
                y, _ = prot.popitem(last=False)
                prob[y] = None
        else:
            if len(prob) + len(prot) >= budget:
                if prob:
                    prob.popitem(last=False)
                else:
                    prot.popitem(last=False)
            prob[x] = None
    return hits


def hot_set(learn: RoutingTrace, size: int) -> np.ndarray:
    """The ``size`` most used expert ids of a (learning) trace, most used first."""
    ids, _ = request_stream(learn)
    counts = np.bincount(ids, minlength=learn.n_layers * learn.n_experts)
    return np.argsort(-counts, kind="stable")[:size]


def pinned(ids: np.ndarray, budget: int, pinned_ids: Sequence[int]) -> np.ndarray:
    """Hit mask with ``pinned_ids`` never evicted (loaded on first use) and LRU elsewhere."""
    pins = {int(x) for x in pinned_ids}
    if len(pins) > budget:
        raise LocalityError(f"pinned set of {len(pins)} exceeds the budget of {budget} slots")
    cap = budget - len(pins)
    loaded: set[int] = set()
    cache: OrderedDict[int, None] = OrderedDict()
    hits = np.zeros(len(ids), dtype=bool)
    for i, x in enumerate(ids.tolist()):
        if x in pins:
            if x in loaded:
                hits[i] = True
            else:
                loaded.add(x)
        elif x in cache:
            cache.move_to_end(x)
            hits[i] = True
        elif cap > 0:
            if len(cache) >= cap:
                cache.popitem(last=False)
            cache[x] = None
    return hits


def belady(ids: np.ndarray, budget: int) -> np.ndarray:
    """Hit mask of Belady's MIN with bypass: the offline optimum for ``budget`` slots."""
    n = len(ids)
    nu = next_use(ids)
    n_ids = int(ids.max()) + 1 if n else 0
    cur = np.full(n_ids, -1, dtype=np.int64)  # next use of each cached id, -1 if absent
    heap: list[tuple[int, int]] = []  # (-next_use, id), lazily invalidated
    size = 0
    hits = np.zeros(n, dtype=bool)
    for i, x in enumerate(ids.tolist()):
        nx = int(nu[i])
        if cur[x] >= 0:
            hits[i] = True
        else:
            if size >= budget:
                while True:
                    v, y = heap[0]
                    if cur[y] == -v:
                        break
                    heapq.heappop(heap)
                if nx >= -v:  # the incoming one is needed last: do not admit it
                    continue
                heapq.heappop(heap)
                cur[y] = -1
                size -= 1
            size += 1
        cur[x] = nx
        heapq.heappush(heap, (-nx, x))
    return hits


def nextuse(
    experts: np.ndarray,
    n_experts: int,
    budget: int,
    half_life: float = HALF_LIFE_TOKENS,
    start_half_life: float = START_HALF_LIFE_TOKENS,
    warmup: float = WARMUP_TOKENS,
) -> np.ndarray:
    """Hit mask of the expected-next-use policy, served as the engine serves a layer.

    Decode order, one token per forward step: for each token and layer, the
    layer's resident experts are used first, then each miss evicts the
    resident (not of this layer group) whose expected next use lies farthest:
    ``1 / (c * score) + d / n_layers`` tokens, where ``score`` is the expert's
    use count decayed with ``half_life`` (as :func:`hotness`), ``c = 1 -
    2**(-1 / half_life)`` and ``d`` how many layers ahead its layer comes (the
    group's own layer: ``n_layers``); ties to the lowest id. The half-life grows
    linearly from ``start_half_life`` at token 0 to ``half_life`` at token
    ``warmup``, the clock advancing ``ln 2 / h`` a token. A plain loop with
    a scan of the cache per miss: the reference the engine's
    :class:`~czyx.inference.eviction.NextUsePolicy` is tested against.

    Parameters
    ----------
    experts : np.ndarray
        ``[T, L, k]`` routed experts (a trace's :attr:`RoutingTrace.experts`).
    n_experts : int
        Experts per layer; ids are ``layer * n_experts + expert``.
    budget : int
        Cache slots, at least ``k``.
    half_life : float
        Tokens after which a score halves, once warm.
    start_half_life, warmup : float
        The half-life at token 0, and the tokens it takes to reach ``half_life``.

    Returns
    -------
    np.ndarray
        bool ``[T*L*k]`` in :func:`request_stream` order.
    """
    t_, n_layers, k = experts.shape
    if budget < k:
        raise LocalityError(f"budget {budget} below top_k {k}")
    ln2 = math.log(2.0)
    lv = [-math.inf] * (n_layers * n_experts)
    cached: set[int] = set()
    hits = np.zeros(t_ * n_layers * k, dtype=bool)
    i = 0
    now = 0.0
    for t in range(t_):
        h = start_half_life + (half_life - start_half_life) * min(t / warmup, 1.0)
        now += 1 * ln2 / h
        log_inv_c = -math.log1p(-(2.0 ** (-1.0 / h)))
        for layer in range(n_layers):
            group = [layer * n_experts + int(e) for e in experts[t, layer]]
            resident = [x in cached for x in group]
            hits[i : i + k] = resident
            held: set[int] = set()
            # Hits first (all held), then the misses in order.
            order = [j for j in range(k) if resident[j]] + [j for j in range(k) if not resident[j]]
            for j in order:
                x = group[j]
                if x in cached:
                    pass
                elif len(cached) >= budget:
                    far, victim = -math.inf, -1
                    for y in sorted(cached - held):
                        d = (y // n_experts - layer) % n_layers or n_layers
                        w = math.exp(min(now + log_inv_c - lv[y], 700.0)) + d / n_layers
                        if w > far:
                            far, victim = w, y
                    cached.discard(victim)
                    cached.add(x)
                else:
                    cached.add(x)
                held.add(x)
                old = lv[x]
                s = math.exp(old - now) if old > -math.inf else 0.0
                lv[x] = math.log(s + 1.0) + now
            i += k
    return hits


def replay(
    measure: RoutingTrace,
    policy: str,
    budget: int,
    *,
    learn: RoutingTrace | None = None,
    pin_frac: float = 0.5,
    half_life: float = 32.0,
) -> np.ndarray:
    """Hit mask of ``policy`` replayed on ``measure`` with ``budget`` slots.

    Parameters
    ----------
    measure : RoutingTrace
        The trace replayed.
    policy : str
        One of :data:`POLICIES`.
    budget : int
        Cache slots (experts); at least ``top_k`` (a layer's experts must fit).
    learn : RoutingTrace, optional
        Where ``pinned`` learns its hot set (defaults to ``measure`` itself,
        which flatters it: pass a held-out learning trace).
    pin_frac : float
        Share of the budget pinned by ``pinned``.
    half_life : float
        Tokens after which a ``hotness`` score halves.

    Returns
    -------
    np.ndarray
        bool ``[T*L*k]`` in :func:`request_stream` order.
    """
    if budget < measure.top_k:
        raise LocalityError(f"budget {budget} below top_k {measure.top_k}")
    ids, tok = request_stream(measure)
    if policy == "lru":
        return lru(ids, budget)
    if policy == "hotness":
        return hotness(ids, tok, budget, half_life)
    if policy == "slru":
        return slru(ids, budget)
    if policy == "pinned":
        return pinned(ids, budget, hot_set(learn or measure, int(budget * pin_frac)))
    if policy == "belady":
        return belady(ids, budget)
    raise LocalityError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")
