"""The stack's Kafka and MinIO come back after a kill -9 on their ports with their data (what a chaos
run needs): Kafka's topics, records and committed offsets survive (before, every start formatted a
fresh data dir), and MinIO's objects."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.structs import OffsetAndMetadata

from llmbatch.stack import kafka_broker, services
from llmbatch.stack.process import alive, stop_tree
from llmbatch.stack.state import ServiceRecord
from tests.support.services import reaped_or_alive

pytestmark = pytest.mark.integration


async def _write(bootstrap: str, topic: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for i in range(5):
            await producer.send_and_wait(topic, f"v{i}".encode())
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id="g", enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign([TopicPartition(topic, 0)])
        await consumer.commit({TopicPartition(topic, 0): OffsetAndMetadata(2, "")})
    finally:
        await consumer.stop()


async def _read(bootstrap: str, topic: str) -> tuple[list[bytes], int | None]:
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest"
    )
    await consumer.start()
    try:
        values: list[bytes] = []
        deadline = asyncio.get_running_loop().time() + 60
        while len(values) < 5 and asyncio.get_running_loop().time() < deadline:
            for records in (await consumer.getmany(timeout_ms=1000)).values():
                values += [r.value for r in records]
    finally:
        await consumer.stop()
    group = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id="g", enable_auto_commit=False)
    await group.start()
    try:
        group.assign([TopicPartition(topic, 0)])
        committed = await group.committed(TopicPartition(topic, 0))
    finally:
        await group.stop()
    return values, committed


async def _kill9_then_restart(
    start: Callable[..., ServiceRecord], run_dir: Path, first: ServiceRecord
) -> ServiceRecord:
    """kill -9 the service of ``first``, wait until it is gone, start it again from its record."""
    os.kill(first.pid, signal.SIGKILL)
    for _ in range(100):
        if not reaped_or_alive(first.pid):
            break
        await asyncio.sleep(0.1)
    return await asyncio.to_thread(start, run_dir, restart=first)  # its readiness check runs a loop


def _stop(*records: ServiceRecord | None) -> None:
    for rec in records:
        if rec is not None and alive(rec.pid):
            stop_tree(rec.pid)


async def test_kafka_restarts_on_its_ports_with_its_data(tmp_path: Path) -> None:
    topic = f"t-{uuid.uuid4().hex[:8]}"
    first = await asyncio.to_thread(kafka_broker.start_kafka, tmp_path)  # its readiness check runs a loop
    again = None
    try:
        await _write(first.address, topic)
        again = await _kill9_then_restart(kafka_broker.start_kafka, tmp_path, first)
        assert again.ports == first.ports and again.address == first.address
        values, committed = await _read(again.address, topic)
        assert values == [f"v{i}".encode() for i in range(5)] and committed == 2
    finally:
        _stop(first, again)


async def test_minio_restarts_on_its_ports_with_its_objects(tmp_path: Path) -> None:
    import io

    from minio import Minio

    first = await asyncio.to_thread(services.start_minio, tmp_path)
    again = None
    try:

        def client(rec: ServiceRecord) -> Minio:
            return Minio(
                rec.address.removeprefix("http://"),
                access_key=rec.extra["access_key"],
                secret_key=rec.extra["secret_key"],
                secure=False,
            )

        client(first).make_bucket("kept-bucket")
        client(first).put_object("kept-bucket", "k", io.BytesIO(b"kept"), 4)
        again = await _kill9_then_restart(services.start_minio, tmp_path, first)
        assert again.address == first.address
        assert client(again).get_object("kept-bucket", "k").read() == b"kept"
    finally:
        _stop(first, again)
