"""Reading a chaos run's outcome back: the results and dead-letter topics from their beginning, the
events that count (:class:`~llmbatch.chaos.verdict.Seen`), whether the run has drained, and what the
result files and manifests of completed batches say."""

from __future__ import annotations

import asyncio
import logging
import statistics
from typing import Any

import orjson

from llmbatch.chaos.verdict import Kind, Seen
from llmbatch.chaos.workload import Record
from llmbatch.dispatcher.settings import DispatcherSettings
from llmbatch.schemas.cloudevents import H_ID, decode
from llmbatch.schemas.events import RESULT_EVENT_TYPES, EventType
from llmbatch.schemas.job import Manifest

log = logging.getLogger(__name__)

_STATUS = {
    EventType.ACCEPTED: "accepted",
    EventType.REJECTED: "rejected",
    EventType.COMPLETED: "completed",
    EventType.FAILED: "failed",
    EventType.CANCELLED: "cancelled",
    EventType.EXPIRED: "expired",
}


class TopicReader:
    """Reads a topic from the beginning, incrementally (no group)."""

    def __init__(self, settings: DispatcherSettings, topic: str) -> None:
        self.settings, self.topic = settings, topic
        self.records: list[Any] = []
        self._consumer: Any = None

    async def poll(self) -> list[Any]:
        """Everything read so far, with what one more poll brought (from the start again after an error)."""
        from aiokafka import AIOKafkaConsumer

        try:
            if self._consumer is None:
                self._consumer = AIOKafkaConsumer(
                    self.topic,
                    group_id=None,
                    enable_auto_commit=False,
                    auto_offset_reset="earliest",
                    **self.settings.kafka.client_kwargs(),
                )
                await self._consumer.start()
            batch = await self._consumer.getmany(timeout_ms=1000, max_records=10_000)
        except Exception as exc:  # the broker is being restarted: read on later
            log.info("reading %s failed: %s", self.topic, exc)
            await self.close()
            self.records = []  # a new consumer starts from the beginning again
            return self.records
        for records in batch.values():
            self.records.extend(records)
        return self.records

    async def read_to_end(self, within: float = 120.0) -> list[Any]:
        """Everything on the topic now: polls until every partition's position reached the end
        offsets asked for first (one poll may bring only part of a topic with large records)."""
        loop = asyncio.get_running_loop()
        end_at = loop.time() + within
        await self.poll()
        while self._consumer is None or not self._consumer.assignment():
            if loop.time() > end_at:
                raise TimeoutError(f"{self.topic}: no partitions assigned within {within:.0f} s")
            await self.poll()
        consumer = self._consumer
        ends = await consumer.end_offsets(list(consumer.assignment()))
        while True:
            positions = {tp: await consumer.position(tp) for tp in ends}
            if all(positions[tp] >= end for tp, end in ends.items()):
                return self.records
            if loop.time() > end_at:
                raise TimeoutError(f"{self.topic}: not read to its end within {within:.0f} s")
            await self.poll()

    async def close(self) -> None:
        """Stop the consumer, if one is running."""
        if self._consumer is not None:
            consumer, self._consumer = self._consumer, None
            try:
                await consumer.stop()
            except Exception as exc:
                log.debug("consumer stop: %s", exc)


def seen(records: list[Any]) -> list[Seen]:
    """The events of the results topic the verdict counts: acceptances, rejections and ends."""
    out: list[Seen] = []
    for r in records:
        env = decode(r.key, r.value, r.headers, expect=RESULT_EVENT_TYPES)
        status = _STATUS.get(env.type)
        if status is not None:
            request_id = getattr(env.data, "request_id", None)
            out.append(Seen(status, env.batch_id, env.id, request_id, at=env.time.timestamp()))
    return out


def drained(sent: list[Record], seen: list[Seen]) -> bool:
    """Every batch is rejected or has a terminal event, every duplicate is answered."""
    terminal = {s.batch_id for s in seen if s.status in {"completed", "failed", "cancelled", "expired"}}
    answered = {s.request_id for s in seen if s.status == "rejected"}
    for record in sent:
        s = record.sent
        if s.kind is Kind.BATCH and s.batch_id not in terminal and s.event_id not in answered:
            return False
        if s.kind is Kind.DUPLICATE and s.event_id not in answered:
            return False
    return True


def marks(records: list[Any]) -> set[str]:
    """What the dead letters are known by: their keys and their ``ce_id`` headers."""
    marks: set[str] = set()
    for r in records:
        if r.key:
            marks.add(r.key.decode(errors="replace"))
        marks.update(v.decode(errors="replace") for k, v in (r.headers or ()) if k == H_ID and v)
    return marks


def answers(settings: DispatcherSettings, results: list[Any]) -> dict[str, list[str]]:
    """batch id -> the custom_ids of its output and error lines, for completed batches."""
    from llmbatch.adapters.storage import make_client

    client = make_client(settings.s3)
    out: dict[str, list[str]] = {}
    for r in results:
        env = decode(r.key, r.value, r.headers, expect=RESULT_EVENT_TYPES)
        if env.type is not EventType.COMPLETED or env.batch_id in out:
            continue
        ids: list[str] = []
        for uri in [*env.data.output_uris, *env.data.error_uris]:
            bucket, _, key = str(uri)[5:].partition("/")
            for line in client.get_object(bucket, key).read().splitlines():
                if line.strip():
                    ids.append(str(orjson.loads(line).get("custom_id")))
        out[env.batch_id] = ids
    return out


def job_clock_ahead(settings: DispatcherSettings, results: list[Any]) -> float | None:
    """The median of (manifest ``finished_at`` - terminal ``ce_time``) over completed batches: how far
    ahead of the dispatcher the clock that wrote the manifests ran
    (:attr:`llmbatch.chaos.runner.ChaosResult.job_clock_ahead_s`)."""
    from llmbatch.adapters.storage import make_client

    client = make_client(settings.s3)
    ahead: list[float] = []
    for r in results:
        env = decode(r.key, r.value, r.headers, expect=RESULT_EVENT_TYPES)
        if env.type is not EventType.COMPLETED or env.data.manifest_uri is None:
            continue
        bucket, _, key = str(env.data.manifest_uri)[5:].partition("/")
        manifest = Manifest.model_validate_json(client.get_object(bucket, key).read())
        ahead.append((manifest.timings.finished_at - env.time).total_seconds())
    return statistics.median(ahead) if ahead else None
