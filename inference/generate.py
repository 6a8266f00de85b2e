"""Streaming generation over an :class:`~inference.engine.Engine`, with run statistics.

Scope: prefill the prompt, then decode token by token, sampling with
:class:`~inference.sampling.Sampler`; stop on an end-of-sequence id or
``max_tokens``; stream text pieces through a callback; report prefill and
decode tokens/s, the expert cache hit rate, bytes read from disk per token
and the exposed I/O wait (time the engine stood waiting on expert reads; with
synchronous reads that is all of the read time).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from czyx.inference.cache import CacheStats
from czyx.inference.engine import Engine
from czyx.inference.sampling import Sampler, SamplingParams
from czyx.inference.tokenizer import StreamDecoder, Tokenizer

if TYPE_CHECKING:
    from czyx.inference.speculative import Speculator

GREEDY = SamplingParams()


@dataclass(frozen=True)
class GenerationStats:
    """What one generation cost."""

    prompt_tokens: int
    generated_tokens: int
    prefill_seconds: float
    decode_seconds: float
    prefill_cache: CacheStats
    decode_cache: CacheStats
    stop_reason: str  # "eos" | "max_tokens"
    #: Speculative decoding, per decode step: (tokens drafted, drafts accepted); empty
    #: without speculation.
    draft_steps: tuple[tuple[int, int], ...] = ()

    @property
    def drafted(self) -> int:
        """Tokens drafted over the run."""
        return sum(d for d, _ in self.draft_steps)

    @property
    def accepted(self) -> int:
        """Drafted tokens accepted over the run."""
        return sum(a for _, a in self.draft_steps)

    @property
    def acceptance_rate(self) -> float:
        """Accepted over drafted tokens (0.0 where nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens per second of prefill."""
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Decoded tokens per second (the first generated token comes from prefill)."""
        n = self.decode_steps
        return n / self.decode_seconds if self.decode_seconds > 0 and n else 0.0

    @property
    def decode_steps(self) -> int:
        """Decoded tokens: every generated token but the first, which prefill gives
        (with speculation a forward pass may give several: :attr:`draft_steps`)."""
        return max(self.generated_tokens - 1, 0)

    @property
    def hit_rate(self) -> float:
        """Expert cache hit rate over prefill and decode together."""
        hits = self.prefill_cache.hits + self.decode_cache.hits
        total = hits + self.prefill_cache.misses + self.decode_cache.misses
        return hits / total if total else 1.0

    @property
    def decode_bytes_per_token(self) -> float:
        """Expert bytes read from disk per decode step."""
        return self.decode_cache.bytes_read / self.decode_steps if self.decode_steps else 0.0

    @property
    def bytes_per_token(self) -> float:
        """All expert bytes read (prefill + decode) per processed token."""
        n = self.prompt_tokens + self.decode_steps
        return (self.prefill_cache.bytes_read + self.decode_cache.bytes_read) / n if n else 0.0

    @property
    def io_wait_seconds(self) -> float:
        """Exposed I/O wait: time spent blocked in expert reads."""
        return self.prefill_cache.read_seconds + self.decode_cache.read_seconds

    def summary(self) -> str:
        """One human line per figure."""
        spec = []
        if self.draft_steps:
            spec = [
                f"speculation: {self.accepted} of {self.drafted} drafted tokens accepted "
                f"({self.acceptance_rate:.2f}), {len(self.draft_steps)} forward passes for "
                f"{self.decode_steps} tokens"
            ]
        return "\n".join(
            [
                f"prefill: {self.prompt_tokens} tokens, {self.prefill_tokens_per_s:.1f} tok/s",
                f"decode: {self.generated_tokens} tokens, {self.decode_tokens_per_s:.1f} tok/s"
                f" (stop: {self.stop_reason})",
                f"expert cache: hit rate {self.hit_rate:.3f}, {self.prefill_cache.n_slots} slots "
                f"of {self.prefill_cache.slot_nbytes} B",
                f"disk: {self.bytes_per_token / 1e6:.3f} MB/token overall, "
                f"{self.decode_bytes_per_token / 1e6:.3f} MB/token in decode",
                f"exposed I/O wait: {self.io_wait_seconds * 1e3:.1f} ms",
                *spec,
            ]
        )


@dataclass(frozen=True)
class Generation:
    """The result of :func:`generate`."""

    tokens: list[int]
    text: str
    stats: GenerationStats


def generate_ids(
    engine: Engine,
    prompt_ids: Sequence[int],
    max_tokens: int,
    sampling: SamplingParams = GREEDY,
    eos_ids: Sequence[int] = (),
    on_token: Callable[[int], None] | None = None,
    speculate: Speculator | None = None,
) -> tuple[list[int], GenerationStats]:
    """Generate up to ``max_tokens`` ids after ``prompt_ids`` (a fresh sequence).

    ``on_token`` is called with each id as soon as it is chosen. ``speculate``:
    draft and verify several tokens per step
    (:func:`~czyx.inference.speculative.speculative_decode`; the same tokens greedily,
    the same distribution sampled).
    """
    if not prompt_ids:
        raise ValueError("the prompt is empty: nothing to condition on")
    if max_tokens < 0:
        raise ValueError(f"max_tokens {max_tokens} is negative")
    engine.reset()
    sampler = Sampler(sampling)
    eos = set(eos_ids)
    c0 = engine.stats()
    t0 = time.perf_counter()
    logits = engine.prefill(list(prompt_ids))
    t1 = time.perf_counter()
    c1 = engine.stats()
    out: list[int] = []
    reason = "max_tokens"
    steps0 = len(speculate.steps) if speculate is not None else 0
    if speculate is not None:
        from czyx.inference.speculative import speculative_decode

        out, reason = speculative_decode(
            engine, logits, list(prompt_ids), max_tokens, sampler, eos, speculate, on_token
        )
    while speculate is None and len(out) < max_tokens:
        tok = sampler(logits)
        out.append(tok)
        if on_token is not None:
            on_token(tok)
        if tok in eos:
            reason = "eos"
            break
        if len(out) == max_tokens:
            break
        logits = engine.decode(tok)
    t2 = time.perf_counter()
    c2 = engine.stats()
    stats = GenerationStats(
        prompt_tokens=len(prompt_ids),
        generated_tokens=len(out),
        prefill_seconds=t1 - t0,
        decode_seconds=t2 - t1,
        prefill_cache=c1.minus(c0),
        decode_cache=c2.minus(c1),
        stop_reason=reason,
        draft_steps=tuple(speculate.steps[steps0:]) if speculate is not None else (),
    )
    return out, stats


def generate(
    engine: Engine,
    tokenizer: Tokenizer,
    prompt: str,
    max_tokens: int = 64,
    sampling: SamplingParams = GREEDY,
    on_text: Callable[[str], None] | None = None,
    speculate: Speculator | None = None,
) -> Generation:
    """Generate text after ``prompt``, streaming pieces to ``on_text``.

    Stops on the tokenizer's or the config's end-of-sequence ids. ``speculate``:
    as :func:`generate_ids`.
    """
    stream = StreamDecoder(tokenizer)

    def emit(tok: int) -> None:
        piece = stream.push(tok)
        if piece and on_text is not None:
            on_text(piece)

    eos = tuple(tokenizer.eos_ids) + tuple(engine.cfg.eos_token_ids)
    ids, stats = generate_ids(
        engine, tokenizer.encode(prompt), max_tokens, sampling, eos, emit, speculate
    )
    rest = stream.flush()
    if rest and on_text is not None:
        on_text(rest)
    return Generation(tokens=ids, text=tokenizer.decode(ids), stats=stats)
