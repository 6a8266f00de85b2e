"""Shared helpers of the session tests: synthetic states and engines on tiny models."""

from __future__ import annotations

import dataclasses

import numpy as np

from inference.sessions.format import SessionState

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
    from inference.engine import Engine
    from tests.inference.refmodels import StateDictConsumer

    def make():
        c = StateDictConsumer(model)
        c.info = dataclasses.replace(c.info, selector=selector)
        return Engine(c)

    return make
