"""What the dispatcher's health endpoint (:mod:`llmbatch.dispatcher.http`) answers: ``/livez`` fails when
a loop died or has not moved for ``stall_timeout_s`` (a hang, not an outage); ``/readyz`` says what each
dependency does (Redis, Kafka, the consumer's partitions, intake paused or not, the tracker's leases)
and is ready once started, with Redis and Kafka answering, intake not paused, and live. Mixed into
:class:`llmbatch.dispatcher.service.Dispatcher`, whose parts it reads.
"""

from __future__ import annotations

import asyncio
import logging
import time

from llmbatch.dispatcher.errors import DispatcherError
from llmbatch.dispatcher.intake.consumer import RequestConsumer
from llmbatch.dispatcher.kafka.publisher import EventProducer
from llmbatch.dispatcher.runs.tracker import Tracker
from llmbatch.dispatcher.settings import DispatcherSettings
from llmbatch.dispatcher.state.store import StateStore

log = logging.getLogger(__name__)


class Probes:
    """The liveness and readiness of a dispatcher (see the module docstring)."""

    settings: DispatcherSettings
    store: StateStore
    producer: EventProducer
    consumer: RequestConsumer
    tracker: Tracker
    _tasks: list[asyncio.Task[None]]
    _started: bool
    _stalled: list[str]

    def _live(self) -> bool:
        if any(t.done() for t in self._tasks):
            return False
        stalled = self.stalled_loops() if self._started else []
        if stalled != self._stalled:  # said once per change of state
            if stalled:
                log.error(
                    "loop stalled: /livez fails",
                    extra={"loops": stalled, "stall_timeout_s": self.settings.dispatcher.stall_timeout_s},
                )
            else:
                log.info("loops moving again", extra={"loops": self._stalled})
            self._stalled = stalled
        return not stalled

    def stalled_loops(self) -> list[str]:
        """The loops that have not moved for ``stall_timeout_s`` (a hang, not an outage)."""
        now, limit = time.monotonic(), self.settings.dispatcher.stall_timeout_s
        moved = {"consumer": self.consumer.last_progress, "tracker": self.tracker.last_tick}
        return [name for name, at in moved.items() if now - at > limit]

    async def _ready(self) -> tuple[bool, dict[str, str]]:
        detail: dict[str, str] = {}
        try:
            await self.store.ping()
            detail["redis"] = "ok"
        except DispatcherError as exc:
            detail["redis"] = f"unavailable ({exc.code})"
        detail["kafka"] = "ok" if await self.producer.ping() else "unavailable"
        detail["consumer"] = f"{len(self.consumer.assignment)} partition(s)"
        paused = self.consumer.retry.paused
        detail["intake"] = f"paused ({paused})" if paused else "ok"
        leases = self.tracker.leases
        detail["tracker"] = "leader" if leases.is_leader else "standby"  # the launching lease
        detail["tracker_shards"] = f"{len(leases.shards)} of {leases.shard_count}"
        ok = (
            self._started
            and detail["redis"] == "ok"
            and detail["kafka"] == "ok"
            and paused is None
            and self._live()
        )
        return ok, detail
