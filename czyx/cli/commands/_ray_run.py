"""``czyx run --ray ADDRESS --shape pipeline|experts``: one version over a Ray cluster.

Kept apart from :mod:`czyx.cli.commands.run` (whose single-process path it
does not touch). The driver opens its local store only for the config and
the tokenizer; each of ``--nodes`` actors opens its own store (``--node-store``,
repeated per node, default ``--store`` for all: the path on that node) through
its own portal (``--node-portal``, default ``--portal``). ``--shape
pipeline`` splits the layers into contiguous ranges, ``--shape experts`` the
routed experts into class ranges (each node's store may then hold only its
range, see ``czyx pull --classes``). Greedy decoding only. ``--ray local``
starts a Ray instance on this machine for the run.
"""

from __future__ import annotations

import argparse
import sys
import time

from czyx.cli.commands._storearg import store_dir


def add_args(p: argparse.ArgumentParser) -> None:
    """The ``--ray`` options of ``czyx run``."""
    g = p.add_argument_group("distributed (Ray)")
    g.add_argument(
        "--ray", metavar="ADDRESS", help="run over this Ray cluster ('local': start one)"
    )
    g.add_argument(
        "--shape",
        choices=["pipeline", "experts"],
        default="pipeline",
        help="pipeline: layer ranges per node; experts: class ranges per node",
    )
    g.add_argument("--nodes", type=int, default=2, help="actors to place (default 2)")
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
        help="with --shape experts: each node's class range, once per node "
        "(default: equal contiguous ranges)",
    )
    g.add_argument(
        "--node-portal",
        action="append",
        metavar="TOKEN",
        help="each node's portal, once per node (default: --portal)",
    )


def _per_node(values: list[str] | None, default: str | None, n: int, what: str) -> list:
    if not values:
        return [default] * n
    if len(values) != n:
        raise ValueError(f"--{what} given {len(values)} times for {n} nodes")
    return list(values)


def run_ray(args: argparse.Namespace) -> int:
    """Generate greedily over the cluster; text on stdout, figures on stderr."""
    from contextlib import nullcontext

    from czyx.inference.distributed.ray_cluster import (
        NodeSpec,
        RayExpertParallel,
        RayPipeline,
        _ray,
        local_ray,
        split_classes,
        split_layers,
    )
    from czyx.inference.engine import Engine
    from czyx.inference.opened import OpenedModel
    from czyx.inference.options import EngineOptions
    from czyx.inference.tokenizer import tokenizer_for
    from czyx.store.models.replicate import Range

    if args.temperature != 0.0 or args.session:
        raise ValueError("--ray runs greedy decoding without sessions")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens {args.max_tokens} must be at least 1")
    n = args.nodes
    stores = _per_node(args.node_store, store_dir(args), n, "node-store")
    portals = _per_node(args.node_portal, args.portal, n, "node-portal")
    with OpenedModel(store_dir(args), args.ref, args.portal) as om:
        engine = Engine(om.consumer, options=EngineOptions(stream=False))
        cfg = engine.cfg
        engine.close()
        tokenizer = tokenizer_for(om.consumer, cfg.vocab_size)
    ids = tokenizer.encode(args.prompt)
    ray = _ray()
    # An already connected driver (a script or a test that called ray.init) is reused.
    attach = not ray.is_initialized() and args.ray != "local"
    ctx = (
        local_ray(num_cpus=max(2, n))
        if args.ray == "local" and not ray.is_initialized()
        else nullcontext()
    )
    with ctx:
        if attach:
            ray.init(address=args.ray, log_to_driver=False, configure_logging=False)
        try:
            specs = [NodeSpec(s, args.ref, t) for s, t in zip(stores, portals)]
            if args.shape == "pipeline":
                driver = RayPipeline(
                    specs, split_layers(cfg.n_layers, n), cache_fraction=args.cache_fraction
                )
            else:
                ranges = split_classes(cfg.n_experts, n)
                if args.node_classes:
                    got = [Range.parse(c, 256, "class") for c in args.node_classes]
                    ranges = [(r.lo, r.hi) for r in _per_node(got, None, n, "node-classes")]
                driver = RayExpertParallel(specs, ranges, cache_fraction=args.cache_fraction)
            with driver:
                t0 = time.perf_counter()
                out = driver.generate([ids], args.max_tokens)[0]
                dt = time.perf_counter() - t0
                counters = driver.counters()
        finally:
            if attach:
                ray.shutdown()
    sys.stdout.write(tokenizer.decode(out) + "\n")
    print(
        f"{args.shape} over {n} Ray actors: {len(ids)} prompt + {len(out)} generated tokens "
        f"in {dt:.2f} s ({len(out) / dt:.1f} tok/s)",
        file=sys.stderr,
    )
    for i, c in enumerate(counters):
        print(f"  node {i}: " + ", ".join(f"{k} {v}" for k, v in c.items()), file=sys.stderr)
    return 0
