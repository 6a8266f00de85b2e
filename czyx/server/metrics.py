"""Prometheus metrics of a server: requests and tokens by tenant and version, latency
histograms, and the schedulers' and expert caches' live figures (read at scrape time).

Each app has its own registry, so several servers (tests) in one process never
collide on metric names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

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
        self.ttft = Histogram(
            "czyx_time_to_first_token_seconds",
            "request arrival to its first token",
            ["version"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "czyx_inter_token_latency_seconds",
            "time between a request's tokens",
            ["version"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch = Histogram(
            "czyx_batch_sequences",
            "sequences stepped together",
            ["version"],
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )
        self.step_seconds = Histogram(
            "czyx_step_seconds",
            "duration of one batched forward step",
            ["version"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def add_live(self, source: Callable[[], Iterable[tuple[str, object, object]]]) -> None:
        """Register figures read at scrape time: ``source()`` yields
        ``(version, scheduler stats, cache stats)``."""
        self.registry.register(_Live(source))


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
        yield from (queue, active, kv, hit, bpt, read, wait, steps)
