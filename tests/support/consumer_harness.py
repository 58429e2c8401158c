"""The requests-topic consumer alone, in this process, against real Kafka and Redis: topics, group and
key prefix of its own per harness (no Ray: only the consumer half of the dispatcher runs). Stopping it
fails the test when the consumer task died before (a consumer runs until stopped)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient

from llmbatch.adapters.topics import ensure_topics
from llmbatch.dispatcher.domain.keys import Keys
from llmbatch.dispatcher.intake.consumer import RequestConsumer
from llmbatch.dispatcher.kafka.publisher import EventProducer
from llmbatch.dispatcher.metrics import Metrics
from llmbatch.dispatcher.settings import DispatcherOptions, DispatcherSettings
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.settings import LLMBatchSettings, RedisSettings, TopicSettings
from tests.support.dispatcher_kit import TopicReader, assert_task_alive, registry


def make_settings(
    base: LLMBatchSettings, redis: RedisSettings | None = None, **opts: Any
) -> DispatcherSettings:
    tag = uuid.uuid4().hex[:8]
    topics = TopicSettings(
        requests=f"req-{tag}", results=f"res-{tag}", dead_letter=f"req-{tag}.dlt", partitions=2
    )
    kafka = base.kafka.model_copy(update={"topics": topics})
    redis = (redis or base.redis).model_copy(update={"key_prefix": f"t{tag}"})
    options = DispatcherOptions(
        group_id=f"g-{tag}",
        metrics_port=None,
        session_timeout_ms=6000,
        heartbeat_interval_ms=1000,
        io_backoff_base_s=0.1,
        io_backoff_max_s=0.5,
        **opts,
    )
    return DispatcherSettings(kafka=kafka, redis=redis, s3=base.s3, dispatcher=options, engines=registry())


class Harness:
    def __init__(self, settings: DispatcherSettings) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.store = StateStore.from_url(
            settings.redis.url, keys=Keys(settings.redis.key_prefix), socket_timeout=1
        )
        self.producer = EventProducer(settings.kafka, self.metrics)
        self.consumer = RequestConsumer(settings, self.store, self.producer, self.metrics)
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await ensure_topics(self.settings)
        await self.producer.start()
        await self.consumer.start()
        self.task = asyncio.create_task(self.consumer.run())

    def assert_alive(self) -> None:
        """Fails the test when the consumer task ended on its own (it runs until stopped)."""
        assert_task_alive(self.task, "the consumer task")

    async def stop(self) -> None:
        """Stops everything; fails the test when the consumer task had died before (its exception
        is the cause) or did not end cleanly when asked."""
        died = self.task is not None and self.task.done()
        self.consumer.request_stop()
        try:
            if self.task is not None and not died:
                await asyncio.wait_for(self.task, 20)
        finally:
            await self.consumer.stop()
            await self.producer.stop()
            await self.store.close()
        if died:
            self.assert_alive()

    async def send(
        self,
        messages: Sequence[tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]],
        partitions: list[int] | None = None,
    ) -> None:
        """Send in order; with `partitions`, message i goes to partitions[i] instead of its key's."""
        producer = AIOKafkaProducer(
            acks="all",
            max_request_size=self.settings.kafka.topics.max_message_bytes,
            **self.settings.kafka.client_kwargs(),
        )
        await producer.start()
        try:
            for i, (key, value, headers) in enumerate(messages):
                if key is None and value is None:  # send() refuses the pair; other clients write it
                    raw = producer.create_batch()
                    raw.append(key=None, value=None, timestamp=None, headers=headers)
                    partition = 0 if partitions is None else partitions[i]
                    await (
                        await producer.send_batch(
                            raw, self.settings.kafka.topics.requests, partition=partition
                        )
                    )
                    continue
                await producer.send_and_wait(
                    self.settings.kafka.topics.requests,
                    value=value,
                    key=key,
                    headers=headers,
                    partition=None if partitions is None else partitions[i],
                )
        finally:
            await producer.stop()

    async def committed(self) -> int:
        """Sum of the group's committed offsets over the request partitions."""
        admin = AIOKafkaAdminClient(**self.settings.kafka.client_kwargs())
        await admin.start()
        try:
            offsets = await admin.list_consumer_group_offsets(self.settings.dispatcher.group_id)
        finally:
            await admin.close()
        topic = self.settings.kafka.topics.requests
        return sum(meta.offset for tp, meta in offsets.items() if tp.topic == topic and meta.offset > 0)

    def reader(self, which: str) -> TopicReader:
        topic = getattr(self.settings.kafka.topics, which)
        return TopicReader(self.settings.kafka.client_kwargs(), topic)
