"""What the requests-topic consumer does around each fetch: it pauses its partitions while the queue in
Redis is full and resumes them when it drains (backpressure), applies meanwhile the cancels waiting
behind the backlog (:mod:`llmbatch.dispatcher.intake.cancel_scan`), and keeps the lag gauge.
"""

from __future__ import annotations

import contextlib
import logging
import time

from aiokafka import AIOKafkaConsumer

from llmbatch.dispatcher.domain.scheduler import Backpressure
from llmbatch.dispatcher.errors import DispatcherError
from llmbatch.dispatcher.intake.cancel_scan import CancelScanner
from llmbatch.dispatcher.metrics import Metrics
from llmbatch.dispatcher.state.store import StateStore

log = logging.getLogger(__name__)

CANCEL_SCAN_EVERY_S = 2.0  # while paused, how often cancels behind the backlog are looked for
LAG_EVERY_S = 5.0  # how often the lag gauge is refreshed


class FetchFlow:
    """Backpressure, the cancels ahead of a paused consumer and the lag gauge (see the module
    docstring)."""

    def __init__(
        self, store: StateStore, metrics: Metrics, backpressure: Backpressure, cancel_scanner: CancelScanner
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.backpressure = backpressure
        self.cancel_scanner = cancel_scanner
        self._scan_at = 0.0
        self._lag_at = 0.0

    async def before_fetch(self, consumer: AIOKafkaConsumer) -> bool:
        """Pause or resume the partitions by the queue's length; while paused, apply the cancels
        behind the backlog. Returns whether the partitions are paused."""
        paused = await self._apply_backpressure(consumer)
        if paused:
            await self._cancels_ahead(consumer)
        else:
            self.cancel_scanner.forget()
        return paused

    async def _apply_backpressure(self, consumer: AIOKafkaConsumer) -> bool:
        try:
            queued = await self.store.queued_count()
        except DispatcherError:
            self.metrics.transient_errors.labels(component="redis").inc()
            return self.backpressure.paused
        was = self.backpressure.paused
        paused = self.backpressure.update(queued)
        assignment = consumer.assignment()
        if paused:
            consumer.pause(*assignment)
        elif assignment:
            consumer.resume(*assignment)
        if paused != was:
            log.info("partitions paused" if paused else "partitions resumed", extra={"queued": queued})
        self.metrics.paused.set(1 if paused else 0)
        return paused

    async def _cancels_ahead(self, consumer: AIOKafkaConsumer) -> None:
        """While paused, apply the cancels waiting behind the backlog
        (:mod:`llmbatch.dispatcher.intake.cancel_scan`)."""
        now = time.monotonic()
        if now - self._scan_at < CANCEL_SCAN_EVERY_S:
            return
        self._scan_at = now
        try:
            positions = {tp: await consumer.position(tp) for tp in consumer.assignment()}
            await self.cancel_scanner.scan(positions)
        except Exception as exc:  # the next pass tries again; the cancel also applies in its turn
            log.debug("cancel scan failed: %s", exc)

    async def update_lag(self, consumer: AIOKafkaConsumer) -> None:
        """Refresh the lag gauge of each assigned partition (at most every ``LAG_EVERY_S``)."""
        now = time.monotonic()
        if now - self._lag_at < LAG_EVERY_S:
            return
        self._lag_at = now
        for tp in consumer.assignment():
            with contextlib.suppress(Exception):
                high = consumer.highwater(tp)
                if high is not None:
                    position = await consumer.position(tp)
                    self.metrics.consumer_lag.labels(partition=str(tp.partition)).set(max(0, high - position))
