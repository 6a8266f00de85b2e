"""Per-node stores for distributed tests and benches, made by replication.

Each node of a sharded run opens its own store; here every node store is
filled from one source store through :mod:`czyx.store.models.replicate` (the
same plan, staging and publication as ``czyx pull``, reading the source's
block files directly instead of over HTTP), optionally as a class subset, and
given its own ``infer`` portal.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from czyx.portals.model import grant_model
from czyx.space import Selector
from czyx.store import Store
from czyx.store.models.replicate import Range, build_offer, plan_pull, run_pull


def node_store(
    source: Store, ref: str, dest_dir: str | Path, classes: tuple[int, int] | None = None
) -> str:
    """Replicate ``ref`` (or its class subset) into a new store at ``dest_dir``;
    returns an ``infer`` portal token of that store."""

    def fetch(space: str, start: int, end: int) -> bytes:
        with open(source.block_path(Selector.from_hex(space)), "rb") as f:
            f.seek(start)
            return f.read(end - start)

    cls = None if classes is None else Range(*classes)
    with Store.open(dest_dir) as dest:
        run_pull(dest, plan_pull(dest, build_offer(source, ref, classes=cls)), fetch, tag=ref)
        return grant_model(dest, ref, tenant="node", rights="infer").token


#: The node stores the distributed tests shard the bundled model over, by name:
#: two whole copies (pipeline stages) and two class halves (expert shards).
NODE_CLASSES: dict[str, tuple[int, int] | None] = {
    "full0": None,
    "full1": None,
    "sub0": (0, 5),
    "sub1": (6, 255),
}


def bundled_node_stores(root: str | Path, ref: str = "m@1") -> dict[str, str]:
    """Mount the bundled model as ``ref`` in a source store at ``root / "src"`` and
    replicate it into one node store per :data:`NODE_CLASSES` entry, at ``root / name``.

    Returns
    -------
    dict
        Each node's ``infer`` portal token, by name.
    """
    from czyx.inference.assets import bundled_model_dir
    from czyx.store.models.mount import mount

    root = Path(root)
    with Store.open(root / "src") as src:
        mount(src, bundled_model_dir(), ref)
        return {
            name: node_store(src, ref, root / name, classes=classes)
            for name, classes in NODE_CLASSES.items()
        }


def greedy_reference(
    root: str | Path, prompt: Sequence[int], n: int, ref: str = "m@1"
) -> tuple[list[int], list[np.ndarray]]:
    """``n`` greedy tokens after ``prompt`` and each step's logits, from one process's
    engine (no streaming) on the source store of :func:`bundled_node_stores`: what a
    sharded run must reproduce bit for bit."""
    from czyx.inference.distributed.stages import greedy
    from czyx.inference.engine import Engine
    from czyx.inference.opened import OpenedModel
    from czyx.inference.options import EngineOptions

    with OpenedModel(str(Path(root) / "src"), ref, None) as om:
        e = Engine(om.consumer, options=EngineOptions(stream=False))
        try:
            return greedy(
                lambda r, t: e.prefill(t) if len(t) > 1 else e.decode(int(t[0])), prompt, n
            )
        finally:
            e.close()
