"""Prometheus metrics of a server: requests and tokens by tenant and version, latency
histograms, and the schedulers' and expert caches' live figures (read at scrape time).

Each app has its own registry, so several servers (tests) in one process never
collide on metric names.

The latency and step histograms are observed once per token or per step, on the
serving path itself: :class:`BulkHistogram` makes an observation one append to a
queue, folded into the bucket counts in bulk (numpy) at scrape time or every
:data:`FOLD_EVERY` observations, instead of a lock and a loop over the buckets each.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable, Sequence

import numpy as np
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.utils import floatToGoString

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    """The counters and histograms a server updates per request and per step."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "czyx_requests",
            "HTTP API requests",
            ["tenant", "version", "endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "czyx_prompt_tokens", "prompt tokens processed", ["tenant", "version"], registry=r
        )
        self.completion_tokens = Counter(
            "czyx_completion_tokens", "tokens generated", ["tenant", "version"], registry=r
        )
        self.ttft = BulkHistogram(
            "czyx_time_to_first_token_seconds",
            "request arrival to its first token",
            "version",
            LATENCY_BUCKETS,
            r,
        )
        self.itl = BulkHistogram(
            "czyx_inter_token_latency_seconds",
            "time between a request's tokens",
            "version",
            LATENCY_BUCKETS,
            r,
        )
        self.batch = BulkHistogram(
            "czyx_batch_sequences",
            "sequences stepped together",
            "version",
            (1, 2, 4, 8, 16, 32, 64),
            r,
        )
        self.step_seconds = BulkHistogram(
            "czyx_step_seconds",
            "duration of one batched forward step",
            "version",
            LATENCY_BUCKETS,
            r,
        )

    def add_live(self, source: Callable[[], Iterable[tuple[str, object, object]]]) -> None:
        """Register figures read at scrape time: ``source()`` yields
        ``(version, scheduler stats, cache stats)``."""
        self.registry.register(_Live(source))


#: Pending observations of one label that trigger a fold by the observer itself (bounds
#: the memory of a server nobody scrapes).
FOLD_EVERY = 4096


class _BulkChild:
    """One label's histogram: observations queue in a deque (thread-safe appends),
    folded into cumulative bucket counts by :meth:`fold`."""

    __slots__ = ("_bounds", "_counts", "_lock", "_pending", "_sum")

    def __init__(self, bounds: np.ndarray) -> None:
        self._bounds = bounds
        self._pending: collections.deque[float] = collections.deque()
        self._counts = np.zeros(bounds.size + 1, np.int64)  # the last: above every bound
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        """Record one observation (a deque append; a bulk fold every FOLD_EVERY)."""
        self._pending.append(value)
        if len(self._pending) >= FOLD_EVERY:
            self.fold()

    def observe_many(self, values: Sequence[float]) -> None:
        """Record several observations at once."""
        self._pending.extend(values)
        if len(self._pending) >= FOLD_EVERY:
            self.fold()

    def fold(self) -> tuple[np.ndarray, float]:
        """Move the pending observations into the counts; returns (counts, sum)."""
        with self._lock:
            pending = self._pending
            n = len(pending)  # only folds pop, under the lock: these n stay there
            if n:
                vals = np.fromiter((pending.popleft() for _ in range(n)), np.float64, n)
                # Bucket i holds value <= bounds[i] (the exposition's "le"), the last the rest.
                idx = np.searchsorted(self._bounds, vals, side="left")
                self._counts += np.bincount(idx, minlength=self._counts.size)
                self._sum += float(vals.sum())
            return self._counts.copy(), self._sum


class BulkHistogram:
    """A histogram with one label whose observations are folded in bulk.

    Exposed as a Prometheus histogram (``NAME_bucket`` with ``le``, ``NAME_count``,
    ``NAME_sum``), the same series a ``prometheus_client.Histogram`` gives but
    ``NAME_created``.
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        label: str,
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.label = label
        self._bounds = np.asarray(sorted(float(b) for b in buckets), np.float64)
        self._children: dict[str, _BulkChild] = {}
        self._lock = threading.Lock()
        registry.register(self)

    def labels(self, value: str) -> _BulkChild:
        """The histogram of one label value (created on first use)."""
        child = self._children.get(value)
        if child is None:
            with self._lock:
                child = self._children.setdefault(value, _BulkChild(self._bounds))
        return child

    def describe(self):
        return []

    def collect(self):
        fam = HistogramMetricFamily(self.name, self.documentation, labels=[self.label])
        les = [floatToGoString(b) for b in self._bounds] + ["+Inf"]
        for value, child in sorted(self._children.items()):
            counts, total = child.fold()
            cum = np.cumsum(counts).tolist()
            fam.add_metric([value], list(zip(les, cum, strict=True)), total)
        yield fam


class _Live:
    """A collector over the schedulers' and caches' own counters."""

    def __init__(self, source) -> None:
        self.source = source

    def describe(self):
        return []

    def collect(self):
        queue = GaugeMetricFamily("czyx_queue_depth", "requests waiting", labels=["version"])
        active = GaugeMetricFamily(
            "czyx_active_sequences", "sequences holding KV", labels=["version"]
        )
        kv = GaugeMetricFamily("czyx_kv_bytes", "KV bytes reserved", labels=["version"])
        hit = GaugeMetricFamily("czyx_expert_hit_rate", "expert cache hit rate", labels=["version"])
        bpt = GaugeMetricFamily(
            "czyx_expert_bytes_per_token",
            "expert bytes read per processed token",
            labels=["version"],
        )
        read = CounterMetricFamily(
            "czyx_expert_bytes_read", "expert bytes read from disk", labels=["version"]
        )
        wait = CounterMetricFamily(
            "czyx_io_wait_seconds", "exposed expert read wait", labels=["version"]
        )
        steps = CounterMetricFamily("czyx_steps", "batched forward steps", labels=["version"])
        reused = CounterMetricFamily(
            "czyx_prefix_reused_tokens",
            "prompt positions reused from the prefix cache",
            labels=["version"],
        )
        drafted = CounterMetricFamily(
            "czyx_speculative_drafted_tokens",
            "tokens drafted by speculative decoding",
            labels=["version"],
        )
        accepted = CounterMetricFamily(
            "czyx_speculative_accepted_tokens",
            "drafted tokens accepted by verification",
            labels=["version"],
        )
        rate = GaugeMetricFamily(
            "czyx_speculative_acceptance_rate",
            "accepted over drafted tokens since start (0 before any draft)",
            labels=["version"],
        )
        for ref, s, c in self.source():
            queue.add_metric([ref], s.waiting)
            active.add_metric([ref], s.active)
            kv.add_metric([ref], s.kv_used)
            lookups = c.hits + c.misses
            hit.add_metric([ref], c.hits / lookups if lookups else 1.0)
            bpt.add_metric([ref], c.bytes_read / s.step_tokens if s.step_tokens else 0.0)
            read.add_metric([ref], c.bytes_read)
            wait.add_metric([ref], c.read_seconds)
            steps.add_metric([ref], s.steps)
            reused.add_metric([ref], s.prefix_tokens)
            # (a scheduler without speculation, e.g. a Ray one, reports none)
            d, a = getattr(s, "drafted", 0), getattr(s, "accepted", 0)
            drafted.add_metric([ref], d)
            accepted.add_metric([ref], a)
            rate.add_metric([ref], a / d if d else 0.0)
        yield from (queue, active, kv, hit, bpt, read, wait, steps, reused, drafted, accepted, rate)
