"""The feed: reads the results topic (a consumer group of its own) and queues one delivery per event
and endpoint that wants it, whichever way the batch came in (Kafka or the HTTP API).

Offsets are committed only after the deliveries of every record read are queued (Redis), so a
restart loses none; the queue takes each (endpoint, event) once, so reading again sends nothing twice.
An event older than an endpoint is not sent to it. A record that does not decode is skipped (counted
and logged with its position): the results topic is read as hostile as any other.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from llmbatch.dispatcher.webhooks.store import Delivery, WebhookStore
from llmbatch.schemas import RESULT_EVENT_TYPES, decode
from llmbatch.schemas.webhooks import WEBHOOK_TYPES, WebhookEndpoint

log = logging.getLogger(__name__)
RETRY_S = (0.5, 1.0, 2.0, 5.0)
HEADER_SAFE = re.compile(r"[\x21-\x7e]{1,256}")  # visible ASCII: what a webhook-id header may hold


class EventCounter(Protocol):
    def webhook_event(self, outcome: str) -> None: ...


class Consumer(Protocol):
    """The part of ``AIOKafkaConsumer`` the feed uses."""

    async def getmany(self, *, timeout_ms: int, max_records: int) -> dict[Any, list[Any]]: ...

    async def commit(self) -> None: ...


class WebhookFeed:
    """Queues the deliveries of the results topic's events (:meth:`run` until cancelled)."""

    def __init__(
        self,
        consumer: Consumer,
        store: WebhookStore,
        *,
        wake: asyncio.Event | None = None,
        counter: EventCounter | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.consumer = consumer
        self.store = store
        self.wake = wake
        self.counter = counter
        self.clock = clock
        self._down = False

    async def run(self) -> None:
        while True:
            try:
                batches = await self.consumer.getmany(timeout_ms=1000, max_records=500)
            except Exception as exc:
                log.warning("webhook feed could not read the results topic: %s: %s", type(exc).__name__, exc)
                await asyncio.sleep(RETRY_S[-1])
                continue
            records = [r for part in batches.values() for r in part]
            if not records:
                continue
            await self._until_queued(records)
            try:
                await self.consumer.commit()
            except Exception as exc:
                log.warning("webhook feed could not commit its offsets (read again later): %s", exc)

    async def _until_queued(self, records: Sequence[Any]) -> None:
        for n in range(1_000_000_000):
            try:
                queued = await self.queue(records)
            except Exception as exc:
                if not self._down:
                    self._down = True
                    log.warning("webhook feed waits for Redis: %s: %s", type(exc).__name__, exc)
                await asyncio.sleep(RETRY_S[min(n, len(RETRY_S) - 1)])
                continue
            if self._down:
                self._down = False
                log.info("webhook feed goes on: Redis answers again")
            if queued and self.wake is not None:
                self.wake.set()
            return

    async def queue(self, records: Iterable[Any]) -> int:
        """Queue the deliveries of ``records`` (aiokafka ``ConsumerRecord``s); returns how many were new."""
        endpoints: dict[str, list[WebhookEndpoint]] = {}
        deliveries: list[Delivery] = []
        for record in records:
            for_record = await self._deliveries(record, endpoints)
            deliveries += for_record
        return await self.store.enqueue(deliveries, int(self.clock() * 1000)) if deliveries else 0

    async def _deliveries(self, record: Any, endpoints: dict[str, list[WebhookEndpoint]]) -> list[Delivery]:
        try:
            envelope = decode(record.key, record.value, record.headers, expect=RESULT_EVENT_TYPES)
        except Exception as exc:
            self._count("invalid")
            log.warning(
                "webhook feed skips record %s[%s]@%s: %s",
                getattr(record, "topic", "?"),
                getattr(record, "partition", "?"),
                getattr(record, "offset", "?"),
                exc,
            )
            return []
        webhook_type = WEBHOOK_TYPES.get(envelope.type)
        if webhook_type is not None and not HEADER_SAFE.fullmatch(envelope.id):
            # it becomes the webhook-id header: an id no header can carry is never sent
            self._count("invalid")
            log.warning("webhook feed skips event %r: its id cannot be a header", envelope.id[:80])
            return []
        if webhook_type is None:
            self._count("not_sent")
            return []
        tenant = str(getattr(envelope.data, "tenant", "default"))
        if tenant not in endpoints:
            endpoints[tenant] = await self.store.endpoints(tenant)
        created = int(envelope.time.timestamp())
        wanted = [
            Delivery(tenant, e.id, envelope.id, webhook_type, created, envelope.subject)
            for e in endpoints[tenant]
            if webhook_type in e.events and created >= e.created_at
        ]
        self._count("sent" if wanted else "no_endpoint")
        return wanted

    def _count(self, outcome: str) -> None:
        if self.counter is not None:
            self.counter.webhook_event(outcome)
