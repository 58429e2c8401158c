"""Reading single records back by coordinates (dispatcher.record_reader) on a real Kafka: a record that
is there, one retention removed (below the log start, or the whole partition emptied), and an offset
past the end: each is None, not a KafkaUnavailable after the read timeout."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic, RecordsToDelete

from llmbatch.dispatcher.kafka.record_reader import RecordReader
from llmbatch.schemas.events import RecordRef
from llmbatch.settings import KafkaSettings
from tests.support.dispatcher_kit import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
async def topic(kafka_settings: KafkaSettings) -> AsyncIterator[str]:
    name = f"rr-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(**kafka_settings.client_kwargs())
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, num_partitions=1, replication_factor=1)])

        async def shown() -> bool:
            described = await admin.describe_topics([name])
            return bool(described and described[0].get("partitions"))

        await wait_for(shown, 30, what="the topic's partitions")
        producer = AIOKafkaProducer(acks="all", **kafka_settings.client_kwargs())
        await producer.start()
        try:
            for i in range(5):
                await producer.send_and_wait(name, f"v{i}".encode(), key=b"k")
        finally:
            await producer.stop()
        yield name
    finally:
        await admin.delete_topics([name])
        await admin.close()


async def _delete_before(kafka: KafkaSettings, topic: str, offset: int) -> None:
    admin = AIOKafkaAdminClient(**kafka.client_kwargs())
    await admin.start()
    try:
        await admin.delete_records(
            {TopicPartition(topic, 0): RecordsToDelete(before_offset=offset)}, timeout_ms=10_000
        )
    finally:
        await admin.close()


async def test_present_removed_and_missing_records(kafka_settings: KafkaSettings, topic: str) -> None:
    reader = RecordReader(kafka_settings, read_timeout_s=20)
    try:
        found = await reader.read(RecordRef(topic=topic, partition=0, offset=2))
        assert found is not None and (found.offset, found.value, found.key) == (2, b"v2", b"k")
        assert await reader.read(RecordRef(topic=topic, partition=0, offset=9)) is None  # past the end
        await _delete_before(kafka_settings, topic, 3)
        assert await reader.read(RecordRef(topic=topic, partition=0, offset=1)) is None  # removed
        found = await reader.read(RecordRef(topic=topic, partition=0, offset=4))
        assert found is not None and found.value == b"v4"
        await _delete_before(kafka_settings, topic, -1)  # -1: up to the end, the partition is empty
        assert await reader.read(RecordRef(topic=topic, partition=0, offset=4)) is None
    finally:
        await reader.close()
