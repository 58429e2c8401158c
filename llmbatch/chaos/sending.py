"""Putting a chaos run's workload onto its stack: the input files into MinIO, then the records onto the
requests topic, spread over time and sent again while a broker is down."""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta

import orjson

from llmbatch.chaos.workload import Record
from llmbatch.dispatcher.settings import DispatcherSettings

log = logging.getLogger(__name__)


async def send(settings: DispatcherSettings, records: list[Record], over_s: float) -> int:
    """Send ``records`` in order over about ``over_s`` seconds; a send the broker does not take (it is
    being killed) is tried again until it is (a re-sent record keeps its event id)."""
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(
        **{**settings.kafka.client_kwargs(), "request_timeout_ms": 15000},
        acks="all",
        max_request_size=8 << 20,
    )
    await producer.start()
    pause = over_s / max(1, len(records))
    retries = 0
    try:
        for record in records:
            value = record.value
            if value is not None and "expired" in record.sent.expect:
                # a deadline that cannot be met, counted from the send (the workload was made before)
                deadline = (datetime.now(UTC) + timedelta(seconds=3)).isoformat()
                value = orjson.dumps({**orjson.loads(value), "deadline": deadline})
            while True:
                try:
                    await producer.send_and_wait(
                        settings.kafka.topics.requests,
                        value=value,
                        key=record.key,
                        headers=list(record.headers),
                    )
                    break
                except Exception as exc:  # the broker is down for a while: wait, send again
                    retries += 1
                    log.info("send failed, again in 2 s: %s", exc)
                    await asyncio.sleep(2)
            await asyncio.sleep(pause)
    finally:
        await producer.stop()
    return retries


def upload(settings: DispatcherSettings, records: Iterable[Record]) -> None:
    """Put the records' input files into the input bucket (made if missing)."""
    from llmbatch.adapters.storage import ensure_buckets, make_client

    client = make_client(settings.s3)
    ensure_buckets(client, settings.s3)
    for record in records:
        if record.upload is not None:
            key, body = record.upload
            client.put_object(settings.s3.input_bucket, key, io.BytesIO(body), len(body))
