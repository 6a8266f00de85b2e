"""Shared helpers of the session tests: synthetic states and engines on tiny models."""

from __future__ import annotations

import dataclasses

import numpy as np

from czyx.inference.sessions.format import SessionState
from czyx.store.consumer import gate_up_down_views

MODEL_A = b"\x07" * 32
MODEL_B = b"\x08" * 32


def random_state(
    rng: np.random.Generator,
    *,
    n_layers: int = 2,
    n_kv: int = 2,
    hd: int = 4,
    length: int = 70,
    vocab: int = 16,
    tenant: str = "alice",
    model: bytes = MODEL_A,
    tokens: np.ndarray | None = None,
    capacity: int | None = None,
) -> SessionState:
    """A state with random KV (stored in arrays wider than the history, as an engine's)."""
    cap = capacity if capacity is not None else length + 5
    ks = tuple(rng.standard_normal((n_kv, cap, hd)).astype(np.float32) for _ in range(n_layers))
    vs = tuple(rng.standard_normal((n_kv, cap, hd)).astype(np.float32) for _ in range(n_layers))
    toks = tokens if tokens is not None else rng.integers(0, 1000, length).astype(np.int32)
    return SessionState(
        model=model,
        tenant=tenant,
        tokens=np.asarray(toks, np.int32),
        k=tuple(a[:, :length] for a in ks),
        v=tuple(a[:, :length] for a in vs),
        logits=rng.standard_normal(vocab).astype(np.float32) if vocab else None,
        sampling={"temperature": 0.7, "top_k": 5, "top_p": 0.9, "seed": 3},
        rng_state=np.random.Generator(np.random.PCG64(9)).bit_generator.state,
        capacity=cap,
    )


def sessions_for(store, tenant: str = "alice", **kw):
    """A :class:`SessionStore` through a fresh portal granted to ``tenant``."""
    from czyx.inference.sessions.store import SessionStore
    from czyx.portals.authority import open_authority

    return SessionStore(store, open_authority(store).grant([], tenant=tenant).token, **kw)


def steps(live, n: int) -> tuple[list[int], list[np.ndarray]]:
    """``n`` steps of the :class:`LiveSession` ``live``: its tokens and a copy of each
    step's logits."""
    toks, logits = [], []
    for _ in range(n):
        toks.append(live.step())
        logits.append(live.logits.copy())
    return toks, logits


def states_equal(a: SessionState, b: SessionState) -> bool:
    """Exact equality of every field (arrays bit for bit)."""
    same_logits = (a.logits is None and b.logits is None) or (
        a.logits is not None and b.logits is not None and np.array_equal(a.logits, b.logits)
    )
    return (
        a.model == b.model
        and a.tenant == b.tenant
        and np.array_equal(a.tokens, b.tokens)
        and all(np.array_equal(x, y) for x, y in zip(a.k, b.k))
        and all(np.array_equal(x, y) for x, y in zip(a.v, b.v))
        and len(a.k) == len(b.k)
        and same_logits
        and a.sampling == b.sampling
        and a.rng_state == b.rng_state
        and a.capacity == b.capacity
    )


def engine_factory(model, selector: bytes = MODEL_A):
    """A function returning fresh engines on the torch ``model`` under ``selector``."""
    from czyx.inference.engine import Engine
    from czyx.testing.refmodels import StateDictConsumer

    def make():
        c = StateDictConsumer(model)
        c.info = dataclasses.replace(c.info, selector=selector)
        return Engine(c)

    return make


class NumpyConsumer:
    """A ``ModelConsumer`` over plain arrays, so a child process needs no torch.

    Built from any consumer by :func:`freeze_consumer` (every trunk tensor and
    every expert extent copied out), then pickled to the child.
    """

    def __init__(self, info, trunks, extents, inter: int, hidden: int) -> None:
        self.info = info
        self._trunks = trunks
        self._extents = extents
        self._inter, self._hidden = inter, hidden

    def has_trunk(self, role: str, layer: int | None = None) -> bool:
        return (role, layer) in self._trunks

    def trunk(self, role: str, layer: int | None = None) -> np.ndarray:
        return self._trunks[(role, layer)]

    def expert_extent(self, layer: int, router_byte: int):
        from czyx.store.consumer import ExpertExtent

        return ExpertExtent(block=-1, offset=0, length=self.info.expert_nbytes, checksum=0)

    def read_expert(self, layer: int, router_byte: int, slot: np.ndarray) -> None:
        src = self._extents[(layer, router_byte)]
        slot[: src.size] = src

    def expert_views(self, slot: np.ndarray):
        i, h = self._inter, self._hidden
        return gate_up_down_views(slot, self.info.expert_nbytes, i, h, np.float32)

    def close(self) -> None:
        pass


def freeze_consumer(c, selector: bytes = MODEL_A) -> NumpyConsumer:
    """A :class:`NumpyConsumer` holding the same bytes as the consumer ``c``."""
    from czyx.store.consumer import GLOBAL_ROLES, LAYER_ROLES

    trunks = {(r, None): c.trunk(r) for r in GLOBAL_ROLES if c.has_trunk(r)}
    for layer in range(c.info.n_layers):
        for r in LAYER_ROLES:
            if c.has_trunk(r, layer):
                trunks[(r, layer)] = c.trunk(r, layer)
    return NumpyConsumer(
        dataclasses.replace(c.info, selector=selector),
        trunks,
        dict(c._extents),
        c._inter,
        c._hidden,
    )
