"""How an engine runs: one frozen options value, the same defaults from every entry point.

Scope: :class:`EngineOptions`, taken unchanged by :class:`~czyx.inference.engine.Engine`,
``czyx run`` (whose flags default to these fields), ``czyx demo`` and the benches. Why
one value: when the engine and the CLI each had their own defaults, a script got LRU
without prefetch while ``czyx run`` got decaying frequency with look-ahead, so the same
model behaved differently depending on the entry point. Each field names one concept
once (``readers``, ``lookahead``, ``width``), and the CLI flag spells the same name.

The defaults are the configuration the engine benchmarks measured best at a partial
budget (``bench/ENGINE.md``, ``bench/STREAMING.md``): decaying-frequency eviction, reads
through the transfer planner with look-ahead and early routing.

A batched engine (one that steps many sequences together: ``czyx serve``,
:func:`czyx.server.create_app`) has its own measured defaults,
:data:`BATCHED_OPTIONS`, defined here and only here.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any

#: Old keyword spellings, accepted with a DeprecationWarning: old name -> field.
DEPRECATED_NAMES = {"threads": "readers", "lookahead_depth": "lookahead", "prefetch_width": "width"}


@dataclass(frozen=True)
class EngineOptions:
    """Eviction and expert-streaming choices of one engine.

    Attributes
    ----------
    policy
        Eviction policy name (:data:`czyx.inference.cache.POLICIES`).
    stream
        Read experts through the transfer planner (asynchronous, verified,
        with the options below); False: the synchronous
        :class:`~czyx.inference.cache.ExpertCache` (one ``read_expert`` per miss).
    io
        I/O path (:data:`czyx.store.io.iopaths.PATHS`); None: the one
        ``czyx bench io`` measured fastest on this machine, else ``O_DIRECT`` where
        the budget holds part of the experts and the memory left could not also
        hold their files in the page cache (a model bigger than memory) and the
        filesystem allows it, else buffered ``pread`` (``Engine``).
    readers
        Expert reader threads (>= 1).
    native
        Reader kind: None, the store's native C pool whenever it is built;
        False, Python threads.
    prefetch
        Issue predicted reads ahead of use (False: every read is a demand read).
        Under a budget that holds every routed expert, a layer is predicted only
        while it still has to read (:mod:`czyx.inference.streaming`).
    prefetch_evicts
        A predicted read may evict a resident expert (False: predictions fill free
        slots only, so they warm a cache up and stop once it is full). Measured on
        two-core machines at budgets below the model, evicting prefetch read about
        twice the bytes (about half its predictions were used) and decoded slower
        than demand reads, which the per-expert pipeline already overlaps with the
        resident experts' arithmetic (``bench/PREFETCH.md``).
    prefetch_slots
        Slots of the budget set aside for predictions once the cache is full (0, the
        default: none): a prediction then never evicts a resident expert, and one that
        is used joins the cache in place of the policy's victim
        (:class:`~czyx.inference.streaming.StreamingExpertCache`).
    lookahead
        Sparse layers predicted ahead (0: early routing alone).
    width
        Predicted experts read per token and layer (None: the model's top-k).
    early
        Also predict each sparse layer from the residual stream entering it.
    strict_deadlines
        A transfer that completes after its deadline raises instead of counting a stall.
    tiers
        Per-expert precision tiers, ``HIGH,LOW[:FRACTION]`` (``"q4,q2"``): the engine runs
        over both versions (a :class:`~czyx.store.models.tiered.TieredModel`) and reads the
        hot list's first experts, filling ``FRACTION`` of the budget (default 0.5), at the
        high precision, the rest at the low one (:mod:`czyx.inference.tiers`). None (the
        default): one version. Changes the outputs: opt-in.
    """

    policy: str = "nextuse"
    stream: bool = True
    io: str | None = None
    readers: int = 2
    native: bool | None = None
    prefetch: bool = True
    prefetch_evicts: bool = False
    prefetch_slots: int = 0
    lookahead: int = 1
    width: int | None = None
    early: bool = True
    strict_deadlines: bool = False
    tiers: str | None = None

    def __post_init__(self) -> None:
        if self.readers < 1:
            raise ValueError(f"readers: {self.readers} must be at least 1")
        if self.prefetch_slots < 0:
            raise ValueError(f"prefetch_slots: {self.prefetch_slots} is negative")
        if self.lookahead < 0 or (self.lookahead == 0 and not self.early):
            raise ValueError(f"lookahead: {self.lookahead}: at least 1, or 0 with early routing")
        if self.width is not None and self.width < 1:
            raise ValueError(f"width: {self.width} must be at least 1")
        if self.tiers is not None:
            from czyx.inference.tiers import TierSpec

            TierSpec.parse(self.tiers)  # a malformed spec fails here, not at open

    def with_(self, **changes: Any) -> EngineOptions:
        """A copy with ``changes`` (old spellings accepted, with a DeprecationWarning)."""
        if "threads" in changes:
            # Not the old spelling of `readers` here: `threads` is the engine's kernel
            # thread count (Engine(threads=)), so mapping it would silently mean another thing.
            raise TypeError(
                "EngineOptions has no 'threads': reader threads are 'readers', "
                "kernel threads are Engine(threads=...)"
            )
        return replace(self, **renamed(changes, stacklevel=3))


def renamed(kwargs: dict[str, Any], *, stacklevel: int = 2) -> dict[str, Any]:
    """``kwargs`` with deprecated option names mapped to the current ones (warned once each).

    Raises
    ------
    TypeError
        Both an old and a new spelling of one option were given.
    """
    out = dict(kwargs)
    for old, new in DEPRECATED_NAMES.items():
        if old in out:
            if new in out:
                raise TypeError(f"give {new!r} only ({old!r} is its deprecated spelling)")
            warnings.warn(
                f"{old!r} is deprecated: use {new!r}", DeprecationWarning, stacklevel=stacklevel + 1
            )
            out[new] = out.pop(old)
    return out


DEFAULT_OPTIONS = EngineOptions()

#: The defaults of a batched engine (``czyx serve``, :func:`czyx.server.create_app`), where
#: a step acquires the union of many sequences' experts. No look-ahead prefetch: a batch's
#: predictions cover most of a layer and, read into a partial budget, evict the experts
#: the batch needs (it read more bytes per token with prefetch than without,
#: ``bench/SERVE-prefetch.md`` against ``bench/SERVE.md``). Eviction by
#: :class:`~czyx.inference.eviction.CyclicPolicy`: once a batch's union exceeds the slots,
#: which layer comes next decides what is needed soonest (``bench/SERVE.md`` replays
#: every policy and the offline optimum on the same acquires).
BATCHED_OPTIONS = EngineOptions(policy="cyclic", prefetch=False)


#: The draft modes :class:`SpeculateOptions` accepts (``draft:NAME@VER`` besides these).
SPECULATE_MODES = ("off", "lookup", "mtp")


@dataclass(frozen=True)
class SpeculateOptions:
    """Speculative decoding: what drafts the next tokens, and how many at most.

    One value whose defaults ``czyx run``, ``czyx serve`` (its server default and
    each request's) and the benches share (:mod:`czyx.inference.speculative`).

    Attributes
    ----------
    mode
        ``"off"``; ``"lookup"`` (prompt lookup: the tokens that followed the
        latest earlier occurrence of the text's last n-gram); ``"mtp"`` (the model's
        own multi-token-prediction layer, DeepSeek-V3 / GLM-4.5's
        ``num_nextn_predict_layers``: :mod:`czyx.inference.mtp`); or
        ``"draft:NAME@VER"``, a version of the same store (a low-bit copy of the
        same model, say) whose greedy tokens are the drafts.
    draft_tokens
        Tokens drafted per step at most (the verification step's extra rows).
    adaptive
        Choose each step's draft length from the acceptance measured so far (fewer,
        down to none, where drafts are mostly rejected); False: always
        ``draft_tokens`` (as many as the drafter proposes).
    ngram
        Prompt lookup: the longest suffix n-gram searched for (then shorter ones, down to 1).
    draft_cache_mb
        The drafter's own expert slot budget in MiB, a draft version's or the MTP
        layer's (None: the engine's default for it).
    """

    mode: str = "off"
    draft_tokens: int = 4
    adaptive: bool = True
    ngram: int = 3
    draft_cache_mb: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in SPECULATE_MODES and not (
            self.mode.startswith("draft:") and "@" in self.mode[6:]
        ):
            raise ValueError(
                f"speculate: {self.mode!r} is not one of off, lookup, mtp, draft:NAME@VER"
            )
        if not 1 <= self.draft_tokens <= 32:
            raise ValueError(f"draft tokens: {self.draft_tokens} is not in 1..32")
        if self.ngram < 1:
            raise ValueError(f"ngram: {self.ngram} must be at least 1")
        if self.draft_cache_mb is not None and not self.draft_cache_mb > 0:
            raise ValueError(f"draft cache: {self.draft_cache_mb} MiB must be positive")

    @property
    def enabled(self) -> bool:
        """Whether anything drafts."""
        return self.mode != "off"

    @property
    def draft_ref(self) -> str | None:
        """The draft version's ``NAME@VER`` (``draft:`` mode), else None."""
        return self.mode[6:] if self.mode.startswith("draft:") else None


SPECULATE_OFF = SpeculateOptions()
