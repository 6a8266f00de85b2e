"""The expert slot cache: RAM as a dial.

Scope: one aligned arena of equal slots sized by a byte budget; a lookup
table ``(layer, router byte) -> slot`` kept as a numpy int32 array; hits are
zero-copy views of a slot; misses are one ``consumer.read_expert`` into a free
or evicted slot; eviction behind :class:`EvictionPolicy` (LRU, LFU, and the
decaying-frequency, segmented-LRU and layer-cycle policies of :mod:`inference.eviction`,
selected by name through :data:`POLICIES`); a token clock for policies that
decay with time; a hot list prewarmed at start; a pinned hot set selected by
class range or prefix.

Invariants (tested):

* a slot marked busy (acquired for the layer being computed) or pinned is
  never chosen as a victim; any budget holding one layer's top-k experts runs;
* the table and the slot owners always agree: ``table[owner[s]] == s`` for
  every filled slot, and an expert is in at most one slot;
* the bytes in a slot are exactly what ``read_expert`` put there (the cache
  never copies or mixes slots), so tiered and fully resident runs compute on
  identical bytes and give bit-identical results.

The per-fetch path does no dictionary lookup, no LMDB access and no
allocation: one table read, and on a miss one policy query over preallocated
arrays and one raw read into a precomputed slot view. When the budget holds
every routed expert (:attr:`ExpertCache.never_evicts`), an acquire whose
experts are all resident is a lookup in a table of ready slots.
"""

from __future__ import annotations

import contextlib
import mmap
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from czyx.inference.errors import CacheBudgetError, SlotInUseError, UnsupportedModelError
from czyx.inference.eviction import CyclicPolicy, DecayPolicy, NextUsePolicy, SLRUPolicy
from czyx.inference.kernels.linear import packed_expert_from_views
from czyx.store.consumer import ModelConsumer, TieredConsumer
from czyx.store.io.widen import widen_into
from czyx.store.quant.formats import is_quant_format

ALIGN = 4096
HUGE_PAGE = 2 * 1024 * 1024


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of the cache's counters."""

    n_slots: int
    slot_nbytes: int
    hits: int
    misses: int
    evictions: int
    bytes_read: int
    read_seconds: float

    @property
    def lookups(self) -> int:
        """Hits plus misses."""
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        """Fraction of expert lookups served from a slot (1.0 when there were none)."""
        return self.hits / self.lookups if self.lookups else 1.0

    def minus(self, earlier: CacheStats) -> CacheStats:
        """The counters accumulated since ``earlier``."""
        return CacheStats(
            self.n_slots,
            self.slot_nbytes,
            self.hits - earlier.hits,
            self.misses - earlier.misses,
            self.evictions - earlier.evictions,
            self.bytes_read - earlier.bytes_read,
            self.read_seconds - earlier.read_seconds,
        )


class EvictionPolicy(Protocol):
    """Chooses which filled slot a miss overwrites.

    ``filled`` is called when a slot receives expert ``key`` (``layer *
    n_experts + expert``), ``touch`` on every
    use of a slot (including the use right after a fill); ``victim`` gets a
    boolean mask of slots that must not be chosen (pinned or busy) and
    returns a slot index, or -1 when every slot is blocked.

    A policy that decays with time may also define ``set_token(token)``;
    the cache calls it from :meth:`ExpertCache.advance` with the index of
    the token (of the last token, for a batch) being computed. A policy that
    weighs the layer cycle may define ``set_layout(n_layers, n_experts)``
    (called once) and ``set_layer(layer)`` (called at each acquire).
    """

    name: str

    def filled(self, slot: int, key: int) -> None: ...

    def touch(self, slot: int) -> None: ...

    def victim(self, blocked: np.ndarray) -> int: ...


class LRUPolicy:
    """Least recently used: a use clock per slot, victim = the oldest unblocked.

    Both operations work on preallocated arrays (``argmin`` over the slots),
    so a miss allocates nothing.
    """

    name = "lru"
    _NEVER = np.iinfo(np.int64).max

    def __init__(self, n_slots: int, n_keys: int = 0) -> None:
        self.last_use = np.zeros(n_slots, np.int64)
        self._scratch = np.empty(n_slots, np.int64)
        self._clock = 0

    def filled(self, slot: int, key: int) -> None:
        """LRU keeps no per-expert state."""

    def touch(self, slot: int) -> None:
        """Record a use of ``slot`` now."""
        self._clock += 1
        self.last_use[slot] = self._clock

    def victim(self, blocked: np.ndarray) -> int:
        """The least recently used slot not in ``blocked``, or -1."""
        np.copyto(self._scratch, self.last_use)
        np.putmask(self._scratch, blocked, self._NEVER)
        s = int(self._scratch.argmin())
        return -1 if blocked[s] else s


class LFUPolicy:
    """Least frequently used expert, by its use count over the whole run; ties go
    to the most recently used.

    Counts belong to the expert ``(layer, class)``, not the slot, so an expert
    that keeps coming back outranks a newcomer even after being evicted. The
    tie rule matters for sweeps: when every token visits more experts than
    there are slots, LRU misses every time, while keeping the older residents
    and letting the newest equal go first keeps a core that hits.
    """

    name = "lfu"
    _NEVER = np.iinfo(np.int64).max

    def __init__(self, n_slots: int, n_keys: int) -> None:
        self.counts = np.zeros(n_keys, np.int64)  # uses per (layer, expert)
        self.key = np.zeros(n_slots, np.int64)  # whose expert each slot holds
        self.last_use = np.zeros(n_slots, np.int64)
        self._score = np.empty(n_slots, np.int64)
        self._clock = 0

    def filled(self, slot: int, key: int) -> None:
        """``slot`` now holds expert ``key``."""
        self.key[slot] = key

    def touch(self, slot: int) -> None:
        """Count a use of the slot's expert now."""
        self._clock += 1
        self.counts[self.key[slot]] += 1
        self.last_use[slot] = self._clock

    def victim(self, blocked: np.ndarray) -> int:
        """The unblocked slot whose expert has the fewest uses (then the newest), or -1."""
        # count * 2**40 - last_use: fewest uses first, then the most recent, in one argmin.
        np.take(self.counts, self.key, out=self._score)
        self._score <<= 40
        self._score -= self.last_use
        np.putmask(self._score, blocked, self._NEVER)
        s = int(self._score.argmin())
        return -1 if blocked[s] else s


#: Eviction policies by name (``czyx run --policy``): each is built as ``cls(n_slots, n_keys)``.
POLICIES = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "decay": DecayPolicy,
    "slru": SLRUPolicy,
    "cyclic": CyclicPolicy,
    "nextuse": NextUsePolicy,
}


def class_prefix_range(prefix: int, bits: int) -> tuple[int, int]:
    """The class range ``[lo, hi)`` of every byte whose top ``bits`` bits equal ``prefix``.

    >>> class_prefix_range(0b10, 2)
    (128, 192)
    """
    if not 0 <= bits <= 8 or not 0 <= prefix < (1 << bits):
        raise ValueError(f"class prefix {prefix:#x} does not fit in {bits} bits (0..8)")
    lo = prefix << (8 - bits)
    return lo, lo + (1 << (8 - bits))


def _aligned_arena(nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    """An anonymous mapping of at least ``nbytes``, sliced to a 2 MiB boundary.

    Huge pages are requested (``MADV_HUGEPAGE``) because direct reads into
    huge-page-backed buffers reach the device limit (DESIGN, Measuring).
    Pages are not touched here: RSS grows only as slots fill.
    """
    size = max(nbytes, 1) + HUGE_PAGE
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        # Transparent huge pages disabled: still correct, just slower I/O.
        with contextlib.suppress(OSError):
            mm.madvise(mmap.MADV_HUGEPAGE)
    buf = np.frombuffer(mm, np.uint8)
    skew = (-buf.ctypes.data) % HUGE_PAGE
    return mm, buf[skew : skew + nbytes]


def _float32_weights(
    views: tuple[np.ndarray, np.ndarray, np.ndarray], slot: np.ndarray, fmt: str
) -> tuple[np.ndarray, np.ndarray] | None:
    """Zero-copy ``(gate_up [2I, H], down [H, I])`` float32 views of a slot, if possible.

    Returns None when the format needs converting per use (f16, bf16).
    """
    gate, up, down = views
    if gate.dtype != np.float32 or up.dtype != np.float32 or down.dtype != np.float32:
        return None
    base = slot.ctypes.data
    off = gate.ctypes.data - base
    if (
        gate.flags.c_contiguous
        and up.flags.c_contiguous
        and gate.shape == up.shape
        and up.ctypes.data == gate.ctypes.data + gate.nbytes
    ):
        gate_up = np.ndarray((2 * gate.shape[0], gate.shape[1]), np.float32, slot.data, off)
        return gate_up, down
    return np.concatenate([gate, up]), down  # not adjacent: only possible for odd layouts


def _convert_into(dst: np.ndarray, src: np.ndarray, fmt: str) -> None:
    """Widen a slot view into a preallocated float32 array (exact for f16 and bf16).

    f16/bf16 go through the C kernel (:func:`store.widen.widen_into`, numpy's
    bits for every input, several times faster than numpy's cast).
    """
    if src.dtype == np.float16 or (fmt == "bf16" and src.dtype == np.uint16):
        widen_into(dst, src, "F16" if src.dtype == np.float16 else "BF16")
    elif src.dtype in (np.float32, np.float64):
        np.copyto(dst, src, casting="same_kind")
    else:
        raise UnsupportedModelError(
            f"expert format {fmt!r} (view dtype {src.dtype}) has no float32 path "
            "in the numpy engine"
        )


#: :meth:`ExpertCache.residency` codes: the expert is in a slot (a hit), was read (or is
#: being read) by a prefetch not yet used, or must be read (a miss).
RESIDENT_HIT, RESIDENT_PREFETCHED, RESIDENT_MISS = 0, 1, 2


class ExpertCache:
    """A fixed byte budget of equal expert slots in one aligned arena.

    Parameters
    ----------
    consumer
        The opened model; the cache calls only ``info``, ``read_expert`` and
        ``expert_views``.
    budget_bytes
        Bytes for slots. The slot count is ``budget // expert_slot_nbytes``
        (capped at the number of routed experts).
    top_k
        Experts per token: the least number of slots that must stay
        unpinned, since a layer's experts are held together while it computes.
    n_sparse_experts
        How many (layer, expert) pairs exist (for the cap); defaults to
        ``n_layers * n_experts``.
    policy
        A name in :data:`POLICIES` (``"lru"``, ``"lfu"``, ``"decay"``,
        ``"slru"``, ``"cyclic"``, ``"nextuse"``) or an :class:`EvictionPolicy` instance.

    ``bytes_read`` counts a whole slot per miss (what the arena receives; the
    store may read the padded stride in direct mode).

    Raises
    ------
    CacheBudgetError
        When the budget holds fewer than ``top_k`` slots.
    """

    #: Bytes of the slot arenas of this process's open caches (they fill as used).
    _live_bytes = 0
    #: Slots set aside for predictions (:class:`~czyx.inference.streaming.StreamingExpertCache`).
    prefetch_slots = 0

    @classmethod
    def reserved_bytes(cls) -> int:
        """Bytes of slot arenas this process's open caches may still fill (a default
        budget counts them as taken: an arena's pages are committed only as slots fill)."""
        return cls._live_bytes

    @staticmethod
    def _release(nbytes: int) -> None:
        ExpertCache._live_bytes -= nbytes

    def __init__(
        self,
        consumer: ModelConsumer,
        budget_bytes: int,
        top_k: int,
        n_sparse_experts: int | None = None,
        policy: str | EvictionPolicy = "lru",
    ) -> None:
        info = consumer.info
        self.consumer = consumer
        self.slot_nbytes = int(info.expert_slot_nbytes)
        self.n_layers = int(info.n_layers)
        self.n_experts = int(info.n_experts)
        self.top_k = int(top_k)
        self.format = info.expert_format
        total = n_sparse_experts if n_sparse_experts is not None else self.n_layers * self.n_experts
        if self.slot_nbytes <= 0 or self.slot_nbytes % ALIGN:
            raise CacheBudgetError(
                f"expert_slot_nbytes={self.slot_nbytes} is not a positive multiple of {ALIGN}"
            )
        n_slots = min(int(budget_bytes) // self.slot_nbytes, max(total, self.top_k))
        if n_slots < self.top_k:
            raise CacheBudgetError(
                f"cache budget {int(budget_bytes)} B holds {n_slots} slot(s) of "
                f"{self.slot_nbytes} B; one layer's top-{self.top_k} experts need "
                f"{self.top_k * self.slot_nbytes} B"
            )
        self.n_slots = n_slots
        self._mm, arena = _aligned_arena(n_slots * self.slot_nbytes)
        ExpertCache._live_bytes += n_slots * self.slot_nbytes
        # returned by close, or when the cache is collected unclosed
        self._unreserve = weakref.finalize(self, ExpertCache._release, n_slots * self.slot_nbytes)
        self.arena = arena.reshape(n_slots, self.slot_nbytes)
        # Precomputed per-slot views: a fetch indexes a list, it never slices.
        self._slot_views = [self.arena[s] for s in range(n_slots)]
        # Per-expert precision tiers (a TieredConsumer, such as a
        # :class:`~czyx.store.models.tiered.TieredModel`): each slot has kernel views for
        # either precision, and the ones in use follow the tier of the expert it was last
        # filled with (:meth:`_filled_at`).
        self._tiered: TieredConsumer | None = (
            consumer if isinstance(consumer, TieredConsumer) else None
        )
        tiered = self._tiered
        #: ``int8 [n_layers, n_experts]`` tier of each expert (None: one precision).
        self.tier_map: np.ndarray | None = tiered.tier if tiered is not None else None
        n_tiers = len(tiered.formats) if tiered is not None else 1
        self._tier_weights = [
            [self._make_weights(s, t) for s in range(n_slots)] for t in range(n_tiers)
        ]
        self._weights = list(self._tier_weights[0])
        #: Tier of the expert each slot holds (0 for an empty slot, or without tiers).
        self.slot_tier = np.zeros(n_slots, np.int8)
        #: Bytes a miss at each tier counts (the slot stride without tiers).
        self.tier_nbytes = tuple(tiered.strides) if tiered is not None else (self.slot_nbytes,)
        #: Expert reads per tier (misses, prefetches and prewarm reads alike).
        self.tier_reads = np.zeros(n_tiers, np.int64)
        #: Expert reads per tier in each forward step so far (:meth:`advance` closes one).
        self.tier_steps: list[tuple[int, ...]] = []
        #: Keep :attr:`tier_steps` (one entry a step: the engine keeps them only for an
        #: X-Ray, so a long generation without one does not grow a list).
        self.record_tier_steps = True
        self._tier_mark: np.ndarray | None = None
        # Called as hook(slot, tier) when a slot changes tier (the C kernels' descriptors).
        self._retier_hooks: list = []
        # Formats that are not float32 are widened per use into this one scratch
        # pair (allocated once), so the fetch path still allocates nothing.
        self._scratch: tuple[np.ndarray, np.ndarray] | None = None
        if any(w is None for w in self._weights):
            gate, _, down = consumer.expert_views(self._slot_views[0])
            self._scratch = (
                np.empty((2 * gate.shape[0], gate.shape[1]), np.float32),
                np.empty(down.shape, np.float32),
            )
            _convert_into(self._scratch[1], down, self.format)  # refuse odd formats now
        self.table = np.full((self.n_layers, self.n_experts), -1, np.int32)
        self.owner = np.full(n_slots, -1, np.int64)  # layer * n_experts + expert
        self.pinned = np.zeros(n_slots, bool)
        self.blocked = np.zeros(n_slots, bool)  # pinned or busy
        self._busy = np.empty(n_slots, np.int64)
        self._n_busy = 0
        self._n_filled = 0
        self._out = np.empty(n_slots, np.int64)
        if isinstance(policy, str):
            if policy not in POLICIES:
                raise ValueError(f"unknown eviction policy {policy!r}; known: {sorted(POLICIES)}")
            policy = POLICIES[policy](n_slots, self.n_layers * self.n_experts)
        self.policy = policy
        self._set_token = getattr(policy, "set_token", None)
        # A policy that knows the layer cycle (CyclicPolicy) learns the layout once and
        # the layer being filled at each acquire.
        self._set_layer = getattr(policy, "set_layer", None)
        set_layout = getattr(policy, "set_layout", None)
        if set_layout is not None:
            set_layout(self.n_layers, self.n_experts)
        self.tokens = 0  # tokens computed so far (advance): the decay policies' clock
        self.hits = self.misses = self.evictions = self.bytes_read = 0
        self.read_seconds = 0.0
        #: Whether the budget holds every routed expert: then no miss ever has to evict
        #: (every expert owns a slot once read), and an acquire whose experts are all
        #: resident and ready is a table read (:meth:`_acquire_ready`).
        self.never_evicts = n_slots >= total
        #: Routed experts of the model (``(layer, expert)`` pairs of its sparse layers).
        self.n_experts_total = int(total)
        # The slot of each expert resident and ready to use (verified, for the streaming
        # cache), -1 otherwise, per layer; kept only when the budget never evicts. Python
        # lists: for a top-k of a few experts, indexing them is several times cheaper
        # than a numpy gather and reduction.
        self._ready = [[-1] * self.n_experts for _ in range(self.n_layers)]

    def _make_weights(self, s: int, tier: int = 0) -> tuple[np.ndarray, np.ndarray] | None:
        tiered = self._tiered
        if tiered is not None:  # packed formats only (TieredModel refuses others)
            views = tiered.expert_views_at(self._slot_views[s], tier)
            fmt = tiered.formats[tier]
            hidden = int(self.consumer.info.config["hidden_size"])
            return packed_expert_from_views(fmt, hidden, views)
        views = self.consumer.expert_views(self._slot_views[s])
        if is_quant_format(self.format):
            # Packed q2/q3/q4/q8 extents: kernel-ready views of the slot, made once.
            hidden = int(self.consumer.info.config["hidden_size"])
            return packed_expert_from_views(self.format, hidden, views)
        return _float32_weights(views, self._slot_views[s], self.format)

    def _filled_at(self, s: int, layer: int, expert: int) -> int:
        """Slot ``s`` is being filled with ``(layer, expert)``: switch its views to the
        expert's tier (before any read into it completes); returns the bytes the miss counts.
        """
        tiers = self.tier_map
        if tiers is None:
            self.tier_reads[0] += 1
            return self.slot_nbytes
        t = int(tiers[layer, expert])
        if t != self.slot_tier[s]:
            self.slot_tier[s] = t
            self._weights[s] = self._tier_weights[t][s]
            for ref in self._retier_hooks:
                hook = ref()
                if hook is not None:
                    hook(s, t)
        self.tier_reads[t] += 1
        return self.tier_nbytes[t]

    def _tier_step(self) -> None:
        """A forward step starts: the reads per tier since the last one close its entry
        (reads before the first step, a prewarm's, belong to no step)."""
        if self._tier_mark is not None:
            self.tier_steps.append(tuple(int(x) for x in self.tier_reads - self._tier_mark))
        self._tier_mark = self.tier_reads.copy()

    def tier_report(self) -> dict:
        """The tiers section of an X-Ray report (a tiered cache): versions, formats, how many
        experts are high, reads and bytes per tier, and reads per tier of each step."""
        steps = list(self.tier_steps)
        if self._tier_mark is not None:  # the step still running
            steps.append(tuple(int(x) for x in self.tier_reads - self._tier_mark))
        reads = [int(x) for x in self.tier_reads]
        return {
            "versions": list(self._tiered.names),  # type: ignore[union-attr]
            "formats": list(self._tiered.formats),  # type: ignore[union-attr]
            "high_experts": int((self.tier_map == 0).sum()),  # type: ignore[operator]
            "experts": int(self.n_experts_total),
            "reads": reads,
            "bytes_read": [r * n for r, n in zip(reads, self.tier_nbytes, strict=True)],
            "steps": [list(s) for s in steps],
        }

    def on_retier(self, hook) -> None:
        """Call the bound method ``hook(slot, tier)`` whenever a slot is refilled at another
        tier than the expert it held (the kernels' per-slot descriptors follow it); held
        weakly, so a dropped kernel table is not kept alive."""
        self._retier_hooks.append(weakref.WeakMethod(hook))

    # ------------------------------------------------------------------ queries

    @property
    def n_pinned(self) -> int:
        """Slots pinned for the whole run."""
        return int(self.pinned.sum())

    @property
    def max_acquire(self) -> int:
        """How many distinct experts one :meth:`acquire` may hold at once (slots set aside
        for predictions, a streaming cache's, are not the demand path's)."""
        return self.n_slots - self.n_pinned - self.prefetch_slots

    def stats(self) -> CacheStats:
        """A snapshot of the counters."""
        return CacheStats(
            self.n_slots,
            self.slot_nbytes,
            self.hits,
            self.misses,
            self.evictions,
            self.bytes_read,
            self.read_seconds,
        )

    def weights(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """``(gate_up [2I, H], down [H, I])`` of a filled slot.

        For f32 slots, zero-copy views of the slot; for quantized formats,
        kernel-ready packed matrices over the slot. For f16/bf16 slots, the
        widened weights in a scratch pair shared by every slot: valid until
        the next call (the decoder uses each expert before fetching the next).
        """
        w = self._weights[slot]
        if w is not None:
            return w
        gate, up, down = self.consumer.expert_views(self._slot_views[slot])
        gate_up, down32 = self._scratch  # type: ignore[misc]
        inter = gate.shape[0]
        _convert_into(gate_up[:inter], gate, self.format)
        _convert_into(gate_up[inter:], up, self.format)
        _convert_into(down32, down, self.format)
        return gate_up, down32

    def slot_bytes(self, slot: int) -> np.ndarray:
        """The raw uint8 view of a slot (for tests and other consumers)."""
        return self._slot_views[slot]

    # ------------------------------------------------------------------ the hot path

    def advance(self, n_tokens: int) -> None:
        """Start a forward step over ``n_tokens`` tokens (the policies' token clock).

        The engine calls this before each prefill or decode step; uses during
        the step happen at the index of its last token. A cache never advanced
        stays at token 0 (a decaying policy then never decays: plain LFU).
        """
        self.tokens += int(n_tokens)
        if self.tier_map is not None and self.record_tier_steps:
            self._tier_step()
        if self._set_token is not None:
            self._set_token(self.tokens - 1)

    def residency(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """What :meth:`acquire` would find for each of ``experts`` of ``layer`` now, without
        counting or holding anything: ``int8`` codes :data:`RESIDENT_HIT` (in a slot),
        :data:`RESIDENT_PREFETCHED` (in a slot or in flight, read by a prefetch not yet
        used; the streaming cache only) or :data:`RESIDENT_MISS` (to be read).

        For watchers of a generation (the server's live expert view): the engine
        never calls it.
        """
        slots = self.table[layer, np.asarray(experts, np.int64)]
        return np.where(slots < 0, RESIDENT_MISS, RESIDENT_HIT).astype(np.int8)

    def acquire(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """Make ``experts`` of ``layer`` resident and hold them until :meth:`release`.

        Returns the slot of each expert (a view of a preallocated array, valid
        until the next call). Held slots are never evicted, so at most
        :attr:`max_acquire` distinct experts may be held together.

        Raises
        ------
        SlotInUseError
            When a miss finds every slot pinned or held.
        """
        if self.never_evicts:
            out = self._acquire_ready(layer, experts)
            if out is not None:
                return out
        self._hold_layer(layer, experts, self._fill)
        return self._out[: len(experts)]

    def acquire_streamed(self, layer: int, experts: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """As :meth:`acquire`, returning before the bytes of its reads have arrived.

        Returns the slots and the positions (indices into ``experts``) whose
        bytes are still on their way, in the order they were requested: a
        caller computes the other positions first and calls
        :meth:`wait_ready` on each of these before reading its slot. This
        cache reads synchronously, so nothing is ever pending.
        """
        return self.acquire(layer, experts), []

    def wait_ready(self, j: int) -> None:
        """Position ``j`` of the last :meth:`acquire_streamed` may be read (always here)."""

    def _acquire_ready(self, layer: int, experts: np.ndarray) -> np.ndarray | None:
        """The slots of ``experts`` when every one is resident and ready, else None.

        Only for a budget that holds every expert: no miss can then pick a victim
        while the layer computes, so the slots need no hold, and the policy no
        touch (it orders evictions, and there are none to order). The hit
        counters are the general path's.
        """
        row = self._ready[layer]
        slots = [row[e] for e in experts.tolist()]
        if -1 in slots:
            return None
        k = len(slots)
        out = self._out[:k]
        out[:] = slots
        self.hits += k
        return out

    def _unready(self, key: int) -> None:
        """Expert ``key`` (``layer * n_experts + expert``) left its slot."""
        self._ready[key // self.n_experts][key % self.n_experts] = -1

    def _unmap(self, s: int) -> int:
        """Slot ``s`` no longer holds its expert (it is about to be written, or its read
        failed): its key, or -1 when it held none."""
        old = int(self.owner[s])
        if old >= 0:
            self.table.flat[old] = -1
            self._unready(old)
        self.owner[s] = -1
        return old

    def _hold_layer(self, layer: int, experts: np.ndarray, fill, on_hit=None) -> None:
        """Hold ``experts`` of ``layer``, their slots into ``self._out``: the shared acquire rule.

        Hits first, all held before any miss is filled: a miss must never evict an
        expert this same call still needs (it would be read back at once). ``fill(layer,
        expert)`` makes a miss resident and returns its slot (the plain cache reads it,
        the streaming cache claims a transfer); ``on_hit(slot)`` sees each hit. Every
        slot is touched in the policy once per use; a policy that weighs the layer cycle
        is told the layer first.
        """
        if self._set_layer is not None:
            self._set_layer(layer)
        row = self.table[layer]
        out = self._out
        blocked = self.blocked
        touch = self.policy.touch
        ex = experts.tolist()
        misses = []
        for j, e in enumerate(ex):
            s = int(row[e])
            if s < 0:
                misses.append(j)
                continue
            self.hits += 1
            if on_hit is not None:
                on_hit(s)
            if not blocked[s]:
                blocked[s] = True
                self._busy[self._n_busy] = s
                self._n_busy += 1
            touch(s)
            out[j] = s
        for j in misses:
            e = ex[j]
            s = int(row[e])
            if s >= 0:  # the same expert twice in one call: filled just before
                self.hits += 1
            else:
                s = fill(layer, e)
            if not blocked[s]:
                blocked[s] = True
                self._busy[self._n_busy] = s
                self._n_busy += 1
            touch(s)
            out[j] = s

    def release(self) -> None:
        """End the current layer's hold: its slots become evictable (unless pinned)."""
        n = self._n_busy
        if n:
            busy = self._busy[:n]
            self.blocked[busy] = self.pinned[busy]
            self._n_busy = 0

    def _fill(self, layer: int, expert: int) -> int:
        if self._n_filled < self.n_slots:
            s = self._n_filled
            self._n_filled += 1
        else:
            s = self.policy.victim(self.blocked)
            if s < 0:
                raise SlotInUseError(
                    f"no evictable slot for layer {layer} expert {expert}: all {self.n_slots} "
                    f"slots are pinned ({self.n_pinned}) or held by the current layer"
                )
            if self.blocked[s]:
                raise SlotInUseError(f"policy {self.policy.name!r} chose held slot {s}")
            # Unowned while it is written: a failed read leaves no stale mapping.
            if self._unmap(s) >= 0:
                self.evictions += 1
        nbytes = self._filled_at(s, layer, expert)
        t0 = time.perf_counter()
        self.consumer.read_expert(layer, expert, self._slot_views[s])
        self.read_seconds += time.perf_counter() - t0
        self.misses += 1
        self.bytes_read += nbytes
        self.owner[s] = layer * self.n_experts + expert
        self.table[layer, expert] = s
        if self.never_evicts:
            self._ready[layer][expert] = s
        self.policy.filled(s, layer * self.n_experts + expert)
        return s

    # ------------------------------------------------------------------ residency

    def prewarm(self, hot: Iterable[tuple[int, int]]) -> int:
        """Load a hot list (most important first) until the slots are full.

        The first entries are touched last, so LRU evicts them last. Counted
        as misses and bytes read (a cold start pays for them). Returns how
        many experts were loaded.
        """
        loaded: list[int] = []
        for layer, expert in hot:
            if self.table[layer, expert] >= 0:
                continue
            if self._n_filled >= self.n_slots:
                break
            loaded.append(self._fill(layer, expert))
        for s in reversed(loaded):
            self.policy.touch(s)
        return len(loaded)

    def pin(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Pin ``(layer, expert)`` pairs resident for the run (loading them if needed).

        Raises
        ------
        CacheBudgetError
            If pinning would leave fewer than ``top_k`` unpinned slots.
        """
        new = [p for p in pairs if not self._is_pinned(*p)]
        if len(new) > self.max_acquire - self.top_k:
            raise CacheBudgetError(
                f"pinning {len(new)} more expert(s) would leave fewer than top-{self.top_k} "
                f"unpinned slots out of {self.n_slots}"
            )
        for layer, expert in new:
            slot = int(self.acquire(layer, np.array([expert]))[0])
            self.pinned[slot] = True
            self.blocked[slot] = True  # a resident fast-path acquire holds nothing itself
            self.release()

    def pin_classes(self, lo: int, hi: int, layers: Iterable[int] | None = None) -> int:
        """Pin every expert whose router byte lies in ``[lo, hi)``, in ``layers`` (default all).

        Use :func:`class_prefix_range` to pin by class prefix. Returns how
        many experts are pinned now.
        """
        lays = range(self.n_layers) if layers is None else layers
        hi = min(hi, self.n_experts)
        self.pin([(la, e) for la in lays for e in range(max(lo, 0), hi)])
        return self.n_pinned

    def _is_pinned(self, layer: int, expert: int) -> bool:
        s = int(self.table[layer, expert])
        return s >= 0 and bool(self.pinned[s])

    def resident(self) -> np.ndarray:
        """``[n, 2]`` array of the resident ``(layer, expert)`` pairs."""
        filled = self.owner[self.owner >= 0]
        return np.stack([filled // self.n_experts, filled % self.n_experts], axis=1)

    def check(self) -> None:
        """Verify the table/owner invariants (tests and debugging); raises AssertionError."""
        for s in range(self.n_slots):
            o = int(self.owner[s])
            if o >= 0:
                assert self.table.flat[o] == s, f"slot {s} owner {o} not mapped back"
        mapped = self.table[self.table >= 0]
        assert len(np.unique(mapped)) == len(mapped), "an expert mapped to two slots or vice versa"
        for o in np.flatnonzero(self.table.ravel() >= 0):
            assert self.owner[self.table.flat[o]] == o

    def close(self) -> None:
        """Drop the arena (views held elsewhere keep it alive until they go)."""
        self._unreserve()  # once: a finalizer runs at most once
        self._weights = []
        self._slot_views = []
