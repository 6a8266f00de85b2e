"""Placing a model version over a Ray cluster: pipeline or expert-parallel actors.

Scope: Ray actors around :mod:`inference.distributed.stages` and the drivers
that feed them. Ray is the transport and scheduler (no home-made RPC): each
actor opens its own store through the portal it is handed, so no weights go
through Ray's object store, only activations (the residual stream between
pipeline stages; routed hidden rows and partial outputs between expert
shards).

* :class:`RayPipeline`: one actor per contiguous layer range. A request's
  step is a chain of actor calls whose arguments are the previous call's
  object refs, so the driver never waits between stages and several requests
  in flight keep every stage busy.
* :class:`RayExpertParallel`: one actor per class range. Each runs the whole
  trunk for the requests assigned to it (round robin) and calls its peers'
  ``partial`` for routed experts they own. Its trunk and expert work run in
  two Ray concurrency groups of one thread each, so a shard waiting on a peer
  still serves that peer's calls (no deadlock) and each group stays single-
  threaded.

Both drivers offer ``step(req, tokens) -> logits`` (for greedy decoding) and
``generate(prompts, max_tokens, in_flight)`` (greedy, several requests in
flight). Every wait on Ray is bounded by ``timeout_s``.

Ray is an optional dependency (``czyx[ray]``); this module imports it lazily.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from czyx.inference.errors import InferenceError

TIMEOUT_S = 120.0
_ACTORS: dict[str, Any] = {}


class DistributedError(InferenceError):
    """A distributed run cannot start or did not finish (bad split, Ray missing, timeout)."""


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise DistributedError("Ray is not installed: pip install 'czyx[ray]'") from exc
    return ray


@contextmanager
def local_ray(num_cpus: int = 2, nodes: int = 1) -> Iterator[str]:
    """Start a Ray cluster on this machine, yield its address, tear it down.

    ``nodes == 1``: one node bound to 127.0.0.1. ``nodes > 1``: a head and
    ``nodes - 1`` worker nodes (``ray.cluster_utils.Cluster``, on the host's
    own address: it does not start pinned to 127.0.0.1), each with
    ``num_cpus`` CPUs and a custom resource ``node<i>`` to place actors.
    """
    ray = _ray()
    env = {"env_vars": {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}}
    cluster = None
    try:
        if nodes > 1:
            # Several raylets on this machine. ray.cluster_utils picks the host's own
            # address for them (it does not come up when pinned to 127.0.0.1).
            from ray.cluster_utils import Cluster

            cluster = Cluster(
                initialize_head=True,
                head_node_args={
                    "num_cpus": num_cpus,
                    "resources": {"node0": 1},
                    "include_dashboard": False,
                },
            )
            for i in range(1, nodes):
                cluster.add_node(num_cpus=num_cpus, resources={f"node{i}": 1})
            ray.init(
                address=cluster.address,
                runtime_env=env,
                log_to_driver=False,
                configure_logging=False,
            )
        else:
            ray.init(
                address="local",  # always a new instance, never a stale one found on disk
                num_cpus=num_cpus,
                include_dashboard=False,
                runtime_env=env,
                log_to_driver=False,
                configure_logging=False,
                _node_ip_address="127.0.0.1",
                resources={"node0": 1},
            )
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


def _actor_classes() -> tuple[Any, Any]:
    if _ACTORS:
        return _ACTORS["stage"], _ACTORS["shard"]
    ray = _ray()

    @ray.remote
    class StageActor:
        def __init__(self, *args: Any, **kw: Any) -> None:
            from czyx.inference.distributed.stages import LayerStage

            self.stage = LayerStage(*args, **kw)

        def ping(self) -> int:
            return os.getpid()

        def forward(self, req: Any, x: np.ndarray) -> np.ndarray:
            return self.stage.forward(req, x)

        def end(self, req: Any) -> None:
            self.stage.end(req)

        def counters(self) -> dict:
            return self.stage.counters()

        def close(self) -> None:
            self.stage.close()

    @ray.remote(concurrency_groups={"trunk": 1, "experts": 1})
    class ShardActor:
        def __init__(self, *args: Any, **kw: Any) -> None:
            from czyx.inference.distributed.stages import ExpertShard

            self.shard = ExpertShard(*args, **kw)
            self.peers: list[Any] = []

        def ping(self) -> int:
            return os.getpid()

        def set_peers(self, peers: list[Any]) -> None:
            self.peers = peers
            self.shard.dispatch = self._dispatch

        def _dispatch(self, layer: int, jobs: dict, mode: str) -> Any:
            refs = {
                s: self.peers[s].partial.remote(layer, x, idx, w, mode)
                for s, (x, idx, w) in jobs.items()
            }
            return lambda: {s: ray.get(r, timeout=TIMEOUT_S) for s, r in refs.items()}

        @ray.method(concurrency_group="trunk")
        def forward(self, req: Any, tokens: np.ndarray) -> np.ndarray:
            return self.shard.forward(req, tokens)

        @ray.method(concurrency_group="trunk")
        def end(self, req: Any) -> None:
            self.shard.end(req)

        @ray.method(concurrency_group="experts")
        def partial(
            self, layer: int, x: np.ndarray, idx: np.ndarray, w: np.ndarray, mode: str
        ) -> tuple:
            return self.shard.partial(layer, x, idx, w, mode)

        @ray.method(concurrency_group="trunk")
        def counters(self) -> dict:
            return self.shard.counters()

        @ray.method(concurrency_group="trunk")
        def close(self) -> None:
            self.shard.close()

    _ACTORS.update(stage=StageActor, shard=ShardActor)
    return StageActor, ShardActor


@dataclass(frozen=True)
class NodeSpec:
    """Where one actor runs and what it opens: its store, the version and its portal.

    ``options`` are Ray actor options (e.g. ``{"resources": {"node1": 0.01}}`` to
    place it on a node, ``{"num_cpus": 0}`` to not reserve a CPU).
    """

    store_dir: str
    ref: str
    token: str | None = None
    options: tuple[tuple[str, Any], ...] = ()

    def actor_options(self) -> dict[str, Any]:
        """The Ray options as a dict."""
        return dict(self.options)


def split_layers(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Contiguous, balanced ``[lo, hi)`` layer ranges for ``n_stages`` stages."""
    if not 1 <= n_stages <= n_layers:
        raise DistributedError(f"{n_stages} stages for {n_layers} layers: need 1..{n_layers}")
    edges = np.linspace(0, n_layers, n_stages + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in itertools.pairwise(edges)]


def split_classes(n_classes: int, n_shards: int) -> list[tuple[int, int]]:
    """Contiguous inclusive class ranges ``(lo, hi)`` covering ``0..n_classes-1``."""
    if not 1 <= n_shards <= n_classes:
        raise DistributedError(f"{n_shards} shards for {n_classes} classes")
    edges = np.linspace(0, n_classes, n_shards + 1).round().astype(int)
    ranges = [(int(a), int(b) - 1) for a, b in itertools.pairwise(edges)]
    ranges[-1] = (ranges[-1][0], 255)  # the last shard also owns classes past the count
    return ranges


class _Driver:
    """Greedy generation over ``_submit(req, tokens) -> ObjectRef`` of the logits."""

    timeout_s = TIMEOUT_S
    _actors: list[Any]

    def _submit(self, req: Any, tokens: np.ndarray) -> Any:
        raise NotImplementedError

    def _end(self, req: Any) -> None:
        raise NotImplementedError

    def submit(self, req: Any, tokens: Sequence[int] | np.ndarray) -> Any:
        """Start ``tokens`` for request ``req`` without waiting: a Ray object ref of
        its last token's logits ``[V]`` (the serving scheduler keeps several in flight)."""
        return self._submit(req, np.asarray(tokens, np.int64))

    def step(self, req: Any, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """Run ``tokens`` for request ``req``; its last token's logits ``[V]``."""
        ray = _ray()
        return ray.get(self._submit(req, np.asarray(tokens, np.int64)), timeout=self.timeout_s)

    def end(self, req: Any) -> None:
        """Forget request ``req`` on every actor."""
        self._end(req)

    def generate(
        self, prompts: Sequence[Sequence[int]], max_tokens: int, in_flight: int = 1
    ) -> list[list[int]]:
        """Greedy-decode every prompt, at most ``in_flight`` requests at a time.

        Returns each prompt's ``max_tokens`` generated ids. A request's next
        step is submitted the moment its previous one returns.
        """
        ray = _ray()
        if max_tokens < 1 or in_flight < 1:
            raise DistributedError("max_tokens and in_flight must be at least 1")
        out: list[list[int]] = [[] for _ in prompts]
        queue = list(range(len(prompts)))[::-1]
        running: dict[Any, int] = {}
        base = id(self) << 20  # request ids unique to this driver's calls

        def start() -> None:
            while queue and len(running) < in_flight:
                r = queue.pop()
                running[self._submit(base + r, np.asarray(prompts[r], np.int64))] = r

        start()
        while running:
            done, _ = ray.wait(list(running), num_returns=1, timeout=self.timeout_s)
            if not done:
                raise DistributedError(f"no step finished within {self.timeout_s} s")
            ref = done[0]
            r = running.pop(ref)
            tok = int(np.argmax(ray.get(ref)))
            out[r].append(tok)
            if len(out[r]) < max_tokens:
                running[self._submit(base + r, np.array([tok], np.int64))] = r
            else:
                self._end(base + r)
                start()
        return out

    def counters(self) -> list[dict]:
        """Each actor's counters (activation bytes, calls, cache hits and misses)."""
        ray = _ray()
        return ray.get([a.counters.remote() for a in self._actors], timeout=self.timeout_s)

    def close(self) -> None:
        """Close every actor's engine and store, then end the actors."""
        ray = _ray()
        try:
            ray.get([a.close.remote() for a in self._actors], timeout=self.timeout_s)
        finally:
            for a in self._actors:
                ray.kill(a)
            self._actors = []

    def __enter__(self) -> _Driver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RayPipeline(_Driver):
    """A model version split into contiguous layer ranges, one Ray actor each.

    Parameters
    ----------
    nodes
        One :class:`NodeSpec` per stage, in layer order.
    layers
        ``[lo, hi)`` per stage (see :func:`split_layers`), covering every layer.
    cache_fraction
        Each stage's expert slot budget (fraction of the experts of its layers).
    """

    def __init__(
        self,
        nodes: Sequence[NodeSpec],
        layers: Sequence[tuple[int, int]],
        *,
        cache_fraction: float | None = None,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        ray = _ray()
        if len(nodes) != len(layers) or not nodes:
            raise DistributedError("one node per layer range")
        if layers[0][0] != 0 or any(a[1] != b[0] for a, b in itertools.pairwise(layers)):
            raise DistributedError(f"layer ranges {list(layers)} are not contiguous from 0")
        self.timeout_s = timeout_s
        stage_cls, _ = _actor_classes()
        self._actors = [
            stage_cls.options(**n.actor_options()).remote(
                n.store_dir, n.ref, n.token, lo, hi, cache_fraction=cache_fraction
            )
            for n, (lo, hi) in zip(nodes, layers)
        ]
        try:
            ray.get([a.ping.remote() for a in self._actors], timeout=timeout_s)
        except Exception:
            for a in self._actors:
                ray.kill(a)
            raise

    def _submit(self, req: Any, tokens: np.ndarray) -> Any:
        ref: Any = tokens
        for a in self._actors:
            ref = a.forward.remote(req, ref)
        return ref

    def _end(self, req: Any) -> None:
        for a in self._actors:
            a.end.remote(req)


class RayExpertParallel(_Driver):
    """A model version whose routed experts are split by class range, one Ray actor each.

    Parameters
    ----------
    nodes
        One :class:`NodeSpec` per shard; a node's store needs the trunk and
        the experts of its class range (a ``czyx pull --classes`` subset will do).
    classes
        Inclusive class range per shard (see :func:`split_classes`), disjoint,
        covering every class the model uses.
    cache_fraction
        Each shard's expert slot budget (fraction of the experts of its classes).
    """

    def __init__(
        self,
        nodes: Sequence[NodeSpec],
        classes: Sequence[tuple[int, int]],
        *,
        cache_fraction: float | None = None,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        ray = _ray()
        if len(nodes) != len(classes) or not nodes:
            raise DistributedError("one node per class range")
        self.timeout_s = timeout_s
        _, shard_cls = _actor_classes()
        ranges = [tuple(c) for c in classes]
        self._actors = [
            shard_cls.options(**n.actor_options()).remote(
                n.store_dir, n.ref, n.token, i, ranges, cache_fraction=cache_fraction
            )
            for i, n in enumerate(nodes)
        ]
        try:
            ray.get([a.ping.remote() for a in self._actors], timeout=timeout_s)
            ray.get([a.set_peers.remote(self._actors) for a in self._actors], timeout=timeout_s)
        except Exception:
            for a in self._actors:
                ray.kill(a)
            raise
        self._home: dict[Any, Any] = {}
        self._assigned = 0

    def _submit(self, req: Any, tokens: np.ndarray) -> Any:
        a = self._home.get(req)
        if a is None:  # round robin: each request's trunk runs on one shard
            a = self._home[req] = self._actors[self._assigned % len(self._actors)]
            self._assigned += 1
        return a.forward.remote(req, tokens)

    def _end(self, req: Any) -> None:
        a = self._home.pop(req, None)
        if a is not None:
            a.end.remote(req)
