"""Class orderings: a per-layer permutation that puts co-routed experts on adjacent classes.

Scope: learning the permutation from a trace and writing it for ``czyx mount
--class-order``. A token's k experts in one layer are read in one seek only
if they sit on adjacent class values, so the objective is the co-occurrence
mass on adjacent positions: ``sum_i W[o_i, o_{i+1}]`` for an order ``o``, a
maximum-weight Hamiltonian path on the within-layer co-occurrence graph ``W``.

Method (per layer): two starting orders, the *spectral* order (experts sorted
by the Fiedler vector of the Laplacian ``D - W``, which keeps heavy edges
short) and a *greedy chain* (heaviest edges first, each expert at most two
neighbours, no cycles: the greedy matching heuristic for the path TSP), each
refined by 2-opt segment reversals until no reversal gains; the better of the
two on the learning trace is kept.

The permutation convention used everywhere: ``class_of[l, r]`` is the class
value (byte) given to the expert the router calls ``r`` in layer ``l``;
``order[l, c]`` is its inverse (which router index sits at class ``c``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from czyx.inference.locality.cooccur import adjacent_layers, within_layer
from czyx.inference.locality.errors import LocalityError
from czyx.inference.trace import RoutingTrace


def path_weight(w: np.ndarray, order: np.ndarray) -> float:
    """Co-occurrence weight on adjacent positions of ``order``."""
    order = np.asarray(order)
    return float(w[order[:-1], order[1:]].sum())


def spectral_order(w: np.ndarray) -> np.ndarray:
    """Experts sorted by the Fiedler vector of the graph Laplacian of ``w``."""
    w = np.asarray(w, dtype=np.float64)
    w = (w + w.T) / 2
    lap = np.diag(w.sum(axis=1)) - w
    _, vecs = np.linalg.eigh(lap)
    fiedler = vecs[:, 1] if len(w) > 1 else np.zeros(1)
    return np.argsort(fiedler, kind="stable")


def greedy_chain(w: np.ndarray) -> np.ndarray:
    """Max-weight path by greedy edge selection (degree <= 2, no cycles), fragments joined."""
    n = len(w)
    parent = list(range(n))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    iu, ju = np.triu_indices(n, 1)
    vals = np.asarray(w, dtype=np.float64)[iu, ju] + np.asarray(w, dtype=np.float64)[ju, iu]
    deg = np.zeros(n, dtype=np.int64)
    adj: list[list[int]] = [[] for _ in range(n)]
    for e in np.argsort(-vals, kind="stable"):
        a, b = int(iu[e]), int(ju[e])
        if deg[a] < 2 and deg[b] < 2 and find(a) != find(b):
            parent[find(a)] = find(b)
            deg[a] += 1
            deg[b] += 1
            adj[a].append(b)
            adj[b].append(a)
    # walk each fragment from an endpoint; concatenate fragments in index order
    seen = np.zeros(n, dtype=bool)
    out: list[int] = []
    for start in range(n):
        if seen[start] or deg[start] == 2:
            continue
        prev, cur = -1, start
        while cur != -1:
            seen[cur] = True
            out.append(cur)
            nxt = [x for x in adj[cur] if x != prev and not seen[x]]
            prev, cur = cur, (nxt[0] if nxt else -1)
    return np.asarray(out, dtype=np.int64)


def two_opt(w: np.ndarray, order: np.ndarray, max_passes: int = 50) -> np.ndarray:
    """Improve a path order by segment reversals while the adjacent weight grows."""
    w = np.asarray(w, dtype=np.float64)
    w = w + w.T
    o = np.array(order, dtype=np.int64)
    n = len(o)
    for _ in range(max_passes):
        improved = False
        for i in range(n - 1):
            # reverse o[i..j]: edges (i-1, i) and (j, j+1) become (i-1, j) and (i, j+1)
            j = np.arange(i + 1, n)
            left_old = w[o[i - 1], o[i]] if i > 0 else 0.0
            left_new = w[o[i - 1], o[j]] if i > 0 else np.zeros(len(j))
            nxt = np.minimum(j + 1, n - 1)
            has_right = j + 1 < n
            right_old = np.where(has_right, w[o[j], o[nxt]], 0.0)
            right_new = np.where(has_right, w[o[i], o[nxt]], 0.0)
            gain = left_new + right_new - left_old - right_old
            best = int(np.argmax(gain))
            if gain[best] > 1e-9:
                jj = int(j[best])
                o[i : jj + 1] = o[i : jj + 1][::-1].copy()
                improved = True
        if not improved:
            break
    return o


def best_order(w: np.ndarray) -> tuple[np.ndarray, str]:
    """The better of spectral+2-opt and greedy-chain+2-opt; returns (order, method name)."""
    cands = {
        "spectral+2opt": two_opt(w, spectral_order(w)),
        "greedy+2opt": two_opt(w, greedy_chain(w)),
    }
    name = max(cands, key=lambda k: path_weight(w, cands[k]))
    return cands[name], name


def invert(order: np.ndarray) -> np.ndarray:
    """Inverse permutation(s) along the last axis."""
    order = np.asarray(order)
    inv = np.empty_like(order)
    np.put_along_axis(inv, order, np.arange(order.shape[-1]) * np.ones_like(order), axis=-1)
    return inv


def learn_class_order(trace: RoutingTrace) -> np.ndarray:
    """Per-layer ``class_of`` ``[L, E]`` (router index -> class value) learned from a trace."""
    c = within_layer(trace)
    order = np.stack([best_order(c[layer])[0] for layer in range(trace.n_layers)])
    return invert(order)


def aligned_class_order(trace: RoutingTrace) -> np.ndarray:
    """Layer 0 by :func:`best_order`; each next layer placed to follow its predecessors.

    Layer ``l+1``'s expert ``j`` takes the class value of the layer-``l``
    expert it most often follows (heaviest transitions first, each class used
    once). With a 2-D curve over ``(layer, class)`` whose neighbours include
    ``(l+1, c)``, this puts a token's consecutive-layer experts close; it gives
    up within-layer adjacency for layers after the first.
    """
    a = adjacent_layers(trace)
    L, E = trace.n_layers, trace.n_experts
    class_of = np.empty((L, E), dtype=np.int64)
    class_of[0] = invert(best_order(within_layer(trace)[0])[0])
    for layer in range(L - 1):
        t = a[layer]
        free_cls = np.ones(E, dtype=bool)
        free_exp = np.ones(E, dtype=bool)
        nxt = np.full(E, -1, dtype=np.int64)
        for flat in np.argsort(-t.ravel(), kind="stable"):
            i, j = divmod(int(flat), E)
            c = class_of[layer, i]
            if free_cls[c] and free_exp[j]:
                nxt[j] = c
                free_cls[c] = False
                free_exp[j] = False
        nxt[free_exp] = np.flatnonzero(free_cls)
        class_of[layer + 1] = nxt
    return class_of


def check_class_order(class_of: np.ndarray, n_layers: int, n_experts: int, source: str) -> None:
    """Raise :class:`LocalityError` unless each row is a permutation of ``range(n_experts)``."""
    if class_of.shape != (n_layers, n_experts):
        raise LocalityError(
            f"{source}: class order shape {class_of.shape}, expected {(n_layers, n_experts)}"
        )
    ok = (np.sort(class_of, axis=1) == np.arange(n_experts)[None, :]).all(axis=1)
    if not ok.all():
        raise LocalityError(f"{source}: row {int(np.argmin(ok))} is not a permutation")


def class_order_from_trace(path: str | Path) -> np.ndarray:
    """The class permutation ``czyx mount --class-order TRACE`` applies.

    Parameters
    ----------
    path : str or Path
        A routing trace (``.npz``, :mod:`inference.trace`) or a saved order
        (``.npy`` of shape ``[L, E]``, as ``czyx locality --out`` writes).

    Returns
    -------
    np.ndarray
        int64 ``[L, E]``: ``class_of[l, r]`` is the class value for router
        index ``r`` of MoE layer ``l``; every row a permutation of ``range(E)``.
    """
    path = Path(path)
    if path.suffix == ".npy":
        class_of = np.load(path, allow_pickle=False).astype(np.int64)
        if class_of.ndim != 2:
            raise LocalityError(f"{path}: expected a 2-D [L, E] array, got {class_of.shape}")
        check_class_order(class_of, class_of.shape[0], class_of.shape[1], str(path))
        return class_of
    trace = RoutingTrace.load(path)
    class_of = learn_class_order(trace)
    check_class_order(class_of, trace.n_layers, trace.n_experts, str(path))
    return class_of
