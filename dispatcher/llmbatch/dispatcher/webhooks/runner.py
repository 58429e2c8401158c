"""The webhooks' part of a dispatcher process: the feed's consumer (group ``<group_id>-webhooks`` on
the results topic) and the deliverer, started when ``LLMBATCH_WEBHOOKS__SIGNING_KEY`` is set."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from llmbatch.dispatcher.domain.keys import Keys
from llmbatch.dispatcher.errors import classify_kafka_start
from llmbatch.dispatcher.metrics import Metrics
from llmbatch.dispatcher.webhooks.deliverer import Deliverer
from llmbatch.dispatcher.webhooks.feed import WebhookFeed
from llmbatch.dispatcher.webhooks.sender import HttpSender, Sender
from llmbatch.dispatcher.webhooks.store import WebhookStore
from llmbatch.settings import KafkaSettings
from llmbatch.settings.webhooks import WebhookSettings

log = logging.getLogger(__name__)
GROUP_SUFFIX = "-webhooks"


class Webhooks:
    """Feed and deliverer over one Redis client (the dispatcher's) and a consumer of their own."""

    def __init__(
        self,
        settings: WebhookSettings,
        kafka: KafkaSettings,
        *,
        redis: Any,
        keys: Keys,
        group_id: str,
        metrics: Metrics,
        sender: Sender | None = None,
    ) -> None:
        self.kafka = kafka
        self.group_id = group_id + GROUP_SUFFIX
        self.metrics = metrics
        self.store = WebhookStore(redis, keys)
        self._sender = sender or HttpSender(workers=settings.concurrency)
        self.deliverer = Deliverer(self.store, settings, self._sender, counter=metrics)
        self.consumer: Any = None

    async def start(self) -> None:
        """Join the feed's consumer group (a retriable :class:`DispatcherError` while Kafka is away)."""
        from aiokafka import AIOKafkaConsumer

        if self.consumer is not None:
            with contextlib.suppress(Exception):
                await self.consumer.stop()
        self.consumer = AIOKafkaConsumer(
            self.kafka.topics.results,
            group_id=self.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level="read_committed",
            max_partition_fetch_bytes=max(1 << 20, self.kafka.topics.max_message_bytes),
            **self.kafka.client_kwargs(),
        )
        try:
            await self.consumer.start()
        except Exception as exc:
            raise await classify_kafka_start(exc, self.kafka) from exc

    def tasks(self) -> list[asyncio.Task[None]]:
        """The feed and the deliverer, started (the consumer must be started first)."""
        log.info("webhooks on: deliveries of batch events to the tenants' endpoints")
        feed = WebhookFeed(self.consumer, self.store, wake=self.deliverer.wake, counter=self.metrics)
        return [
            asyncio.create_task(feed.run(), name="webhook-feed"),
            asyncio.create_task(self.deliverer.run(), name="webhook-deliverer"),
        ]

    async def stop(self) -> None:
        if self.consumer is not None:
            with contextlib.suppress(Exception):
                await self.consumer.stop()
        close = getattr(self._sender, "close", None)
        if close is not None:
            close()
