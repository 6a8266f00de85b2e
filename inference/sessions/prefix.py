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
It is prefix-closed (a state indexes blocks 1..n in order, and a block hash is
only skipped when some state already holds it, which therefore also holds the
blocks before it), so the longest indexed prefix of a prompt is found by
binary search with ``O(log(L / B))`` edge look-ups.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from czyx.key import EDG
from czyx.space import Selector
from inference.sessions.format import BLOCK
from store.interfaces import StoreInterface

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
        """Index ``space`` under every block prefix of ``tokens`` not yet held by any state.

        Returns the number of edges written (blocks some earlier state already
        held are skipped: that state keeps serving them).
        """
        written = 0
        for k, h in enumerate(prefix_hashes(tokens, model, tenant), start=1):
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
        """The saved state holding the longest block prefix of ``tokens``, or ``None``."""
        hashes = prefix_hashes(tokens, model, tenant)
        lo, hi, best = 1, len(hashes), None
        while lo <= hi:  # the index is prefix-closed: "block k is held" is monotone in k
            mid = (lo + hi) // 2
            holder = self._holder(hashes[mid - 1])
            if holder is not None:
                best, lo = PrefixHit(holder, mid, mid * BLOCK), mid + 1
            else:
                hi = mid - 1
        return best
