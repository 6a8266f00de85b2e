"""``czyx run --ray ADDRESS`` and ``czyx serve --ray ADDRESS``: a version over a Ray cluster.

Kept apart from :mod:`czyx.cli.commands.run` and :mod:`czyx.cli.commands.serve`
(whose single-process paths it does not touch): thin layers over the public
distributed API (:mod:`czyx.inference.distributed`). The driver opens its
local store only for the config and the tokenizer (and, serving, the chat
template and sessions); each of ``--ray-nodes`` actors opens its own store
(``--node-store``, repeated per node, default ``--store`` for all: the path on
that node) through its own portal (``--node-portal``, default ``--portal``).
``--ray-shape pipeline`` splits the layers into contiguous ranges,
``--ray-shape experts`` the routed experts into class ranges (each node's store
may then hold only its range, see ``czyx pull --classes``). ``run`` decodes
greedily; ``serve`` samples as each request asks, one sequence per request with
up to ``--ray-in-flight`` requests in flight (no batching over Ray:
:mod:`czyx.inference.distributed.serving`). ``--ray local`` starts a Ray
instance on this machine for the command's lifetime.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from czyx.cli.commands._storearg import store_dir


def add_args(p: argparse.ArgumentParser, serving: bool = False) -> None:
    """The ``--ray`` options of ``czyx run`` (and, ``serving``, of ``czyx serve``)."""
    g = p.add_argument_group("distributed (Ray)")
    g.add_argument(
        "--ray", metavar="ADDRESS", help="run over this Ray cluster ('local': start one)"
    )
    g.add_argument(
        "--ray-shape",
        "--shape",
        dest="ray_shape",
        choices=["pipeline", "experts"],
        default="pipeline",
        help="pipeline: layer ranges per node; experts: class ranges per node",
    )
    g.add_argument(
        "--ray-nodes", "--nodes", dest="ray_nodes", type=int, default=2,
        help="actors to place (default 2)",
    )  # fmt: skip
    if serving:
        g.add_argument(
            "--ray-in-flight",
            type=int,
            default=None,
            help="requests with a step in flight over Ray (default --max-batch)",
        )
    g.add_argument(
        "--node-store",
        action="append",
        metavar="DIR",
        help="each node's store directory, once per node (default: --store)",
    )
    g.add_argument(
        "--node-classes",
        action="append",
        metavar="LO-HI",
        help="with --ray-shape experts: each node's class range, once per node "
        "(default: equal contiguous ranges)",
    )
    g.add_argument(
        "--node-portal",
        action="append",
        metavar="TOKEN",
        help="each node's portal, once per node (default: --portal; without one, the node "
        "store's owner)",
    )


def _per_node(values: list[str] | None, default: str | None, n: int, what: str) -> list:
    if not values:
        return [default] * n
    if len(values) != n:
        raise ValueError(f"--{what} given {len(values)} times for {n} nodes")
    return list(values)


@contextmanager
def ray_connection(args: argparse.Namespace) -> Iterator[None]:
    """Connected to ``--ray`` for the block: ``local`` starts an instance on this machine,
    an address is attached to; a driver already connected (a script or a test that
    called ``ray.init``) is reused and left connected."""
    from czyx.inference.distributed.ray_cluster import _ray, local_ray

    ray = _ray()
    if ray.is_initialized():
        yield
    elif args.ray == "local":
        with local_ray(num_cpus=max(2, args.ray_nodes)):
            yield
    else:
        ray.init(address=args.ray, log_to_driver=False, configure_logging=False)
        try:
            yield
        finally:
            ray.shutdown()


def make_driver(args: argparse.Namespace, ref: str, cfg: Any) -> Any:
    """Place version ``ref`` (config ``cfg``) over the connected cluster as the flags say:
    a started :class:`RayPipeline` or :class:`RayExpertParallel`."""
    from czyx.inference.distributed.ray_cluster import (
        NodeSpec,
        RayExpertParallel,
        RayPipeline,
        split_classes,
        split_layers,
    )
    from czyx.store.models.replicate import Range

    n = args.ray_nodes
    if n < 1:
        raise ValueError(f"--ray-nodes {n} must be at least 1")
    stores = _per_node(args.node_store, store_dir(args), n, "node-store")
    portals = _per_node(args.node_portal, getattr(args, "portal", None), n, "node-portal")
    specs = [NodeSpec(s, ref, t) for s, t in zip(stores, portals)]
    if args.ray_shape == "pipeline":
        if args.node_classes:
            raise ValueError("--node-classes applies to --ray-shape experts only")
        return RayPipeline(specs, split_layers(cfg.n_layers, n), cache_fraction=args.cache_fraction)
    ranges = split_classes(cfg.n_experts, n)
    if args.node_classes:
        got = [Range.parse(c, 256, "class") for c in args.node_classes]
        ranges = [(r.lo, r.hi) for r in _per_node(got, None, n, "node-classes")]
    return RayExpertParallel(specs, ranges, cache_fraction=args.cache_fraction)


def scheduler_factory(args: argparse.Namespace) -> Callable[..., Any]:
    """``czyx serve --ray``: the :class:`~czyx.server.ServeOptions` ``scheduler`` that
    places each served version over the cluster (connect first: :func:`ray_connection`)."""
    from czyx.inference.distributed.serving import RayScheduler

    if args.ray_in_flight is not None and args.ray_in_flight < 1:
        raise ValueError(f"--ray-in-flight {args.ray_in_flight} must be at least 1")
    if args.kv_mb is not None:
        raise ValueError("--kv-mb does not apply with --ray (each actor holds its own KV)")

    def make(ref: str, engine: Any, batch: Any, on_step: Callable[..., None]) -> Any:
        driver = make_driver(args, ref, engine.cfg)
        try:
            return RayScheduler(
                driver, engine.cfg.vocab_size, batch, on_step, in_flight=args.ray_in_flight
            )
        except BaseException:
            driver.close()
            raise

    return make


def run_ray(args: argparse.Namespace) -> int:
    """Generate greedily over the cluster; text on stdout, figures on stderr."""
    from czyx.inference.engine import Engine
    from czyx.inference.opened import OpenedModel
    from czyx.inference.options import EngineOptions
    from czyx.inference.tokenizer import tokenizer_for

    penalties = getattr(args, "presence_penalty", 0.0) or getattr(args, "frequency_penalty", 0.0)
    if args.temperature != 0.0 or args.session or penalties:
        raise ValueError("--ray runs plain greedy decoding: no sessions, no penalties")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens {args.max_tokens} must be at least 1")
    n = args.ray_nodes
    with OpenedModel(store_dir(args), args.ref, args.portal) as om:
        engine = Engine(om.consumer, options=EngineOptions(stream=False))
        cfg = engine.cfg
        engine.close()
        tokenizer = tokenizer_for(om.consumer, cfg.vocab_size)
    ids = tokenizer.encode(args.prompt)
    with ray_connection(args), make_driver(args, args.ref, cfg) as driver:
        t0 = time.perf_counter()
        out = driver.generate([ids], args.max_tokens)[0]
        dt = time.perf_counter() - t0
        counters = driver.counters()
    sys.stdout.write(tokenizer.decode(out) + "\n")
    print(
        f"{args.ray_shape} over {n} Ray actors: {len(ids)} prompt + {len(out)} generated tokens "
        f"in {dt:.2f} s ({len(out) / dt:.1f} tok/s)",
        file=sys.stderr,
    )
    for i, c in enumerate(counters):
        print(f"  node {i}: " + ", ".join(f"{k} {v}" for k, v in c.items()), file=sys.stderr)
    return 0
