"""Serving a Ray-placed model: :class:`RayScheduler`, the server's scheduler over a driver.

Scope: ``czyx serve --ray`` hands each served version one of these instead of
the local continuous batcher (:class:`czyx.inference.batch.Scheduler`); it
offers the same ``submit`` / ``stats`` / ``close`` and emits the same
:class:`~czyx.inference.batch.Token` and :class:`~czyx.inference.batch.Done`
events, so the HTTP layer does not change.

What it does *not* do, and why: it does not batch. Each request runs on its
own through the driver (:class:`~czyx.inference.distributed.ray_cluster.RayPipeline`
or :class:`~czyx.inference.distributed.ray_cluster.RayExpertParallel`): its
whole prompt in one step, then one step per generated token, a step being one
chain of actor calls. Up to ``in_flight`` requests have a step in flight at
once, which is what fills a pipeline (stage 2 runs request A while stage 1
runs request B); batching several sequences inside one actor call would need
the batched forward (:func:`czyx.inference.batch.forward_batch`) split by
layer range, which the stages do not have. Because each request is one
sequence through the single-process engine's own layer step, its logits
equal :meth:`Engine.prefill` / :meth:`Engine.decode` bit for bit (not the
local batcher's, whose fixed-width products differ in the last bits).

Refused (a ``ValueError`` subclass, so the server answers 400): sessions
(their KV lives on the actors, not here), scoped portals' expert masks (the
actors route over every expert) and a KV budget (each actor holds its own KV).
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from czyx.inference.batch import (
    BatchOptions,
    Done,
    Event,
    Handle,
    QueueFull,
    SchedulerClosed,
    SchedulerStats,
    StepCounters,
    Token,
)
from czyx.inference.distributed.ray_cluster import TIMEOUT_S, DistributedError, _ray
from czyx.inference.sampling import Sampler, SamplingParams

#: How long the worker waits on Ray before it looks at new, cancelled or closing requests.
POLL_S = 0.05


class RayServeUnsupported(DistributedError, ValueError):
    """A request asks for what serving over Ray does not do (sessions, scoped routing)."""


@dataclass
class _Req:
    handle: Handle
    rid: int
    prompt: np.ndarray
    max_tokens: int
    sampler: Sampler
    eos: frozenset[int]
    generated: list[int]
    started: float = 0.0  # when its step in flight was submitted


class RayScheduler:
    """Requests served one sequence at a time through a Ray driver, several in flight.

    Parameters
    ----------
    driver
        A started :class:`~czyx.inference.distributed.ray_cluster.RayPipeline` or
        :class:`~czyx.inference.distributed.ray_cluster.RayExpertParallel`; closed
        by :meth:`close`.
    vocab_size
        The model's vocabulary (prompt ids are checked against it).
    options
        ``max_queue`` bounds the waiting requests; ``max_batch`` is the default
        ``in_flight``. Other batching options do not apply (see the module docstring).
    on_step
        Called after each finished step with ``(1, tokens, seconds)`` (the step's
        latency from submission: steps of other requests overlap it).
    in_flight
        Requests with a step in flight at once (default ``options.max_batch``).
    timeout_s
        A step not finished within this many seconds ends its request with an error.
    """

    def __init__(
        self,
        driver: Any,
        vocab_size: int,
        options: BatchOptions = BatchOptions(),  # noqa: B008 - frozen
        on_step: Callable[[int, int, float], None] | None = None,
        *,
        in_flight: int | None = None,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        if options.kv_bytes is not None:
            raise RayServeUnsupported("a KV budget does not apply over Ray (the actors hold KV)")
        self.driver = driver
        self.vocab_size = int(vocab_size)
        self.options = options
        self.on_step = on_step
        self.in_flight = int(in_flight if in_flight is not None else options.max_batch)
        if self.in_flight < 1:
            raise ValueError(f"in_flight {self.in_flight} must be at least 1")
        self.timeout_s = float(timeout_s)
        self._ray = _ray()
        self._lock = threading.Condition()
        self._waiting: collections.deque[_Req] = collections.deque()
        self._running: dict[Any, _Req] = {}  # object ref of its step in flight -> request
        self._ids = itertools.count(1)
        self._base = id(self) << 24  # request ids unique to this scheduler on the actors
        self._closed = False
        self._counts = StepCounters()
        self._thread = threading.Thread(target=self._run, name="czyx-ray-serve", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public

    def submit(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        sampling: SamplingParams = SamplingParams(),  # noqa: B008 - frozen
        eos_ids: Sequence[int] = (),
        on_event: Callable[[Event], None] | None = None,
        history: Any = None,
        keep_state: bool = False,
        allowed: np.ndarray | None = None,
    ) -> Handle:
        """Queue a request; its events follow on the returned handle (as ``Scheduler.submit``).

        Raises
        ------
        RayServeUnsupported
            ``history`` / ``keep_state`` (sessions) or ``allowed`` (a scoped portal).
        QueueFull
            ``max_queue`` requests already wait.
        ValueError
            An empty prompt, a token id outside the vocabulary, ``max_tokens < 1``.
        """
        if history is not None or keep_state:
            raise RayServeUnsupported("sessions are not served over Ray")
        if allowed is not None:
            raise RayServeUnsupported("a scoped portal's expert mask is not served over Ray")
        ids = np.asarray(list(prompt), np.int64)
        if ids.size == 0:
            raise ValueError("the prompt is empty: nothing to condition on")
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise ValueError(f"prompt token id out of range 0..{self.vocab_size - 1}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens {max_tokens} must be at least 1")
        with self._lock:
            if self._closed:
                raise SchedulerClosed("the scheduler is closed")
            free = not self._waiting and len(self._running) < self.in_flight
            if len(self._waiting) >= self.options.max_queue and not free:
                raise QueueFull(
                    f"{len(self._waiting)} requests wait and {len(self._running)} run: queue full"
                )
            h = Handle(next(self._ids), self, on_event)  # type: ignore[arg-type]
            req = _Req(
                h, self._base + h.id, ids, int(max_tokens), Sampler(sampling),
                frozenset(eos_ids), [],
            )  # fmt: skip
            self._waiting.append(req)
            self._lock.notify_all()
        return h

    def stats(self) -> SchedulerStats:
        """A snapshot of the counters (``active``: requests with a step in flight)."""
        with self._lock:
            return SchedulerStats(
                waiting=len(self._waiting),
                active=len(self._running),
                last_batch=1,
                kv_used=0,
                kv_budget=None,
                **asdict(self._counts),
            )

    def close(self, timeout: float = 30.0) -> None:
        """Stop (pending requests end "cancelled"), then close the driver and its actors."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join(timeout)
        self.driver.close()

    # ------------------------------------------------------------------ worker

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def _finish(self, req: _Req, reason: str, error: str | None = None) -> None:
        self.driver.end(req.rid)
        req.handle._emit(Done(reason, int(req.prompt.size), len(req.generated), error))

    def _start(self, req: _Req, tokens: np.ndarray) -> None:
        req.started = time.perf_counter()
        self._running[self.driver.submit(req.rid, tokens)] = req

    def _run(self) -> None:
        ray = self._ray
        while True:
            with self._lock:
                for req in [r for r in self._waiting if r.handle.cancelled]:
                    self._waiting.remove(req)
                    self._finish(req, "cancelled")
                if self._closed:
                    for req in [*self._waiting, *self._running.values()]:
                        self._finish(req, "cancelled")
                    self._waiting.clear()
                    self._running.clear()
                    return
                while self._waiting and len(self._running) < self.in_flight:
                    req = self._waiting.popleft()
                    self._start(req, req.prompt)
                if not self._running:
                    self._lock.wait(timeout=1.0)
                    continue
                refs = list(self._running)
            done, _ = ray.wait(refs, num_returns=1, timeout=POLL_S)
            now = time.perf_counter()
            with self._lock:
                for ref in done:
                    self._collect(ref, self._running.pop(ref), now)
                for ref, req in list(self._running.items()):
                    if now - req.started > self.timeout_s:
                        del self._running[ref]
                        self._finish(req, "error", f"no step finished within {self.timeout_s} s")

    def _collect(self, ref: Any, req: _Req, now: float) -> None:
        """A finished step (under the lock): sample, emit, then end or start the next step."""
        try:
            logits = self._ray.get(ref, timeout=self.timeout_s)
        except Exception as exc:  # fail closed: the request ends with the error
            self._finish(req, "error", f"{type(exc).__name__}: {exc}")
            return
        n = int(req.prompt.size) if not req.generated else 1
        self._counts.step(n, now - req.started)
        self._counts.decode_tokens += int(bool(req.generated))
        if self.on_step is not None:
            self.on_step(1, n, now - req.started)
        if req.handle.cancelled:
            self._finish(req, "cancelled")
            return
        try:
            tok = req.sampler(logits)
        except Exception as exc:  # fail closed: the request ends with the error
            self._finish(req, "error", f"{type(exc).__name__}: {exc}")
            return
        req.generated.append(tok)
        self._counts.generated += 1
        req.handle._emit(Token(tok, len(req.generated) - 1, now))
        if tok in req.eos:
            self._finish(req, "stop")
        elif len(req.generated) >= req.max_tokens:
            self._finish(req, "length")
        else:
            self._start(req, np.array([tok], np.int64))
