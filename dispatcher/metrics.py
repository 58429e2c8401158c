"""Prometheus metrics (prefix ``llmbatch_``). Labels are bounded sets; never a batch id."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_DURATION_BUCKETS = (1, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400, 28800, 86400)
_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1,
    2.5,
    5,
    10,
)


class Metrics:
    """All dispatcher metrics in their own registry (several dispatchers may share a process in tests)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.received = Counter(
            "llmbatch_dispatcher_events_received_total",
            "Records read from the requests topic, by event type.",
            ["type"],
            registry=r,
        )
        self.processed = Counter(
            "llmbatch_dispatcher_events_processed_total",
            "Records handled, by outcome (accepted, duplicate, cancel, ...).",
            ["outcome"],
            registry=r,
        )
        self.dead_lettered = Counter(
            "llmbatch_dispatcher_dead_letters_total",
            "Records written to the dead-letter topic, by reason.",
            ["reason"],
            registry=r,
        )
        self.published = Counter(
            "llmbatch_dispatcher_events_published_total",
            "Events written to the results topic, by type.",
            ["type"],
            registry=r,
        )
        self.batches = Gauge("llmbatch_batches", "Batches known to Redis, by state.", ["state"], registry=r)
        self.in_flight = Gauge("llmbatch_dispatcher_in_flight", "Batches holding a Ray job.", registry=r)
        self.job_duration = Histogram(
            "llmbatch_job_duration_seconds",
            "First start to terminal state, by terminal status.",
            ["status"],
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.accept_latency = Histogram(
            "llmbatch_dispatcher_accept_latency_seconds",
            "Record timestamp to durable acceptance.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.attempts = Counter(
            "llmbatch_dispatcher_job_attempts_total",
            "Job attempt events (submitted, retried, lost, stopped, ...).",
            ["event"],
            registry=r,
        )
        self.transient_errors = Counter(
            "llmbatch_dispatcher_transient_errors_total",
            "Retriable errors of dependencies, by component.",
            ["component"],
            registry=r,
        )
        self.consumer_lag = Gauge(
            "llmbatch_dispatcher_consumer_lag",
            "Records behind the end of each assigned partition.",
            ["partition"],
            registry=r,
        )
        self.paused = Gauge(
            "llmbatch_dispatcher_partitions_paused",
            "1 while the consumer's partitions are paused for backpressure.",
            registry=r,
        )
        self.leader = Gauge(
            "llmbatch_dispatcher_tracker_leader", "1 while this replica runs the tracker.", registry=r
        )
        self.commits = Counter(
            "llmbatch_dispatcher_offset_commits_total", "Offset commits, by result.", ["result"], registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
