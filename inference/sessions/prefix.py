"""Token-prefix hashes at block granularity, and the prefix index kept as edges.

Scope: hashing a token history every :data:`~inference.sessions.format.BLOCK`
positions, the edge keys that make a saved state findable by those hashes,
and the longest-prefix search. Reading the KV itself is
:mod:`inference.sessions.store`'s job.

The hashes are *chained*: ``h_0 = H(model selector, tenant)`` and
``h_k = H(h_{k-1} || tokens[(k-1)B : kB])`` (BLAKE2b-128, int32 little-endian
tokens), so all of a history's block hashes cost one pass, and ``h_k`` names
the whole prefix ``tokens[:kB]``, not just its last block. Binding the model
selector means KV is only ever reused on the model version that computed it;
binding the tenant means one tenant can neither reuse nor probe for another's
histories.

The index lives in the store's 0xFF edge space, one association edge per
``(prefix hash, state space)``: key ``EDG || b"ses.prefix\\0" || h_k || space``.
A state indexes only the block boundaries ``k = 1, 2, 4, 8, ...`` and its last
full block (:func:`indexed_blocks`), not every block: each edge costs one
durable LMDB transaction (the dominant cost of saving a state:
``bench/bench_sessions.py``, ``bench/SESSIONS.md``), so a 4k-token state writes
at most 8 edges instead of 64. Nothing is lost by the sparseness: the search
finds the state holding the longest *indexed* prefix of a prompt, and the
caller then reads that state's history and reuses the full common prefix,
which the prefix search only has to locate. A boundary some state already
holds is not indexed twice (that state keeps serving it).

The search computes every block hash of the prompt (one pass) and probes the
edges from the longest prefix down, stopping at the first hit: at most
``L / B`` cheap read look-ups, no write.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from czyx.inference.sessions.format import BLOCK
from czyx.key import EDG
from czyx.space import Selector
from czyx.store.interfaces import StoreInterface

HASH_SIZE = 16
PREFIX_EDGE = bytes((EDG,)) + b"ses.prefix\x00"
_PERSON = b"czyx-ses-prefix"


def prefix_hashes(
    tokens: Sequence[int] | np.ndarray, model: bytes, tenant: str, block: int = BLOCK
) -> list[bytes]:
    """Hashes ``h_1 .. h_n`` of the prefixes ``tokens[:k*block]``, ``n = len // block``.

    Parameters
    ----------
    tokens
        The token history (ids).
    model
        The model version's 32-byte selector.
    tenant
        The owning tenant.
    block
        Positions per block.

    Returns
    -------
    list of bytes
        ``n`` digests of :data:`HASH_SIZE` bytes; entry ``k-1`` names ``tokens[:k*block]``.
    """
    if block <= 0:
        raise ValueError(f"block {block} must be positive")
    arr = np.ascontiguousarray(np.asarray(tokens, dtype="<i4").reshape(-1))
    h = hashlib.blake2b(
        bytes(model) + b"\x00" + tenant.encode(), digest_size=HASH_SIZE, person=_PERSON
    ).digest()
    raw = arr.tobytes()
    out = []
    step = 4 * block
    for k in range(arr.size // block):
        h = hashlib.blake2b(
            h + raw[k * step : (k + 1) * step], digest_size=HASH_SIZE, person=_PERSON
        ).digest()
        out.append(h)
    return out


def edge_key(h: bytes, space: Selector) -> bytes:
    """The prefix edge recording that ``space`` holds the prefix named by ``h``."""
    return PREFIX_EDGE + h + space.raw


def indexed_blocks(n_blocks: int) -> list[int]:
    """The block boundaries a state of ``n_blocks`` full blocks indexes: powers of two
    and the last one, ascending."""
    out, k = [], 1
    while k < n_blocks:
        out.append(k)
        k *= 2
    if n_blocks:
        out.append(n_blocks)
    return out


@dataclass(frozen=True)
class PrefixHit:
    """A saved state holding the first ``blocks * BLOCK`` tokens of a prompt."""

    space: Selector
    blocks: int
    positions: int


class PrefixIndex:
    """Prefix edges in one store (see the module docstring).

    Parameters
    ----------
    store
        The store whose edge space holds the index.
    """

    def __init__(self, store: StoreInterface) -> None:
        self.store = store

    def _holder(self, h: bytes) -> Selector | None:
        for k, _ in self.store.edges(PREFIX_EDGE + h):
            return Selector(k[len(PREFIX_EDGE) + HASH_SIZE :])
        return None

    def add(
        self,
        space: Selector,
        tokens: Sequence[int] | np.ndarray,
        model: bytes,
        tenant: str,
        name: str = "",
    ) -> int:
        """Index ``space`` under the boundaries of :func:`indexed_blocks` not yet held.

        Returns the number of edges written. They are written shortest prefix
        first, so an interrupted save leaves a usable (shorter) index.
        """
        hashes = prefix_hashes(tokens, model, tenant)
        written = 0
        for k in indexed_blocks(len(hashes)):
            h = hashes[k - 1]
            if self._holder(h) is not None:
                continue
            self.store.put_edge(
                edge_key(h, space),
                {"kind": "ses.prefix", "positions": k * BLOCK, "space": space.hex(), "name": name},
            )
            written += 1
        return written

    def longest(
        self, tokens: Sequence[int] | np.ndarray, model: bytes, tenant: str
    ) -> PrefixHit | None:
        """The saved state holding the longest indexed block prefix of ``tokens``, or ``None``.

        The state may share more of ``tokens`` than ``hit.positions``; the
        caller compares histories to find out.
        """
        hashes = prefix_hashes(tokens, model, tenant)
        for k in range(len(hashes), 0, -1):
            holder = self._holder(hashes[k - 1])
            if holder is not None:
                return PrefixHit(holder, k, k * BLOCK)
        return None
