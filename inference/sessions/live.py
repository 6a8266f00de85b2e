"""A running session on an :class:`~inference.engine.Engine`: capture, restore, continue.

Scope: the token history, the last logits and the sampler that go with the
engine's KV cache; turning them into a :class:`SessionState` (no copy: views
of the cache) and back (one copy from the read buffer into the cache);
resuming from the longest saved prefix of a prompt; and
:func:`run_with_session`, the hook behind ``czyx run --session NAME``.

The generation loop here always feeds a sampled token back through the
engine at once, so between calls the KV cache holds *every* token of the
history and ``logits`` are those of the next position. A saved state is
therefore complete: resuming samples straight from the saved logits and
never reprocesses a token. Because the KV bytes, the cache capacity, the
logits and the RNG state all round-trip exactly, a resumed run is
bit-identical to one that never stopped. A hybrid model's state (Qwen3-Next:
linear-attention layers) also carries each linear layer's recurrent state,
restored as saved: it exists only at the saved length, so such a state
resumes whole (a shorter prefix of it is recomputed, never guessed).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from czyx.inference.engine import Engine
from czyx.inference.models.base import KVCache
from czyx.inference.sampling import Sampler, SamplingParams
from czyx.inference.sessions.errors import (
    ModelVersionMismatchError,
    RecurrentCutError,
    SessionError,
)
from czyx.inference.sessions.format import ParsedExtent, SessionState
from czyx.inference.sessions.store import RECORD_KEY, SessionInfo, SessionStore
from czyx.inference.tokenizer import StreamDecoder, Tokenizer


def restore_cache(model: Any, parsed: ParsedExtent, rows: int, capacity: int) -> KVCache:
    """A new cache of ``model`` (capacity ``capacity``) holding ``parsed``'s first ``rows``.

    The KV is checked against the cache's own shapes (a hybrid model's KV covers
    its attention layers only) and copied; a hybrid model's recurrent state is
    checked and copied too, which needs ``rows`` to be the saved length.

    Raises
    ------
    ModelVersionMismatchError
        The KV shapes or the recurrent state's differ from the model's.
    RecurrentCutError
        ``rows`` is short of a hybrid state's saved length.
    """
    lay = parsed.layout
    kv = model.new_kv(max(capacity, 1))
    mine = (len(kv.k), kv.n_kv_heads, kv.head_dim)
    if (lay.n_layers, lay.n_kv_heads, lay.head_dim) != mine:
        raise ModelVersionMismatchError(
            f"{parsed.where}: KV shape (layers, kv heads, head dim) "
            f"{(lay.n_layers, lay.n_kv_heads, lay.head_dim)} != the engine's {mine}"
        )
    recurrent = getattr(kv, "recurrent_arrays", None)
    want = () if recurrent is None else tuple(a.shape for a in recurrent())
    if tuple(a.shape for a in parsed.recurrent) != want:
        raise ModelVersionMismatchError(
            f"{parsed.where}: recurrent state {[a.shape for a in parsed.recurrent]} != the "
            f"engine's {list(want)}"
        )
    if want and rows != lay.length:
        raise RecurrentCutError(
            f"{parsed.where}: a hybrid model's state resumes at its {lay.length} positions "
            f"only, not {rows}"
        )
    parsed.copy_kv_into(kv.k, kv.v, rows)
    if want:
        kv.load_recurrent(parsed.recurrent)
    kv.length = rows
    return kv


def recurrent_of(kv: KVCache) -> tuple[np.ndarray, ...]:
    """The recurrent arrays a saved state of ``kv`` carries (views; ``()`` for a KV cache)."""
    arrays = getattr(kv, "recurrent_arrays", None)
    return () if arrays is None else arrays()


class LiveSession:
    """An engine plus the history, last logits and sampler of one conversation.

    Use :meth:`start`, :meth:`resume` or :meth:`from_prompt`; the engine's KV
    cache belongs to this object while it is in use.
    """

    def __init__(self, engine: Engine, sampler: Sampler, tenant: str) -> None:
        self.engine = engine
        self.sampler = sampler
        self.tenant = tenant
        self.tokens: list[int] = []
        self.logits: np.ndarray | None = None
        self.reused = 0  # positions restored from a saved state instead of computed
        self.prefilled = 0  # positions computed by this object

    # -- construction ------------------------------------------------------------------
    @classmethod
    def start(cls, engine: Engine, sampling: SamplingParams, tenant: str) -> LiveSession:
        """A fresh session (the engine's sequence is reset)."""
        engine.reset()
        return cls(engine, Sampler(sampling), tenant)

    @classmethod
    def resume(
        cls,
        engine: Engine,
        parsed: ParsedExtent,
        tenant: str,
        sampling: SamplingParams | None = None,
        rows: int | None = None,
    ) -> LiveSession:
        """Continue a saved state: its KV copied into a new cache of the saved capacity.

        Parameters
        ----------
        engine
            An engine on the model version the state was saved with.
        parsed
            The state as read (:meth:`SessionStore.read`).
        tenant
            The tenant resuming it (must own it).
        sampling
            ``None``: the saved sampler parameters *and* RNG state (exact
            continuation). Given: these parameters, with a fresh RNG (their seed).
        rows
            Restore only the first ``rows`` positions (a prefix); their logits
            are unknown, so the caller feeds at least one more token.

        Raises
        ------
        ModelVersionMismatchError
            The engine's model selector, KV shapes or recurrent state differ from the state's.
        RecurrentCutError
            ``rows`` is short of a hybrid model's saved length.
        """
        info = engine.consumer.info
        lay = parsed.layout
        if bytes(info.selector) != parsed.model:
            raise ModelVersionMismatchError(
                f"{parsed.where} was saved against model version {parsed.model.hex()[:16]}..., "
                f"the engine runs {bytes(info.selector).hex()[:16]}..."
            )
        rows = parsed.rows if rows is None else rows
        full = rows == lay.length and parsed.logits is not None
        cap = parsed.capacity if full else rows
        if parsed.tenant != tenant:
            raise SessionError(f"{parsed.where}: tenant mismatch")
        engine.kv = restore_cache(engine.model, parsed, rows, cap)
        if sampling is None:
            sampler = Sampler(SamplingParams(**parsed.sampling))
            if parsed.rng_state is not None:
                sampler.rng.bit_generator.state = parsed.rng_state
        else:
            sampler = Sampler(sampling)
        live = cls(engine, sampler, tenant)
        live.tokens = [int(t) for t in parsed.tokens[:rows]]
        live.logits = parsed.logits.copy() if full else None
        live.reused = rows
        return live

    @classmethod
    def from_prompt(
        cls,
        engine: Engine,
        sessions: SessionStore,
        prompt: Sequence[int],
        sampling: SamplingParams,
    ) -> LiveSession:
        """A session over ``prompt`` reusing the longest saved prefix of it (if any).

        The reused prefix is the longest common prefix of ``prompt`` and the
        state found by block hash (so at least that many blocks, possibly a
        few tokens more); the rest of the prompt is prefilled. The prompt's
        last token is always left to prefill unless the state ends exactly
        there with its logits saved.
        """
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("the prompt is empty: nothing to condition on")
        model = bytes(engine.consumer.info.selector)
        hit = sessions.find_prefix(prompt, model)
        if hit is None:
            live = cls.start(engine, sampling, sessions.tenant)
            live.feed(prompt)
            return live
        rec = sessions.store.get(hit.space, RECORD_KEY)
        if rec is None:  # an edge without its state (never published): nothing to reuse
            live = cls.start(engine, sampling, sessions.tenant)
            live.feed(prompt)
            return live
        parsed = sessions.read_space(hit.space, model=model, rows=min(rec["length"], len(prompt)))
        n = parsed.rows
        neq = np.flatnonzero(parsed.tokens[:n] != np.asarray(prompt[:n], np.int32))
        common = int(neq[0]) if neq.size else n
        exact = common == len(prompt) == parsed.layout.length and parsed.logits is not None
        rows = common if exact else min(common, len(prompt) - 1)
        if parsed.recurrent and rows != parsed.layout.length:
            rows = 0  # a hybrid state is only valid whole: recompute the prompt instead
        if rows <= 0:
            live = cls.start(engine, sampling, sessions.tenant)
        else:
            live = cls.resume(engine, parsed, sessions.tenant, sampling, rows=rows)
        if rows < len(prompt):
            live.feed(prompt[rows:])
        return live

    # -- stepping ----------------------------------------------------------------------
    def feed(self, tokens: Sequence[int]) -> np.ndarray:
        """Process ``tokens`` after the history in one batch; returns the next logits."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("feed: no tokens")
        self.logits = self.engine.prefill(tokens)
        self.tokens.extend(tokens)
        self.prefilled += len(tokens)
        return self.logits

    def step(self) -> int:
        """Sample the next token from the current logits and feed it back."""
        if self.logits is None:
            raise SessionError("no logits to sample from: feed a prompt first")
        tok = self.sampler(self.logits)
        self.logits = self.engine.decode(tok)
        self.tokens.append(tok)
        return tok

    def generate(
        self,
        max_tokens: int,
        eos_ids: Sequence[int] = (),
        on_token: Callable[[int], None] | None = None,
    ) -> list[int]:
        """Sample up to ``max_tokens`` tokens (stopping after an end-of-sequence id)."""
        if max_tokens < 0:
            raise ValueError(f"max_tokens {max_tokens} is negative")
        eos, out = set(eos_ids), []
        while len(out) < max_tokens:
            tok = self.step()
            out.append(tok)
            if on_token is not None:
                on_token(tok)
            if tok in eos:
                break
        return out

    def state(self) -> SessionState:
        """The current state, with views of the engine's KV cache (nothing copied)."""
        kv = self.engine.kv
        n = kv.length
        if n != len(self.tokens):
            raise SessionError(f"KV cache holds {n} positions but the history {len(self.tokens)}")
        return SessionState(
            model=bytes(self.engine.consumer.info.selector),
            tenant=self.tenant,
            tokens=np.asarray(self.tokens, np.int32),
            k=tuple(a[:, :n] for a in kv.k),
            v=tuple(a[:, :n] for a in kv.v),
            logits=self.logits,
            sampling=asdict(self.sampler.params),
            rng_state=self.sampler.rng.bit_generator.state,
            capacity=kv.capacity,
            recurrent=recurrent_of(kv),
        )


@dataclass(frozen=True)
class SessionRun:
    """What :func:`run_with_session` did."""

    tokens: list[int]  # generated ids
    text: str
    info: SessionInfo  # the saved state after the run
    resumed: bool  # continued an existing session by name
    reused: int  # positions restored from a saved state
    prefilled: int  # positions computed (prompt tokens prefilled)
    restore_seconds: float  # reading and restoring the saved state
    prefill_seconds: float
    decode_seconds: float


def run_with_session(
    engine: Engine,
    tokenizer: Tokenizer,
    sessions: SessionStore,
    name: str,
    prompt: str,
    max_tokens: int = 64,
    sampling: SamplingParams | None = None,
    on_text: Callable[[str], None] | None = None,
    reuse_prefix: bool = True,
) -> SessionRun:
    """``czyx run --session NAME``: continue (or start) a saved session, then save it.

    If ``name`` exists its head is loaded (KV restored, never recomputed) and
    ``prompt`` (may be empty) is appended; otherwise the prompt starts a new
    session, reusing the longest saved prefix of it when ``reuse_prefix``.
    After generating, the state is saved as the session's next version
    (optimistically locked against concurrent saves).

    Parameters
    ----------
    sampling
        ``None`` continues with the saved sampler (exact continuation; greedy
        for a new session); given, it replaces the saved parameters.

    Raises
    ------
    WrongTenantError, ModelVersionMismatchError, SessionConflictError
        See :class:`SessionStore`.
    """
    model = bytes(engine.consumer.info.selector)
    ids = tokenizer.encode(prompt) if prompt else []
    t0 = time.perf_counter()
    existing = sessions.versions(name)
    head = existing[-1][0] if existing else 0
    if existing:
        parsed = sessions.read(name, head, model=model)
        live = LiveSession.resume(engine, parsed, sessions.tenant, sampling)
        t1 = time.perf_counter()
        if ids:
            live.feed(ids)
    elif not ids:
        raise ValueError(f"session {name!r} does not exist and the prompt is empty")
    else:
        params = sampling or SamplingParams()
        if reuse_prefix:  # the prefix read counts as prefill time here
            live = LiveSession.from_prompt(engine, sessions, ids, params)
        else:
            live = LiveSession.start(engine, params, sessions.tenant)
            live.feed(ids)
        t1 = t0
    t2 = time.perf_counter()
    stream = StreamDecoder(tokenizer)

    def emit(tok: int) -> None:
        piece = stream.push(tok)
        if piece and on_text is not None:
            on_text(piece)

    eos = tuple(getattr(tokenizer, "eos_ids", ())) + tuple(engine.cfg.eos_token_ids)
    out = live.generate(max_tokens, eos, emit)
    rest = stream.flush()
    if rest and on_text is not None:
        on_text(rest)
    t3 = time.perf_counter()
    info = sessions.save(name, live.state(), expect_version=head)
    return SessionRun(
        tokens=out,
        text=tokenizer.decode(out),
        info=info,
        resumed=bool(existing),
        reused=live.reused,
        prefilled=live.prefilled,
        restore_seconds=t1 - t0,
        prefill_seconds=t2 - t1,
        decode_seconds=t3 - t2,
    )
