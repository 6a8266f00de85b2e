"""Speculative decoding: drafted tokens verified in one batched step, KV rolled back.

Scope: the :class:`Drafter` interface and its drafters (:class:`PromptLookup`, the
latest earlier occurrence of the text's last n-gram; :class:`ModelDrafter`, the
greedy tokens of a second engine, such as a low-bit version of the same model;
the model's own MTP layer, :mod:`czyx.inference.mtp`), the
adaptive draft length (:class:`DraftLength`) and the decode loop
(:func:`speculative_decode`) that :func:`~czyx.inference.generate.generate_ids` runs
when given a :class:`Speculator`.

Why it pays for a model streamed from disk: the pending token and ``k`` drafts go
through one batched step (:meth:`Engine.verify`, over
:func:`~czyx.inference.batch.forward_batch`), which acquires each routed expert once
for every token that chose it, so a step's reads and weight streaming serve every
token it keeps. With most drafts accepted the bytes read per generated token fall;
rejected drafts' experts were read too, so at low acceptance they rise (measured in
``bench/SPECULATE.md``), which the adaptive length weighs as step time.

Why the output does not change: each position's token is chosen from the target
model's own logits for that position (:meth:`Sampler.verify`): greedy takes the
argmax, accepted where it is the draft; sampling follows the speculative-sampling
rule for a draft proposed with certainty (accept with probability ``p(draft)``, else
draw from ``p`` without the draft), which leaves each token's distribution
:meth:`Sampler.__call__`'s. The first rejected position ends the step: its token is
the correction, the positions after it are rolled back (:meth:`Engine.rollback`);
when every draft is accepted the last row's logits give one more token. Where the
model decodes in C the batched rows are bit-identical to one-token decodes, so the
greedy tokens are those of decoding without drafts; elsewhere they agree to float32
rounding (see :meth:`Engine.verify`). A rope whose tables depend on the length
reached verifies each draft with a one-token decode, only after its predecessor was
accepted: exact, without the batching.
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from czyx.inference.errors import InferenceError
from czyx.inference.options import SpeculateOptions
from czyx.inference.sampling import Sampler
from czyx.store.interfaces import StoreInterface

if TYPE_CHECKING:
    from czyx.inference.engine import Engine

#: The relative cost of one more verified row beside a plain decode step before any
#: is measured (:class:`DraftLength` measures it as it goes).
VERIFY_COST = 0.25

#: Recent step times :class:`DraftLength` weighs.
WINDOW = 9

#: Plain steps timed before the first draft, and the drafting steps between two plain
#: ones that keep the plain step's time current.
PLAIN_FIRST = 3
REMEASURE_EVERY = 16

#: Steps without drafts (the adaptive length at 0) before one draft is tried again,
#: so a text that becomes predictable is noticed.
PROBE_EVERY = 16


class SpeculationError(InferenceError):
    """A drafter could not be built or used (a draft model of another vocabulary)."""


@runtime_checkable
class Drafter(Protocol):
    """Proposes the next tokens of a text.

    ``propose(history, k)`` returns at most ``k`` token ids that might follow
    ``history`` (every token so far: prompt and generated); fewer, or none, where
    it has no guess. A drafter may keep state between calls (a draft model's KV
    cache) but must not assume its previous drafts were accepted.
    """

    name: str

    def propose(self, history: Sequence[int], k: int) -> list[int]: ...

    def close(self) -> None: ...


_CHECKED_TAIL = 64  # tokens a drafter compares to tell an extended history from a new one


def common_prefix(seen: Sequence[int], history: Sequence[int], limit: int) -> int:
    """How many leading tokens ``seen`` (what a drafter's cache holds) and ``history``
    share, at most ``limit``.

    An extension of the last history (the usual step) differs only in its last
    drafted tokens: the tail window is scanned, all of it only for another text.
    """
    limit = min(len(seen), len(history), limit)
    common = max(0, limit - _CHECKED_TAIL)
    if common and seen[common - 1] != history[common - 1]:
        common = 0
    while common < limit and seen[common] == history[common]:
        common += 1
    return common


class PromptLookup:
    """Prompt-lookup drafts: the tokens after the latest earlier occurrence of the
    history's last n-gram (``ngram`` tokens, then shorter ones down to 1).

    Code and quoting text repeat their own spans (names, lines, call patterns), so
    the continuation of the last match is often the next tokens; prose matches
    less, and the adaptive length then stops drafting. The n-grams are indexed
    as the history grows (a dictionary per length: n-gram -> where its latest
    continuation starts), so a step costs the new tokens, not the history.
    """

    name = "lookup"

    def __init__(self, ngram: int = 3) -> None:
        if ngram < 1:
            raise ValueError(f"ngram {ngram} must be at least 1")
        self.ngram = ngram
        self._hist: list[int] = []
        self._index: list[dict[tuple[int, ...], int]] = [{} for _ in range(ngram + 1)]

    def _sync(self, history: Sequence[int]) -> None:
        """Index ``history``'s new positions (from scratch when it is not an extension)."""
        seen = len(self._hist)
        # A history extends the last one (a sequence's text grows by accepted tokens):
        # comparing its indexed tail, not all of it, keeps a step O(new tokens). A
        # different history that happened to share that tail would only draft worse
        # tokens, which verification rejects: never a wrong output.
        tail = max(0, seen - _CHECKED_TAIL)
        if seen > len(history) or list(history[tail:seen]) != self._hist[tail:]:
            self._hist, seen = [], 0
            self._index = [{} for _ in range(self.ngram + 1)]
        h = self._hist
        h.extend(history[seen:])
        # A continuation starting at e (< len(h)) follows the n-gram h[e-n:e]; the
        # tail's own n-grams (e == len(h)) have none yet and are indexed next time.
        # Per length, the new positions' n-grams in one update (a zip of n shifted
        # slices, not a Python loop per position: a whole prompt is indexed before the
        # second token), in increasing e, so the latest continuation wins.
        end = len(h)
        for n in range(1, self.ngram + 1):
            lo = max(seen, n)
            if lo < end:
                grams = zip(*(h[lo - n + i : end - n + i] for i in range(n)))
                self._index[n].update(zip(grams, range(lo, end)))

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest match of the history's tail."""
        size = len(history)
        if size < 2:
            return []
        self._sync(history)  # (k = 0 indexes the history alone)
        if k <= 0:
            return []
        h = self._hist
        for n in range(min(self.ngram, size - 1), 0, -1):
            at = self._index[n].get(tuple(h[size - n :]))
            if at is not None:
                return h[at : at + k]
        return []

    def close(self) -> None:
        """Nothing to release."""


class ModelDrafter:
    """Drafts from a second engine: its greedy tokens after the history.

    The draft engine (a low-bit version of the same model, with its own small
    expert cache) keeps its KV cache of the tokens it has seen; each call cuts it
    back to the longest common prefix with ``history`` and processes the rest, so
    accepted tokens are not recomputed and rejected ones are dropped.
    """

    def __init__(
        self,
        engine: Engine,
        name: str = "draft",
        vocab_size: int | None = None,
        owned: Callable[[], None] | None = None,
    ) -> None:
        if vocab_size is not None and engine.cfg.vocab_size != vocab_size:
            raise SpeculationError(
                f"draft model {name}: vocabulary of {engine.cfg.vocab_size} tokens, the "
                f"model's has {vocab_size}: drafts must be the same model's tokens"
            )
        self.engine = engine
        self.name = name
        self._owned = owned  # closes what was opened for this drafter (its store, consumer)
        self._seen: list[int] = []  # the tokens in the draft engine's KV cache

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """``k`` greedy tokens of the draft engine after ``history`` (k = 0: only bring its
        KV cache up to the history)."""
        if not history:
            return []
        seen = self._seen
        common = common_prefix(seen, history, len(history) - 1)  # one token left to process
        eng = self.engine
        eng.rollback(common)
        rest = list(history[common:])
        logits = eng.decode(rest[0]) if len(rest) == 1 else eng.prefill(rest)
        seen[common:] = rest
        out: list[int] = []
        while k > 0:
            tok = int(np.argmax(logits))
            out.append(tok)
            if len(out) == k:
                return out
            logits = eng.decode(tok)
            seen.append(tok)
        return out

    def close(self) -> None:
        """Close the draft engine (and what was opened for it, where it owns that)."""
        try:
            self.engine.close()
        finally:
            if self._owned is not None:
                self._owned()
                self._owned = None


class DraftLength:
    """The draft length of each step, chosen from the acceptance and step times measured.

    The acceptance ``a`` is the fraction of drafted tokens accepted given their
    predecessors were (an exponentially decaying count of successes and first
    failures: the geometric model's estimate). A step of ``k`` drafts then yields
    ``(1 - a^(k+1)) / (1 - a)`` tokens for ``1 + r * k`` of a plain decode step's
    time, ``r`` being the measured cost of one more drafted and verified row
    relative to a plain step (the quickest of the last :data:`WINDOW` plain steps, the median of
    the last verification steps' costs): small where a step is dominated by reading
    weights (each routed expert read once for every row), near 1 on a small
    resident model whose step is its arithmetic. The length that maximises the
    ratio is chosen (0: decode without drafts, so unpredictable text is not
    slowed); at 0, one draft is tried every :data:`PROBE_EVERY` steps to measure
    again (twice as rarely after each probe rejected, down to one in eight times
    that). The first :data:`PLAIN_FIRST` steps are plain ones (they measure the
    plain step's time), and so is every :data:`REMEASURE_EVERY`-th step that would
    draft. Until a batched verification is timed the prior's row cost is a guess:
    drafts are then one-token probes while none has been accepted, and after that
    one draft verified in a batched step (the cheapest step that times a row).
    :attr:`probing` tells a decode loop that the length it was given is a probe:
    drafts the measurements say do not pay, there only to measure the acceptance
    again, which :func:`speculative_decode` verifies one token at a time.

    ``measure=False`` keeps ``r`` at ``cost`` and ignores times: the lengths then
    follow the acceptances alone (a seeded sampled run is reproducible; with
    measured times the draft lengths, and so which random draws a seeded
    sampler makes, depend on the machine's speed, though never the distribution).
    """

    def __init__(
        self,
        most: int,
        adaptive: bool = True,
        cost: float = VERIFY_COST,
        measure: bool = True,
        decay: float = 0.9,
        prior: float = 0.5,
    ) -> None:
        if most < 1:
            raise ValueError(f"draft length {most} must be at least 1")
        self.most = most
        self.adaptive = adaptive
        self.cost = cost
        self.measure = measure
        self.decay = decay
        self._prior = prior
        self._ok = prior  # pseudo-counts: the prior acceptance as one observation
        self._bad = 1.0 - prior
        self._best_for: tuple[float, float, float] | None = None  # what _best was chosen for
        self._best = 0
        self._idle = 0
        self._probe_every = PROBE_EVERY  # doubled by each failed probe (to 8x), reset on success
        self._probing = False  # whether the last length given was a probe
        self._drafting = 0  # steps given drafts (every REMEASURE_EVERY-th is plain instead)
        # Recent plain-step seconds and row-cost observations (their minimum and median):
        # one step slowed by another process (a shared machine) does not swing the length.
        self._plains: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self._rows: collections.deque[float] = collections.deque(maxlen=WINDOW)

    @property
    def probing(self) -> bool:
        """Whether the last length :meth:`next` gave was a probe."""
        return self._probing

    @property
    def acceptance(self) -> float:
        """The measured per-token acceptance (the prior before any draft)."""
        return self._ok / (self._ok + self._bad)

    def best(self) -> int:
        """The length maximising expected tokens per unit of step time."""
        key = (self._ok, self._bad, self.cost)
        if key == self._best_for:  # unchanged since the last step (a step without drafts)
            return self._best
        a = min(self.acceptance, 1.0 - 1e-9)
        best, score = 0, 1.0
        for k in range(1, self.most + 1):
            s = (1.0 - a ** (k + 1)) / (1.0 - a) / (1.0 + self.cost * k)
            if s > score + 1e-12:
                best, score = k, s
        self._best_for, self._best = key, best
        return best

    def next(self) -> int:
        """This step's draft length."""
        self._probing = False  # (a probe the drafter had no tokens for is not pending)
        if not self.adaptive:
            return self.most
        if self.measure and len(self._plains) < PLAIN_FIRST:
            return 0  # plain steps first: their time is the unit
        k = self.best()
        if k > 0 and self.measure and not self._rows:
            # No batched verification timed yet: the prior's row cost is a guess (on a small
            # resident model a row costs nearly a plain step). While no draft has been
            # accepted the drafts are probes (one token at a time), so a text that never
            # matches pays for no batched step; after that, the first batched step verifies
            # a single draft, the cheapest step that times a row.
            if self.acceptance <= self._prior:
                self._probing = True
            return 1
        if k > 0 and self.measure:
            self._drafting += 1
            if self._drafting % REMEASURE_EVERY == 0:
                return 0  # a plain step now and then: the unit stays current
        if k == 0:
            self._idle += 1
            if self._idle >= self._probe_every:
                self._idle = 0
                self._probing = True
                return 1
        return k

    def plain(self, seconds: float) -> None:
        """Count a plain (draftless) step's time."""
        if self.measure and seconds > 0:
            self._plains.append(seconds)

    def update(self, drafted: int, accepted: int, seconds: float | None = None) -> None:
        """Count a step's outcome: ``accepted`` of ``drafted`` (a prefix) accepted, in
        ``seconds`` (drafting, forward pass and choices) where measured: a step whose
        drafts were verified in one batched step, the only kind whose time prices a row."""
        if drafted <= 0:
            return
        if self._probing:  # back off while probes fail
            self._probing = False
            fail = accepted == 0
            self._probe_every = min(8 * PROBE_EVERY, 2 * self._probe_every) if fail else PROBE_EVERY
        d = self.decay**drafted
        self._ok = self._ok * d + accepted
        self._bad = self._bad * d + (1.0 if accepted < drafted else 0.0)
        if self.measure and seconds is not None and self._plains:
            # The quickest recent plain step: a plain step slowed by another process would
            # make rows look cheap, and drafts that do not pay are what must not happen.
            plain = min(self._plains)
            self._rows.append(max(0.0, (seconds / plain - 1.0) / drafted))
            self.cost = statistics.median(self._rows)  # (the first replaces the prior)


class SharedRowCost:
    """What one more row costs in a shared step (a server's batch), relative to a
    decoding sequence's share of that step: the row cost :class:`DraftLength` weighs.

    A step of ``R`` rows (every decoding sequence's pending token and its drafts)
    takes about ``a + b R`` seconds: ``a`` what any step pays (its calls, the expert
    reads its rows share), ``b`` a row's own arithmetic. In a step of ``n`` decoding
    sequences each sequence's plain share is ``a / n + b`` and a drafted row adds
    ``b``, so the row cost is ``b / (a / n + b)``: near 1 where rows are arithmetic
    (a small resident model), small where a step waits on reads. ``a`` and ``b`` are
    the least-squares line through the last ``window`` decode steps (their row
    counts differ as sequences join, end and draft; a negative intercept or slope is
    taken as 0); before two row counts have been seen, ``prior``.
    """

    def __init__(self, prior: float = VERIFY_COST, window: int = 4 * WINDOW) -> None:
        self.prior = prior
        self._steps: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)
        self._line: tuple[float, float] | None = None  # (a, b) of the last fit
        self._stale = False

    def add(self, rows: int, seconds: float) -> None:
        """Count a decode step (no prompt chunk in it) of ``rows`` rows."""
        if rows > 0 and seconds > 0:
            self._steps.append((int(rows), float(seconds)))
            self._stale = True

    def cost(self, n: int) -> float:
        """The row cost for a step of ``n`` decoding sequences."""
        if self._stale:
            self._stale = False
            rows = np.array([r for r, _ in self._steps], np.float64)
            if np.unique(rows).size >= 2:
                secs = np.array([t for _, t in self._steps], np.float64)
                b, a = np.polyfit(rows, secs, 1)
                self._line = (max(float(a), 0.0), max(float(b), 0.0))
        if self._line is None:
            return self.prior
        a, b = self._line
        share = a / max(n, 1) + b
        return b / share if share > 0.0 else self.prior


@dataclass
class Speculator:
    """A drafter and its draft length: what :func:`generate_ids` speculates with.

    ``steps`` records ``(drafted, accepted)`` per decode step (X-Ray's per-step
    record); a step without drafts is ``(0, 0)``.
    """

    drafter: Drafter
    length: DraftLength
    steps: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def lookup(cls, options: SpeculateOptions, measure: bool = True) -> Speculator:
        """Prompt lookup with ``options``' n-gram, length and adaptivity (``measure``: the
        length also weighs the measured cost of a verified row; a batch, whose step times
        are shared, follows the acceptance only)."""
        length = DraftLength(options.draft_tokens, options.adaptive, measure=measure)
        return cls(PromptLookup(options.ngram), length)

    @classmethod
    def open(
        cls,
        options: SpeculateOptions,
        engine: Engine,
        store: StoreInterface | None = None,
        token: str | None = None,
    ) -> Speculator | None:
        """The speculator ``options`` describe for ``engine`` (None when ``off``).

        ``mtp`` runs the target's own multi-token-prediction layer
        (:class:`~czyx.inference.mtp.MTPDrafter`; a model without one is refused with
        a :class:`SpeculationError`), its block under ``options.draft_cache_mb``.
        ``draft:NAME@VER`` opens that version of ``store`` (the open store the target
        came from) through the portal ``token`` (the owner's when None), with its own
        expert budget (``options.draft_cache_mb``) and the target's reader options; it
        must share the target's vocabulary.
        """
        if not options.enabled:
            return None
        length = DraftLength(options.draft_tokens, options.adaptive)
        cache = None if options.draft_cache_mb is None else int(options.draft_cache_mb * 2**20)
        if options.mode == "mtp":
            from czyx.inference.mtp import MTPDrafter

            return cls(MTPDrafter.open(engine, cache), length)
        ref = options.draft_ref
        if ref is None:
            return cls(PromptLookup(options.ngram), length)
        if store is None:
            raise SpeculationError(f"draft model {ref}: no store to open it from")
        from czyx.inference.engine import Engine
        from czyx.portals import open_consumer

        consumer = open_consumer(store, token or None, ref, direct=True)
        try:
            draft = Engine(
                consumer, cache_bytes=cache, options=engine.options, threads=engine.threads
            )
        except BaseException:
            consumer.close()
            raise
        try:
            drafter = ModelDrafter(draft, ref, engine.cfg.vocab_size, owned=consumer.close)
        except BaseException:
            draft.close()
            consumer.close()
            raise
        return cls(drafter, length)

    @property
    def drafted(self) -> int:
        """Tokens drafted so far."""
        return sum(d for d, _ in self.steps)

    @property
    def accepted(self) -> int:
        """Drafted tokens accepted so far."""
        return sum(a for _, a in self.steps)

    def close(self) -> None:
        """Release the drafter."""
        self.drafter.close()


def choose_tokens(
    sampler: Sampler,
    row: Callable[[int], np.ndarray],
    drafts: Sequence[int],
    emit: Callable[[int], bool],
) -> tuple[int, int, bool]:
    """The tokens of a verified step: ``(accepted, kept, stop)``.

    Each draft is checked in turn against its row's logits (``row(i)``: the logits at
    the pending token for ``i = 0``, after draft ``i - 1`` otherwise) by
    :meth:`Sampler.verify`, whose token is emitted (``emit(tok)`` returns True to stop);
    the first rejection ends the step with its token, and when every draft is accepted
    the last row gives one more. ``row(i)`` is asked for only once draft ``i - 1`` was
    accepted (a caller may compute it then). ``kept`` counts the accepted drafts whose
    positions stay processed: all of them, less one when the run stopped on an
    accepted draft (left unprocessed, as a pending token is).
    """
    accepted = 0
    for i, d in enumerate(drafts):
        tok, ok = sampler.verify(row(i), d)
        stop = emit(tok)
        if not ok:
            return accepted, accepted, stop
        accepted += 1
        if stop:
            return accepted, accepted - 1, True
    return accepted, accepted, emit(sampler(row(len(drafts))))


_PLAIN = (0, 0)  # a step's (drafted, accepted) without drafts


def speculative_decode(
    engine: Engine,
    logits: np.ndarray,
    history: list[int],
    max_tokens: int,
    sampler: Sampler,
    eos: set[int],
    spec: Speculator,
    on_token: Callable[[int], None] | None = None,
) -> tuple[list[int], str]:
    """Generate after a prefill whose last logits are ``logits``: ``(tokens, stop reason)``.

    ``history`` is the prompt (extended in place with every generated token). Each
    step drafts up to the :class:`DraftLength`'s tokens, verifies the pending token
    and the drafts in one step (:meth:`Engine.verify`), keeps the accepted prefix
    and the token chosen at the first rejection (or after the last draft) and
    rolls the KV cache back to them. No drafts: a plain :meth:`Engine.decode`.
    A probe (:attr:`DraftLength.probing`: drafts the measured acceptance and row
    cost say do not pay) is verified one token at a time, each draft decoded only
    once its predecessor was accepted: a rejected probe then costs what a plain
    step does, where a batched step would have paid for rows it throws away.
    Stops after an end-of-sequence id or ``max_tokens``; the last token is left
    pending (unprocessed), as without speculation.
    """
    out: list[int] = []

    def emit(tok: int) -> bool:  # True: stop here
        out.append(tok)
        history.append(tok)
        if on_token is not None:
            on_token(tok)
        return tok in eos or len(out) >= max_tokens

    if max_tokens <= 0:
        return out, "max_tokens"
    pending = sampler(logits)
    if emit(pending):
        return out, "eos" if pending in eos else "max_tokens"
    batched = engine.verifies_in_one_step
    clock = time.perf_counter
    # The drafter takes in the prompt before the steps are timed (prompt lookup indexes
    # it, a draft model prefills it): a one-time cost, not a step's.
    propose, length, steps, decode = spec.drafter.propose, spec.length, spec.steps, engine.decode
    propose(history, 0)
    while True:
        t0 = clock()
        k = min(length.next(), max_tokens - len(out) - 1)
        drafts = propose(history, k)[:k] if k > 0 else []
        if not drafts:  # a plain step (most of them, on text the drafter cannot predict)
            logits = decode(pending)
            length.plain(clock() - t0)
            steps.append(_PLAIN)
            pending = sampler(logits)
            if emit(pending):
                break
            continue
        base = engine.position  # the pending token's position
        one_step = batched and not length.probing
        if one_step:
            rows = list(engine.verify([pending, *drafts]))
        else:  # a probe: each draft's logits once its predecessor was accepted
            rows = [decode(pending)]

        def row(i: int, rows: list[np.ndarray] = rows, drafts: list[int] = drafts) -> np.ndarray:
            if i == len(rows):
                rows.append(decode(drafts[i - 1]))
            return rows[i]

        accepted, kept, stop = choose_tokens(sampler, row, drafts, emit)
        keep = base + 1 + kept  # the pending token's position and the kept drafts'
        if engine.position > keep:
            engine.rollback(keep)
        length.update(len(drafts), accepted, clock() - t0 if one_step else None)
        steps.append((len(drafts), accepted))
        pending = out[-1]
        if stop:
            break
    return out, "eos" if out[-1] in eos else "max_tokens"
