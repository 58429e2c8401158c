"""Metrics of one shared-engine replica (``llmbatch_engine_*``), exported by Ray.

Ray's metrics agent on each node serves application metrics for Prometheus (the node's
``--metrics-export-port``), under Ray's namespace: ``llmbatch_engine_queued_requests`` is scraped
as ``ray_llmbatch_engine_queued_requests``. Tags: ``model`` and ``replica`` (the actor's id).
Outside a Ray worker (unit tests) the metrics are not recorded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

from llmbatch.ray_job.engines.engine_runner import RunnerStats

log = logging.getLogger(__name__)

GAUGES = {
    "llmbatch_engine_queued_requests": "Requests waiting in the replica's fair queue.",
    "llmbatch_engine_active_requests": "Requests on the replica's engine.",
    "llmbatch_engine_start_seconds": "How long the replica's engine took to start.",
    "llmbatch_engine_idle_seconds": "Seconds since the replica last had a request (0 while busy).",
    "llmbatch_engine_tokens_per_second": "Tokens the replica generated per second over the last minute.",
}
COUNTERS = {
    "llmbatch_engine_requests_total": "Requests the replica answered.",
    "llmbatch_engine_completion_tokens_total": "Tokens the replica generated.",
    "llmbatch_engine_preempted_total": "Requests taken back from the engine for higher-priority work.",
    "llmbatch_engine_abandoned_total": "Requests dropped unanswered: their batch stopped (cancel, deadline).",
    "llmbatch_engine_cold_starts_total": "Engines started (one per replica start).",
}
RATE_WINDOW_S = 60.0


class EngineMetrics:
    """Records one replica's figures; a no-op where Ray's metrics are not available."""

    def __init__(self, model: str) -> None:
        self._tags = {"model": model, "replica": "local"}
        self._gauges: dict[str, Any] = {}
        self._counters: dict[str, Any] = {}
        self._preempted = 0
        self._abandoned = 0
        self._lock = threading.Lock()
        self._recent: deque[tuple[float, int]] = deque()  # (when, tokens) of the last RATE_WINDOW_S
        try:
            import ray
            from ray.util import metrics

            if not ray.is_initialized():
                return
            self._tags["replica"] = ray.get_runtime_context().get_actor_id() or "driver"
            keys = ("model", "replica")
            self._gauges = {n: metrics.Gauge(n, d, tag_keys=keys) for n, d in GAUGES.items()}
            self._counters = {n: metrics.Counter(n, d, tag_keys=keys) for n, d in COUNTERS.items()}
        except Exception as exc:  # metrics must never stop an engine
            log.warning("engine metrics are off: %s", exc)

    @property
    def enabled(self) -> bool:
        return bool(self._gauges)

    def started(self, seconds: float) -> None:
        self._set("llmbatch_engine_start_seconds", seconds)
        self._inc("llmbatch_engine_cold_starts_total", 1)

    def answered(self, requests: int, completion_tokens: int) -> None:
        self._inc("llmbatch_engine_requests_total", requests)
        self._inc("llmbatch_engine_completion_tokens_total", completion_tokens)
        with self._lock:
            self._recent.append((time.monotonic(), completion_tokens))

    def tokens_per_second(self, now: float | None = None) -> float:
        """Tokens answered per second over the last :data:`RATE_WINDOW_S`."""
        now = time.monotonic() if now is None else now
        with self._lock:
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def sample(self, stats: RunnerStats, idle_s: float) -> None:
        """The replica's current state (called periodically)."""
        self._set("llmbatch_engine_tokens_per_second", self.tokens_per_second())
        self._set("llmbatch_engine_queued_requests", stats.queued)
        self._set("llmbatch_engine_active_requests", stats.active)
        self._set("llmbatch_engine_idle_seconds", idle_s)
        if stats.preempted > self._preempted:
            self._inc("llmbatch_engine_preempted_total", stats.preempted - self._preempted)
            self._preempted = stats.preempted
        if stats.abandoned > self._abandoned:
            self._inc("llmbatch_engine_abandoned_total", stats.abandoned - self._abandoned)
            self._abandoned = stats.abandoned

    def _set(self, name: str, value: float) -> None:
        if self._gauges:
            self._gauges[name].set(value, tags=self._tags)

    def _inc(self, name: str, value: float) -> None:
        if self._counters and value > 0:
            self._counters[name].inc(value, tags=self._tags)
