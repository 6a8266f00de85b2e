"""Recency-and-frequency eviction policies for the expert slot cache.

Scope: two :class:`~inference.cache.EvictionPolicy` implementations beyond
LRU and LFU, defined exactly as the locality study's replay simulations
(:mod:`inference.locality.replay`) so engine and simulation can be compared
access for access:

- :class:`DecayPolicy` (``"decay"``, the study's ``hotness``): every use adds
  1 to the expert's score, scores halve every ``half_life`` tokens, the
  lowest-scored unblocked slot is evicted (ties: the lowest expert id);
- :class:`SLRUPolicy` (``"slru"``): segmented LRU, a probation segment and a
  protected segment of ``protected_frac`` of the slots; a hit on a probation
  slot promotes it, overflowing protected demotes its LRU slot to probation's
  most recent end; victims come from probation first.

and two the replay study does not have:
:class:`CyclicPolicy` (``"cyclic"``, for the batched engine), decaying
frequency over forward steps divided by how many layers ahead the expert's
layer comes; and :class:`NextUsePolicy` (``"nextuse"``), decay's scores read
as use rates: evict the expert whose expected next use (the rate's mean wait
plus how far ahead its layer comes in the cycle) lies farthest, an online
estimate of Belady's choice (``bench/BELADY.md`` replays it against the
offline optimum).

All four keep their state in preallocated arrays: a use is O(1) scalar work, a
victim query a few vector operations over the slots into scratch buffers,
with no allocation and no dictionary. The only difference from the replay is
the one the engine requires: a slot held by the layer being computed (or
pinned) is never a victim, so when the replay would evict an expert the
current layer just used, the engine takes the next candidate instead.

Time for :class:`DecayPolicy` is the token index, set through
:meth:`DecayPolicy.set_token` by :meth:`inference.cache.ExpertCache.advance`
(which the engine calls once per forward step). Scores live in the log domain
relative to time zero, ``lv = log(score) + t * ln2 / half_life``, so the
eviction order never needs rescaling and no per-slot decay is ever applied.
"""

from __future__ import annotations

import math

import numpy as np

#: Tokens after which a decay score halves (the locality study's ``hotness`` default).
HALF_LIFE_TOKENS = 32.0
#: Share of the slots in SLRU's protected segment (the study's ``slru`` default).
PROTECTED_FRAC = 0.8

_NEVER = np.iinfo(np.int64).max
_EPOCH = np.int64(1) << np.int64(40)  # above any clock value a run reaches


class DecayPolicy:
    """Decaying frequency ("hotness"): evict the expert with the lowest decayed use count.

    Scores belong to the expert ``(layer, class)`` and survive its eviction,
    like :class:`~inference.cache.LFUPolicy`'s counts, so a returning expert
    keeps its history (decayed).

    Parameters
    ----------
    n_slots
        Cache slots.
    n_keys
        Experts (``n_layers * n_experts``).
    half_life
        Tokens after which a score halves.
    """

    name = "decay"

    def __init__(self, n_slots: int, n_keys: int, half_life: float = HALF_LIFE_TOKENS) -> None:
        if not half_life > 0:
            raise ValueError(f"{self.name} half_life {half_life} is not positive")
        self.half_life = float(half_life)
        self.rate = math.log(2.0) / self.half_life
        self.lv = np.full(n_keys, -np.inf)  # log-domain score per (layer, expert)
        self.key = np.zeros(n_slots, np.int64)  # whose expert each slot holds
        self._now = 0.0
        self._score = np.empty(n_slots)
        self._tie = np.empty(n_slots, np.int64)
        self._not_min = np.empty(n_slots, bool)

    def set_token(self, token: int) -> None:
        """Uses from now on happen at token index ``token``."""
        # The same product as the replay (t * rate), so both compute identical floats.
        self._now = token * self.rate

    def filled(self, slot: int, key: int) -> None:
        """``slot`` now holds expert ``key``."""
        self.key[slot] = key

    def touch(self, slot: int) -> None:
        """One use of the slot's expert now: decay its score to now, add 1."""
        k = self.key[slot]
        old = self.lv[k]
        now = self._now
        s = math.exp(old - now) if old > -np.inf else 0.0
        self.lv[k] = math.log(s + 1.0) + now

    def victim(self, blocked: np.ndarray) -> int:
        """The unblocked slot with the lowest score (then the lowest expert id), or -1."""
        return self._lowest(np.take(self.lv, self.key, out=self._score), blocked)

    def _lowest(self, score: np.ndarray, blocked: np.ndarray) -> int:
        """The unblocked slot with the lowest ``score [n_slots]`` (overwritten), then the
        lowest expert id, or -1 when every slot is blocked."""
        np.putmask(score, blocked, np.inf)
        # Ties (e.g. experts used once in the same token) go to the lowest id, as in
        # the replay's heap of (score, id): mask everything above the minimum, argmin ids.
        np.not_equal(score, score.min(), out=self._not_min)
        np.copyto(self._tie, self.key)
        np.putmask(self._tie, self._not_min, _NEVER)
        s = int(self._tie.argmin())
        return -1 if blocked[s] else s


class SLRUPolicy:
    """Segmented LRU: new experts enter probation, a second use promotes to protected.

    One use clock per slot orders both segments; a protected slot ranks after
    every probation slot as a victim (its clock plus 2**40).

    Parameters
    ----------
    n_slots
        Cache slots.
    n_keys
        Unused (per-slot state only); accepted for the common constructor.
    protected_frac
        Share of the slots in the protected segment (at most ``n_slots - 1``).
    """

    name = "slru"

    def __init__(self, n_slots: int, n_keys: int = 0, protected_frac: float = PROTECTED_FRAC):
        if not 0.0 <= protected_frac <= 1.0:
            raise ValueError(f"slru protected_frac {protected_frac} is not in [0, 1]")
        self.cap = max(0, min(n_slots - 1, int(n_slots * protected_frac)))
        self.last_use = np.zeros(n_slots, np.int64)
        self.protected = np.zeros(n_slots, bool)
        self.fresh = np.zeros(n_slots, bool)  # filled, not yet used: its first touch inserts
        self.n_protected = 0
        self._clock = 0
        self._scratch = np.empty(n_slots, np.int64)
        self._mask = np.empty(n_slots, bool)

    def filled(self, slot: int, key: int) -> None:
        """``slot`` now holds a new expert: its next touch puts it in probation."""
        if self.protected[slot]:
            self.protected[slot] = False
            self.n_protected -= 1
        self.fresh[slot] = True

    def touch(self, slot: int) -> None:
        """A use: insert (first use), refresh (protected) or promote (probation)."""
        self._clock += 1
        self.last_use[slot] = self._clock
        if self.fresh[slot]:
            self.fresh[slot] = False
            return
        if self.protected[slot]:
            return
        self.protected[slot] = True
        self.n_protected += 1
        if self.n_protected > self.cap:
            # Demote protected's least recent slot to probation's most recent end.
            np.copyto(self._scratch, self.last_use)
            np.logical_not(self.protected, out=self._mask)
            np.putmask(self._scratch, self._mask, _NEVER)
            y = int(self._scratch.argmin())
            self.protected[y] = False
            self.n_protected -= 1
            self._clock += 1
            self.last_use[y] = self._clock

    def victim(self, blocked: np.ndarray) -> int:
        """Probation's least recent unblocked slot, else protected's, or -1."""
        sc = self._scratch
        np.copyto(sc, self.last_use)
        np.add(sc, _EPOCH, out=sc, where=self.protected)
        np.putmask(sc, blocked, _NEVER)
        s = int(sc.argmin())
        return -1 if blocked[s] else s


#: :class:`NextUsePolicy`'s half-life at token 0, growing to ``HALF_LIFE_TOKENS`` over
#: ``WARMUP_TOKENS`` tokens (``bench/BELADY.md``: a cold cache's history is short).
START_HALF_LIFE_TOKENS = 4.0
WARMUP_TOKENS = 224.0
_LN2 = math.log(2.0)

#: Forward steps after which a :class:`CyclicPolicy` score halves.
HALF_LIFE_STEPS = 4.0


class _LayerCyclePolicy(DecayPolicy):
    """Decay's scores, plus where each slot's expert comes in the layer cycle: the base of
    the policies that weigh how many layers ahead of the filled one an expert's layer is
    (:class:`CyclicPolicy`, :class:`NextUsePolicy`).

    The cache tells the policy the layer it is filling (:meth:`set_layer`); a
    subclass's ``set_layout`` sets :attr:`n_layers` and :attr:`n_experts` (keys are
    ``layer * n_experts + expert``) and its own table by layers ahead.
    """

    def __init__(self, n_slots: int, n_keys: int, half_life: float) -> None:
        super().__init__(n_slots, n_keys, half_life)
        self.slot_layer = np.zeros(n_slots, np.int64)
        self.n_layers = 1
        self.n_experts = max(n_keys, 1)
        self.layer = 0
        self._off = np.empty(n_slots, np.int64)

    def set_layer(self, layer: int) -> None:
        """The cache is filling ``layer`` now."""
        self.layer = int(layer)

    def filled(self, slot: int, key: int) -> None:
        """``slot`` now holds expert ``key``."""
        self.key[slot] = key
        self.slot_layer[slot] = key // self.n_experts

    def _by_layers_ahead(self, table: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``table[d]`` per slot into ``out``, ``d`` how many layers ahead of the filled
        layer the slot's expert's layer comes (0: the filled layer itself)."""
        off = self._off
        np.subtract(self.slot_layer, self.layer, out=off)
        np.remainder(off, self.n_layers, out=off)
        return np.take(table, off, out=out)


class CyclicPolicy(_LayerCyclePolicy):
    """Decaying frequency weighted by how soon the layer cycle comes back to an expert.

    A forward step visits the sparse layers in order, so when layer ``L`` is
    being filled, an expert of layer ``L + 1`` that is used again is used
    within this very step, while an expert of layer ``L - 1`` (just computed)
    is not needed before the next step reaches it again, ``n_layers - 1``
    layers later. Frequency alone (:class:`DecayPolicy`) ignores that and
    LRU inverts it (its oldest slots are the next layers' of the previous
    step: exactly the next ones needed). This policy approximates Belady's
    choice of the expert whose next use lies farthest: it evicts the lowest
    ``score / distance``, where ``score`` is the expert's use count decayed
    over forward steps (halving every ``half_life`` steps) and ``distance``
    is how many layers ahead its layer comes (1 for the next layer,
    ``n_layers`` for the current one's other experts).

    It matters most where a step's experts do not all fit: a batch of
    sequences whose union of routed experts exceeds the slots
    (``bench/SERVE.md`` replays it against the offline optimum).

    Time is counted in forward steps (one per :meth:`set_token`, which the
    cache calls once per step), the period of the layer cycle, whatever the
    number of tokens a step carries. The cache tells the policy its layout
    (:meth:`set_layout`) and the layer it is filling (:meth:`set_layer`).

    Parameters
    ----------
    n_slots
        Cache slots.
    n_keys
        Experts (``n_layers * n_experts``).
    half_life
        Forward steps after which a score halves.
    """

    name = "cyclic"

    def __init__(self, n_slots: int, n_keys: int, half_life: float = HALF_LIFE_STEPS) -> None:
        super().__init__(n_slots, n_keys, half_life)  # scores and touch() as decay's
        self._log_dist = np.zeros(1)  # log(distance) by (slot layer - current layer) mod n_layers
        self._steps = -1
        self._ld = np.empty(n_slots)

    def set_layout(self, n_layers: int, n_experts: int) -> None:
        """Keys are ``layer * n_experts + expert`` over ``n_layers`` layers."""
        self.n_layers, self.n_experts = int(n_layers), int(n_experts)
        dist = np.arange(self.n_layers, dtype=np.float64)
        dist[0] = self.n_layers  # the current layer's other experts: the next step
        self._log_dist = np.log(dist)

    def set_token(self, token: int) -> None:
        """A forward step starts (the token index itself is not used: time is steps)."""
        self._steps += 1
        self._now = self._steps * self.rate

    def victim(self, blocked: np.ndarray) -> int:
        """The unblocked slot with the lowest score / distance (ties: lowest key), or -1."""
        score = np.take(self.lv, self.key, out=self._score)
        score -= self._by_layers_ahead(self._log_dist, self._ld)
        return self._lowest(score, blocked)


class NextUsePolicy(_LayerCyclePolicy):
    """Evict the expert whose expected next use lies farthest (an online Belady).

    Decay's score (uses decayed with a half-life of ``half_life`` tokens) read
    as a rate: an expert used at a steady rate ``r`` per token scores ``r / c``
    with ``c = 1 - 2**(-1 / half_life)``, so the mean wait to its next use is
    ``1 / (c * score)`` tokens. A forward step visits the layers in order, so
    on top of that wait an expert of the layer ``d`` layers ahead of the one
    being filled cannot come back before ``d / n_layers`` of a step (the
    filled layer's own other experts: a whole step). The victim is the
    largest ``1 / (c * score) + step * d / n_layers`` (``step``: tokens per
    forward step, 1 when decoding one sequence), ties to the lowest expert id.

    The wait term alone ranks exactly as decay does; the layer term only
    reorders experts whose waits are within a step of each other, which is
    where decay's choice is a coin toss and Belady's is not (the next layer's
    experts are needed within this step, the filled layer's not before the
    next one). ``bench/BELADY.md`` replays it against decay and Belady.

    The half-life starts short and lengthens as history accrues: from
    ``start_half_life`` at token 0 linearly to ``half_life`` at token
    ``warmup``. A cold cache has only a few tokens of history, and a long
    half-life would then weigh the first tokens' uses like the last ones
    (frequency since the start, which keeps whatever came first); the
    schedule matters for a run's first tokens, not for steady decoding
    (``bench/BELADY.md``).
    Scores live in the log domain relative to a clock that advances by
    ``ln 2 / h`` a token at the half-life ``h`` of the moment, so a changing
    half-life never rescales them.

    Time is the token index, as for decay (:meth:`set_token`); the cache tells
    the policy its layout (:meth:`set_layout`) and the layer it is filling
    (:meth:`set_layer`), as for :class:`CyclicPolicy`.

    Parameters
    ----------
    n_slots
        Cache slots.
    n_keys
        Experts (``n_layers * n_experts``).
    half_life
        Tokens after which a score halves, once warm (decay's default).
    start_half_life
        The half-life at token 0.
    warmup
        Tokens over which the half-life grows to ``half_life``.
    """

    name = "nextuse"
    #: Largest exponent of a wait (``exp(709)`` is the last finite double): an expert
    #: unused for this long is as good as never used, and exp does not overflow.
    _MAX_LOG_WAIT = 700.0

    def __init__(
        self,
        n_slots: int,
        n_keys: int,
        half_life: float = HALF_LIFE_TOKENS,
        start_half_life: float = START_HALF_LIFE_TOKENS,
        warmup: float = WARMUP_TOKENS,
    ) -> None:
        super().__init__(n_slots, n_keys, half_life)
        if not 0 < start_half_life <= half_life or not warmup > 0:
            raise ValueError(
                f"{self.name} start_half_life {start_half_life} is not in (0, {half_life}] "
                f"or warmup {warmup} is not positive"
            )
        self.start_half_life = float(start_half_life)
        self.warmup = float(warmup)
        # The half-life of the moment, and log(1 / c) at it: the log wait, in tokens, of an
        # expert scoring 1 (used once, now).
        self._h = self.start_half_life
        self._log_inv_c = -math.log1p(-(2.0 ** (-1.0 / self._h)))
        self._token = -1  # the first step's tokens are 0..token
        self._step = 1.0  # tokens per forward step (the last advance's)
        self._frac = np.ones(1)  # d / n_layers by (slot layer - filled layer) mod n_layers
        self._ahead = np.zeros(1)  # _frac * _step
        self._lag = np.empty(n_slots)

    def set_layout(self, n_layers: int, n_experts: int) -> None:
        """Keys are ``layer * n_experts + expert`` over ``n_layers`` layers."""
        self.n_layers, self.n_experts = int(n_layers), int(n_experts)
        frac = np.arange(self.n_layers, dtype=np.float64) / self.n_layers
        frac[0] = 1.0  # the filled layer's other experts: not before the next step
        self._frac = frac
        self._ahead = frac * self._step

    def half_life_at(self, token: int) -> float:
        """The half-life in force at token index ``token``."""
        grown = min(token / self.warmup, 1.0)
        return self.start_half_life + (self.half_life - self.start_half_life) * grown

    def set_token(self, token: int) -> None:
        """Uses from now on happen at token index ``token`` (the last token of the step)."""
        dt = token - self._token
        step = float(max(dt, 1))
        if step != self._step:  # a batch or a prefill: the layer cycle spans more tokens
            self._step = step
            np.multiply(self._frac, step, out=self._ahead)
        self._token = int(token)
        h = self.half_life_at(token)
        if h != self._h:
            self._h = h
            self._log_inv_c = -math.log1p(-(2.0 ** (-1.0 / h)))
        # The clock runs at the half-life of the moment: (tokens * ln 2) / h.
        self._now += dt * _LN2 / h

    def victim(self, blocked: np.ndarray) -> int:
        """The unblocked slot with the farthest expected next use (ties: lowest key), or -1."""
        wait = self._score
        # log wait = log(1 / c) - log(score now) = log(1 / c) + now - lv
        np.take(self.lv, self.key, out=wait)
        np.subtract(self._now + self._log_inv_c, wait, out=wait)
        np.minimum(wait, self._MAX_LOG_WAIT, out=wait)
        np.exp(wait, out=wait)
        wait += self._by_layers_ahead(self._ahead, self._lag)
        np.negative(wait, out=wait)  # the farthest first: argmin of the negated
        return self._lowest(wait, blocked)
