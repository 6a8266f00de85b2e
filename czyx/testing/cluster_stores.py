"""Per-node stores for distributed tests and benches, made by replication.

Each node of a sharded run opens its own store; here every node store is
filled from one source store through :mod:`czyx.store.models.replicate` (the
same plan, staging and publication as ``czyx pull``, reading the source's
block files directly instead of over HTTP), optionally as a class subset, and
given its own ``infer`` portal.
"""

from __future__ import annotations

from pathlib import Path

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
