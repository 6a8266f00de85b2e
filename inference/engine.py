"""The inference engine: a decoder, its expert slot cache and a KV cache, stepped.

Scope: choosing the slot budget (bytes, or a fraction of the routed-expert
bytes), building the architecture's decoder over a :class:`ModelConsumer`,
prefill and decode with a KV cache, returning float32 logits. Sampling and
text live in :mod:`inference.sampling` and :mod:`inference.generate`.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from czyx.errors import CzyxError
from czyx.inference.batch import decodes_in_c, forward_batch
from czyx.inference.cache import CacheStats, EvictionPolicy, ExpertCache
from czyx.inference.errors import CacheBudgetError
from czyx.inference.kernels.fused import default_threads
from czyx.inference.memory import MEMORY_SHARE, available_bytes
from czyx.inference.models import DecoderConfig, decoder_class
from czyx.inference.models.decoder import describe_restriction
from czyx.inference.options import DEFAULT_OPTIONS, EngineOptions
from czyx.inference.profile import RoutingProfile
from czyx.inference.streaming import StreamingExpertCache, StreamOptions, attach
from czyx.inference.tiers import TierSpec, TierSpecError, check_tiered, high_mask
from czyx.inference.trunkwindow import TrunkWindowStats
from czyx.inference.xray import XRay
from czyx.store.consumer import ModelConsumer
from czyx.store.io.iopaths import default_io_path

#: Most prompt tokens one batched C step of :meth:`Engine.prefill` takes: the step's
#: scratch grows with its tokens (each token's top-k expert products), and one
#: step reads each of its experts once, so larger is faster and bigger.
PREFILL_CHUNK = 256


def prompt_in_c(model: Any, n: int, resident: bool) -> bool:
    """Whether :meth:`Engine.prefill` runs a prompt of ``n`` tokens through the batched C
    step (each token's arithmetic the C decode's); ``resident``: whether the cache holds
    every routed expert.

    True for a model that decodes in C (:func:`~inference.batch.decodes_in_c`), is not
    observed layer by layer and whose rope does not depend on the length reached, given
    a prompt of at most :data:`PREFILL_CHUNK` tokens or a resident cache. A node of a
    sharded model asks the same, to run a prompt as the engine does.
    """
    return (
        n > 0
        and model.observer is None
        and not model._length_rope
        and decodes_in_c(model)
        and (n <= PREFILL_CHUNK or resident)
    )


def expert_bytes(consumer: ModelConsumer, cfg: DecoderConfig) -> int:
    """Slot bytes of every routed expert: the budget that makes the model fully resident."""
    return cfg.n_sparse_experts * int(consumer.info.expert_slot_nbytes)


def resolve_budget(
    consumer: ModelConsumer,
    cfg: DecoderConfig,
    cache_bytes: int | None = None,
    cache_fraction: float | None = None,
    available: Callable[[], int | None] | None = None,
) -> int:
    """The slot budget in bytes from at most one of ``cache_bytes`` / ``cache_fraction``.

    Neither given: every routed expert (fully resident) where that fits
    :data:`MEMORY_SHARE` of ``available()`` (default
    :func:`inference.memory.available_bytes`: the memory the process may still
    take, host and cgroup; less the slot arenas of its other open caches,
    which fill as they are used); else that share, so a model bigger than
    memory streams instead of being killed when its slots fill. A fraction
    is of :func:`expert_bytes`. The result is never below one layer's top-k
    slots unless asked for explicitly in bytes (then the cache refuses it).
    """
    if cache_bytes is not None and cache_fraction is not None:
        raise ValueError("give a cache budget in bytes or as a fraction, not both")
    total = expert_bytes(consumer, cfg)
    floor = cfg.top_k * int(consumer.info.expert_slot_nbytes)
    if cache_bytes is not None:
        if cache_bytes < 0:
            raise ValueError(f"cache budget {cache_bytes} B is negative")
        return int(cache_bytes)
    if cache_fraction is not None:
        if not 0.0 < cache_fraction <= 1.0:
            raise ValueError(f"cache fraction {cache_fraction} is not in (0, 1]")
        want = int(total * cache_fraction)
        if want < floor:
            raise CacheBudgetError(
                f"cache fraction {cache_fraction} gives {want} B, below one layer's "
                f"top-{cfg.top_k} experts ({floor} B = {floor / max(total, 1):.4f} of the experts)"
            )
        return want
    need = max(total, floor)
    room = (available or available_bytes)()
    if room is None:
        return need
    room = int(MEMORY_SHARE * max(0, room - ExpertCache.reserved_bytes()))
    return max(floor, min(need, room))


class BlasLimit:
    """A reentrant context that holds every BLAS library to ``n`` threads (threadpoolctl).

    The libraries are found once; entering costs one ``set_num_threads`` call
    per library whose count differs (none when the process already runs BLAS
    at ``n``), leaving restores the previous counts.
    """

    def __init__(self, n: int) -> None:
        from threadpoolctl import ThreadpoolController

        self.n = n
        self._libs = list(ThreadpoolController().select(user_api="blas").lib_controllers)
        self._saved: list[list[tuple[object, int]]] = []

    def __enter__(self) -> BlasLimit:
        saved = []
        for lib in self._libs:
            cur = lib.get_num_threads()
            if cur != self.n:
                lib.set_num_threads(self.n)
                saved.append((lib, cur))
        self._saved.append(saved)
        return self

    def __exit__(self, *exc: object) -> None:
        for lib, cur in reversed(self._saved.pop()):
            lib.set_num_threads(cur)


def _legacy_options(
    options: EngineOptions, policy: str | EvictionPolicy | None, stream: object
) -> tuple[EngineOptions, EvictionPolicy | None]:
    """Fold the deprecated ``policy=`` / ``stream=`` keywords into ``options``."""
    instance = None
    if policy is not None:
        warnings.warn(
            "Engine(policy=...) is deprecated: pass options=EngineOptions(policy=...)",
            DeprecationWarning,
            stacklevel=3,
        )
        if isinstance(policy, str):
            options = replace(options, policy=policy)
        else:
            instance = policy
    if stream is not True:
        warnings.warn(
            "Engine(stream=...) is deprecated: pass options=EngineOptions(...)",
            DeprecationWarning,
            stacklevel=3,
        )
        if stream is None or stream is False:
            options = replace(options, stream=False)
        else:
            options = replace(
                options,
                stream=True,
                io=stream.io,
                readers=stream.readers,
                prefetch=stream.prefetch,
                lookahead=stream.lookahead,
                width=stream.width,
                early=stream.early,
                strict_deadlines=stream.strict_deadlines,
            )
    return options, instance


def _first_block(consumer: ModelConsumer) -> str | None:
    """A path that reopens the consumer's first block file (the ``O_DIRECT`` probe), or
    None without block files."""
    fds = getattr(consumer, "expert_fds", None)
    if fds is None:
        return None
    try:
        files = fds()
    except (NotImplementedError, CzyxError):
        return None
    return f"/proc/self/fd/{files[0]}" if files else None


class Engine:
    """A model ready to run: trunk resident (or windowed), routed experts behind a slot cache.

    Parameters
    ----------
    consumer
        The opened model version (through a portal, by the store).
    cache_bytes, cache_fraction
        The expert slot budget (see :func:`resolve_budget`).
    options
        How it runs (:class:`~czyx.inference.options.EngineOptions`: eviction
        policy, streaming, readers, look-ahead); the same defaults as ``czyx run``.
    hot
        A hot list of ``(layer, expert)`` pairs, most important first, loaded
        before the first token.
    pin_classes
        A router-byte range ``(lo, hi)`` pinned resident in every sparse layer.
    xray
        An :class:`czyx.inference.xray.XRay` recording every transfer (when streaming).
    trunk_window
        Hold at most this many layers' big trunk matrices, reading the next
        layer while one computes (:class:`~inference.trunkwindow.TrunkWindow`);
        the consumer should then be opened with ``lazy_trunk=True``. None: the
        whole trunk resident.
    threads
        Threads of the engine's own kernels (the decode step's C kernels);
        default: the cores this process may run on (its CPU affinity). BLAS
        (numpy's products in prefill) is held to one thread inside the
        engine's calls, so the two never oversubscribe the cores and no BLAS
        thread split can change a result: outputs are bit-identical for every
        ``threads``.
    policy, stream
        Deprecated spellings (a policy name or :class:`EvictionPolicy` instance;
        a :class:`~czyx.inference.streaming.StreamOptions` or None): they
        override ``options`` with a DeprecationWarning.
    """

    def __init__(
        self,
        consumer: ModelConsumer,
        cache_bytes: int | None = None,
        cache_fraction: float | None = None,
        options: EngineOptions | None = None,
        hot: Sequence[tuple[int, int]] | None = None,
        pin_classes: tuple[int, int] | None = None,
        xray: XRay | None = None,
        trunk_window: int | None = None,
        threads: int | None = None,
        *,
        policy: str | EvictionPolicy | None = None,
        stream: StreamOptions | bool | None = True,
    ) -> None:
        self.threads = default_threads() if threads is None else int(threads)
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        self._blas = BlasLimit(1)
        if options is not None and not isinstance(options, EngineOptions):
            options, policy = None, options  # the old third positional: a policy
        options, policy_obj = _legacy_options(options or DEFAULT_OPTIONS, policy, stream)
        self.options = options
        policy = policy_obj if policy_obj is not None else options.policy
        stream = options.stream
        cls = decoder_class(consumer.info.arch)
        cfg = cls.parse_config(consumer.info)
        #: The tiers option parsed (None: one version); see :meth:`set_tiers`.
        self.tiers = None if options.tiers is None else TierSpec.parse(options.tiers)
        if self.tiers is not None:
            check_tiered(consumer, self.tiers)
        self.consumer = consumer
        # The memory this process may take, read at most once: the default budget and the
        # default I/O path (_io_path) are decided from the same reading.
        self._room = functools.cache(available_bytes)
        self.budget_bytes = resolve_budget(
            consumer, cfg, cache_bytes, cache_fraction, available=self._room
        )
        self.expert_bytes = expert_bytes(consumer, cfg)
        #: Why the default budget holds less than every expert (None: it holds them all,
        #: or the caller chose the budget).
        self.budget_note: str | None = None
        if cache_bytes is None and cache_fraction is None and self.budget_bytes < self.expert_bytes:
            self.budget_note = (
                f"expert slots: {self.budget_bytes / 2**30:.2f} of {self.expert_bytes / 2**30:.2f}"
                f" GiB, {MEMORY_SHARE:.0%} of the memory this process may take: the rest is read"
                " as routed (--cache-mb or --cache-fraction sets the budget)"
            )
        self.xray = xray
        if self.tiers is not None:
            self._sparse_rows = np.asarray(cfg.sparse_layers, bool)
            self.set_tiers(hot)
        if not stream:
            self.cache = ExpertCache(
                consumer, self.budget_bytes, cfg.top_k, cfg.n_sparse_experts, policy
            )
        else:
            self.cache = StreamingExpertCache(
                consumer,
                self.budget_bytes,
                cfg.top_k,
                cfg.n_sparse_experts,
                policy,
                io=options.io if options.io is not None else self._io_path(consumer),
                readers=options.readers,
                prefetch=options.prefetch,
                prefetch_evicts=options.prefetch_evicts,
                prefetch_slots=options.prefetch_slots,
                lookahead=options.lookahead,
                width=options.width,
                early=options.early,
                strict_deadlines=options.strict_deadlines,
                native=options.native,
                xray=xray,
            )
        self.cache.record_tier_steps = xray is not None
        try:
            self.model = cls(consumer, self.cache, trunk_window=trunk_window)
        except BaseException:
            self.cache.close()  # the cache's reader threads must not outlive a failed open
            raise
        self.model.set_threads(self.threads)
        if stream:
            attach(self.model, self.cache)
        self.cfg = self.model.cfg
        mask = self.model.route_mask
        # One line for the run's figures when a scoped portal restricted routing.
        self.route_restriction = describe_restriction(mask, self.cfg)
        if mask is not None:
            if stream:
                self.cache.set_route_mask(mask)
            if hot:
                hot = [(layer, e) for layer, e in hot if mask[layer, e]]
        if pin_classes is not None:
            sparse = [i for i, s in enumerate(self.cfg.sparse_layers) if s]
            self.cache.pin_classes(pin_classes[0], pin_classes[1], sparse)
        if hot:
            self.cache.prewarm(hot)
        self.kv = self.model.new_kv()

    def set_tiers(self, hot: Sequence[tuple[int, int]] | None) -> None:
        """Choose the high-precision experts from the hot list ``hot`` (most used first:
        a profile's, or :meth:`routing_profile`'s of this run) by the tiers option's policy
        (:func:`~czyx.inference.tiers.high_mask`); later reads follow it, experts already
        in a slot keep their precision until evicted.

        Raises
        ------
        TierSpecError
            The engine runs without tiers, or ``hot`` is empty.
        """
        if self.tiers is None:
            raise TierSpecError("set_tiers: this engine runs without tiers")
        tiered = self.consumer
        mask = high_mask(
            hot, tiered.tier.shape, self.budget_bytes, tiered.strides[0], self.tiers.fraction
        )
        mask &= self._sparse_rows[:, None]
        settle = getattr(getattr(self, "cache", None), "_settle", None)
        if settle is not None:
            # A read in flight resolves its version (a consumer without block files) when
            # it runs: none may see the map change under it.
            settle()
        tiered.set_high(mask)

    def _io_path(self, consumer: ModelConsumer) -> str:
        """The expert I/O path when the options name none.

        ``O_DIRECT`` (where the files allow it and ``czyx bench io`` recorded no
        winner) when the slots hold part of the experts and the memory this
        process may take could not also hold the rest in the page cache: a model
        bigger than memory, whose slots are the only cache its reads will have.
        Else the store's default (buffered reads: a warm page cache serves them
        at memory speed).
        """
        partial = self.budget_bytes < self.expert_bytes
        room = self._room() if partial else None
        prefer = room is not None and self.budget_bytes + self.expert_bytes > room
        return default_io_path(prefer, _first_block(consumer) if prefer else None)

    @property
    def position(self) -> int:
        """Tokens processed so far (the KV cache length)."""
        return self.kv.length

    def reset(self) -> None:
        """Forget the sequence (the expert cache stays warm)."""
        self.kv.truncate(0)

    def prefill(self, tokens: Sequence[int] | np.ndarray, all_logits: bool = False) -> np.ndarray:
        """Process prompt ``tokens``; logits of the last (or every) token.

        Where the model decodes in C (:func:`~inference.batch.decodes_in_c`), the
        last token's logits come from the batched C step a server's prompt chunks
        take (:func:`~inference.batch.forward_batch`, chunks of at most
        :data:`PREFILL_CHUNK` tokens): each token's arithmetic is then the
        engine's decode, so the KV and logits are those of decoding the prompt
        token by token. A longer prompt on a cache that cannot hold every expert
        takes the model's prompt forward instead, which reads each expert at most
        once for the whole prompt; so do ``all_logits`` and a model observed
        layer by layer (calibration).
        """
        ids = np.asarray(tokens, np.int64).reshape(-1)
        resident = self.cache.max_acquire >= self.cfg.n_sparse_experts
        if not all_logits and prompt_in_c(self.model, ids.size, resident):
            with self._blas:
                for c0 in range(0, ids.size, PREFILL_CHUNK):  # (it advances the cache)
                    logits = forward_batch(self.model, [ids[c0 : c0 + PREFILL_CHUNK]], [self.kv])
            return logits[0]
        self.cache.advance(len(ids))
        with self._blas:
            return self.model.forward(ids, self.kv, all_logits)

    def decode(self, token: int) -> np.ndarray:
        """Process one token; returns its ``[V]`` logits."""
        self.cache.advance(1)
        if self.model.decode_in_c():  # no BLAS call to limit (and limiting costs a few us)
            return self.model.forward(np.array([token], np.int64), self.kv)
        with self._blas:
            return self.model.forward(np.array([token], np.int64), self.kv)

    @property
    def verifies_in_one_step(self) -> bool:
        """Whether :meth:`verify` runs its tokens in one batched step. False for a rope
        whose tables depend on the length reached (dynamic NTK, LongRoPE): a step over
        several positions would set them for its furthest one, so speculative decoding
        then checks each drafted token with :meth:`decode`, one after another."""
        return not self.model._length_rope

    def verify(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """Process ``tokens`` in one batched step; every token's ``[T, V]`` logits.

        Speculative decoding's verification: the pending token and the drafts after
        it go through :func:`~inference.batch.forward_batch` together, so each
        routed expert is acquired once for every token that chose it. Where the
        model decodes in C each token's logits (and KV) are bit for bit those of
        :meth:`decode` (the batched C step computes each row with the one-token
        kernels); elsewhere they agree to float32 rounding (the batched numpy
        step's row-independent products). One token is :meth:`decode` itself.
        The caller drops rejected positions with :meth:`rollback`.
        """
        ids = np.asarray(tokens, np.int64).reshape(-1)
        if ids.size == 1:
            return self.decode(int(ids[0]))[None]
        if not self.verifies_in_one_step:
            raise ValueError("verify: this model's rope decodes one position at a time")
        mask = self.model.route_mask
        allowed = None if mask is None else [mask]
        # Every position this step reaches becomes one rollback may return to (a
        # hybrid model's recurrent state is snapshotted; a KV cache needs nothing).
        self.kv.track()
        try:
            with self._blas:
                return forward_batch(self.model, [ids], [self.kv], allowed, all_logits=True)[0]
        finally:
            self.kv.track(False)

    def rollback(self, length: int) -> None:
        """Forget the positions from ``length`` on (rejected drafts): the KV cache is cut
        back (a hybrid model's recurrent state returns to the snapshot :meth:`verify`
        took there), the expert cache stays as it is."""
        self.kv.truncate(length)

    def routing_profile(self) -> RoutingProfile:
        """The routing counts of everything this engine has run."""
        return RoutingProfile(self.model.route_counts.copy())

    def stats(self) -> CacheStats:
        """The expert cache's counters."""
        return self.cache.stats()

    def trunk_window_stats(self) -> TrunkWindowStats | None:
        """The trunk window's counters, or None when the whole trunk is resident."""
        return self.model.window_stats()

    def close(self) -> None:
        """Stop the trunk window, release the cache arena (the consumer is the caller's)."""
        self.model.close()
        self.cache.close()
