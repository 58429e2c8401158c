"""Kafka producer side: result events, dead letters, and the idempotent terminal-event protocol.

Terminal events are published by :meth:`TerminalPublisher.publish_pending`: for each batch that
reached a terminal state and is not yet marked ``published``, it first writes the batch's dead
letter if one is due (then records ``dlt_written``), then publishes the terminal event whose
``ce_id`` was fixed when the terminal state was recorded, and only then records ``published``.
A crash in between republishes the SAME event id; consumers drop the duplicate.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiokafka import AIOKafkaProducer

from llmbatch.dispatcher import logs
from llmbatch.dispatcher.domain.batch_record import BatchRecord
from llmbatch.dispatcher.domain.dlt import (
    DeadLetter,
    build_dead_letter,
    fit_dead_letter,
    original_with_value,
    reduce_dead_letter,
)
from llmbatch.dispatcher.domain.events import Outcome, build_terminal
from llmbatch.dispatcher.domain.states import State, terminal_event_state
from llmbatch.dispatcher.domain.usage import metric_tenant
from llmbatch.dispatcher.errors import (
    DispatcherError,
    KafkaUnavailable,
    Misconfiguration,
    RecordTooLarge,
    classify,
    classify_kafka_start,
)
from llmbatch.dispatcher.kafka.request_body import RequestBodies
from llmbatch.dispatcher.metrics import Metrics
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.schemas.cloudevents import Envelope, encode
from llmbatch.settings import KafkaSettings

log = logging.getLogger(__name__)

SendFuture = Awaitable[Any]
SCAN_PENDING = 2000  # unpublished entries read per pass when only some shards' are this replica's


class EventProducer:
    """Two aiokafka producers (acks=all): an idempotent one for the results topic, and one for the
    dead-letter topic that is not idempotent, because a record the broker refuses as too large would
    leave an idempotent producer failing every later send to that partition (OutOfOrderSequenceNumber).
    Dead letters are at-least-once anyway (a redelivered record is dead-lettered again)."""

    def __init__(self, kafka: KafkaSettings, metrics: Metrics | None = None, *, linger_ms: int = 5) -> None:
        self.kafka = kafka
        self.metrics = metrics or Metrics()
        self.dead_letter_max_bytes = kafka.topics.dead_letter_max_message_bytes
        self._producer = AIOKafkaProducer(
            acks="all",
            enable_idempotence=True,
            linger_ms=linger_ms,
            max_request_size=kafka.topics.max_message_bytes,
            **kafka.client_kwargs(),
        )
        self._dlt_producer = AIOKafkaProducer(
            acks="all",
            enable_idempotence=False,
            linger_ms=linger_ms,
            max_request_size=self.dead_letter_max_bytes,
            **kafka.client_kwargs(),
        )
        self._started: list[AIOKafkaProducer] = []

    async def start(self) -> None:
        for producer in (self._producer, self._dlt_producer):
            if producer in self._started:
                continue
            try:
                await producer.start()
            except Exception as exc:
                raise await classify_kafka_start(exc, self.kafka) from exc
            self._started.append(producer)

    async def stop(self) -> None:
        """Stop both producers, started or not (one never started still holds a client to close)."""
        self._started = []
        for producer in (self._producer, self._dlt_producer):
            try:
                await producer.stop()
            except Exception:
                log.warning("producer stop failed", exc_info=True)

    async def _send(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | None,
        headers: list[tuple[str, bytes]],
        *,
        producer: AIOKafkaProducer | None = None,
    ) -> SendFuture:
        try:
            fut = await (producer or self._producer).send(topic, value=value, key=key, headers=headers)
        except Exception as exc:
            raise classify(exc, default=KafkaUnavailable) from exc

        async def wait() -> Any:
            try:
                return await fut
            except Exception as exc:
                raise classify(exc, default=KafkaUnavailable) from exc

        return wait()

    async def send_event(self, topic: str, envelope: Envelope[Any]) -> SendFuture:
        """Queue ``envelope``; await the returned awaitable for the broker's acknowledgement."""
        key, value, headers = encode(envelope)
        fut = await self._send(topic, value, key, headers)
        self.metrics.published.labels(type=envelope.type.value).inc()
        return fut

    async def send_dead_letter(self, letter: DeadLetter) -> SendFuture:
        """Queue ``letter``; await the returned awaitable for the broker's acknowledgement.

        A letter over the dead-letter topic's ``max.message.bytes`` (the setting) is sent reduced
        (:func:`~llmbatch.dispatcher.domain.dlt.reduce_dead_letter`), and so is one the producer or the broker
        refuses
        as too large (a topic created with a smaller limit than the setting)."""
        fitted = fit_dead_letter(letter, self.dead_letter_max_bytes)
        try:
            fut = await self._send_letter(fitted)
        except RecordTooLarge:
            if fitted.reduced:
                raise
            fitted = reduce_dead_letter(letter)
            fut = await self._send_letter(fitted)
        self.metrics.dead_lettered.labels(reason=letter.reason).inc()
        if fitted.reduced:
            self._reduced(letter, "over the dead-letter topic's max_message_bytes")

        async def wait() -> Any:
            try:
                return await fut
            except RecordTooLarge:
                if fitted.reduced:
                    raise
                self._reduced(letter, "refused by the broker as too large")
                return await (await self._send_letter(reduce_dead_letter(letter)))

        return wait()

    async def _send_letter(self, letter: DeadLetter) -> SendFuture:
        # a record with neither key nor value (any client but this one may write it) is dead-lettered
        # with an empty value: a Kafka producer here cannot write the null pair back
        value = b"" if letter.key is None and letter.value is None else letter.value
        return await self._send(letter.topic, value, letter.key, letter.headers, producer=self._dlt_producer)

    def _reduced(self, letter: DeadLetter, why: str) -> None:
        self.metrics.dead_letters_reduced.inc()
        origin = letter.original
        log.warning(
            "dead letter reduced: value left out, pointer to the original record kept",
            extra={
                "why": why,
                "reason": letter.reason,
                "size": letter.size,
                "limit": self.dead_letter_max_bytes,
                "original": f"{origin.topic}:{origin.partition}:{origin.offset}",
            },
        )

    async def publish(self, topic: str, envelope: Envelope[Any]) -> None:
        await (await self.send_event(topic, envelope))

    async def dead_letter(self, letter: DeadLetter) -> Any:
        """Write ``letter`` and wait for the broker; returns its ``RecordMetadata``."""
        return await (await self.send_dead_letter(letter))

    async def ping(self) -> bool:
        try:
            await self._producer.client.fetch_all_metadata()
            return True
        except Exception:
            return False


def late_dead_letter(
    record: BatchRecord, outcome: Outcome, *, dlt_topic: str, group_id: str, value: str | None = None
) -> DeadLetter:
    """The dead letter of an accepted batch that failed for good (e.g. ``attempts_exhausted``).
    ``value`` is the request body when Redis did not keep it (:mod:`llmbatch.dispatcher.kafka.request_body`);
    a body
    found nowhere gives a reduced letter, whose headers point at the original record."""
    body = record.get("request") if value is None else value
    origin = original_with_value(record.get("origin") or "{}", body)
    message = f"{outcome.error_code or 'failed'}: {outcome.error_message or ''}".strip()
    letter = build_dead_letter(
        origin,
        dlt_topic=dlt_topic,
        reason=outcome.dlt_reason or "internal_error",
        group_id=group_id,
        fqcn="llmbatch.dispatcher.errors.BatchFailed",
        message=message,
    )
    if body is None:  # found nowhere: the letter points at the original record
        size = record.get("request_bytes")
        return reduce_dead_letter(
            letter,
            value_bytes=int(size) if size and size.isdigit() else None,
            value_sha256=record.get("request_sha256"),
        )
    return letter


OUTAGE_IN_A_ROW = 3
"""Batches in a row whose event an outage kept from going out before a publish pass gives up."""


_PUBLISHED_HERE = frozenset({State.COMPLETED, State.FAILED, State.CANCELLED, State.EXPIRED})


def _pending(record: BatchRecord) -> bool:
    return record.state in _PUBLISHED_HERE and not record.flag("published")


class TerminalPublisher:
    """Publishes the terminal event (and due dead letter) of every unpublished terminal batch."""

    def __init__(
        self,
        store: StateStore,
        producer: EventProducer,
        *,
        results_topic: str,
        dlt_topic: str,
        group_id: str,
        source: str,
        metrics: Metrics,
        crash: Callable[[str], None] = lambda point: None,
        after_publish: Callable[[BatchRecord], Awaitable[None]] | None = None,
        bodies: RequestBodies | None = None,
        known_tenants: frozenset[str] = frozenset({"default"}),
    ) -> None:
        self.after_publish = after_publish
        self.known_tenants = known_tenants
        self.bodies = bodies
        self.store = store
        self.producer = producer
        self.results_topic = results_topic
        self.dlt_topic = dlt_topic
        self.group_id = group_id
        self.source = source
        self.metrics = metrics
        self.crash = crash

    async def publish_pending(self, limit: int = 200, *, keep: Callable[[str], bool] | None = None) -> int:
        """Publish what is pending (``keep``: only the batches it keeps, this replica's shards');
        returns how many terminal events were published.

        Entries of batches that are gone or published already are removed from the index; a batch
        whose event cannot go out (a bad record, or an error of its own) goes to the back of the
        index, so it never holds back the ones behind it. Only an outage met by
        ``OUTAGE_IN_A_ROW`` batches in a row ends the pass early (the next tick tries again).
        Filtered by ``keep``, up to :data:`SCAN_PENDING` entries are read to find ``limit`` of its own:
        the entries of a shard whose holder died wait at the head only until its lease moves."""
        if keep is None:
            ids = await self.store.unpublished_ids(limit)
        else:
            ids = [k for k in await self.store.unpublished_ids(max(limit, SCAN_PENDING)) if keep(k)][:limit]
        records = await self.store.get_many(ids)
        stale = [key for key, r in zip(ids, records, strict=True) if r is None or not _pending(r)]
        if stale:
            await self.store.drop_orphans("unpublished", stale)
        published = outage = 0
        for record in records:
            if record is None or not _pending(record):
                continue
            with logs.bind(
                batch_id=record.batch_id,
                tenant=record.tenant,
                attempt=record.attempt,
                trace_id=logs.trace_id_of(record.get("traceparent")),
            ):
                try:
                    await self.publish_one(record)
                    published += 1
                    outage = 0
                    if self.after_publish is not None:
                        await self.after_publish(record)
                except DispatcherError as exc:
                    await self._later(record)
                    if exc.retriable or isinstance(exc, Misconfiguration):  # not this batch's fault
                        outage += 1
                        if outage >= OUTAGE_IN_A_ROW:
                            raise  # the broker or Redis is down: the next tick tries again
                        continue
                    log.error("cannot publish terminal event", extra={"error": str(exc)})
                except Exception:  # a bad record must not hold back the others
                    log.exception("cannot build or publish terminal event")
                    await self._later(record)
        return published

    async def _later(self, record: BatchRecord) -> None:
        with contextlib.suppress(DispatcherError):  # an outage of Redis: it stays where it is
            await self.store.requeue_unpublished(record.key)

    async def publish_one(self, record: BatchRecord) -> None:
        event_id = record.get("terminal_event_id") or ""
        outcome = Outcome.from_json(record.get("outcome") or "{}")
        if record.flag("dlt_pending") and not record.flag("dlt_written"):
            value = None
            if record.get("request") is None and self.bodies is not None:
                value = await self.bodies.value(record)
            letter = late_dead_letter(
                record, outcome, dlt_topic=self.dlt_topic, group_id=self.group_id, value=value
            )
            if await self._write_dead_letter(letter):
                self.crash("after_dlt")
                await self.store.mark_dlt_written(record.key, event_id)
        envelope = build_terminal(record, source=self.source)
        await self.producer.publish(self.results_topic, envelope)
        self.crash("after_publish")
        marked = await self.store.mark_published(record.key, event_id, ended_at=outcome.finished_at)
        status = terminal_event_state(record.state).value
        if marked is None:  # the event is out; the batch moved on (or went) before it could be marked
            log.warning(
                "terminal event published, but the batch no longer has it as its terminal event: "
                "not marked, its usage not counted",
                extra={"status": status, "event_id": event_id},
            )
            return
        if marked == "counted":
            tenant = metric_tenant(record.tenant, self.known_tenants)
            self.metrics.usage(tenant, record.get("model") or "", status, outcome.counts, outcome.usage)
        started = outcome.started_at
        if started is not None:
            self.metrics.job_duration.labels(status=status).observe(max(0.0, outcome.finished_at - started))
        log.info("terminal event published", extra={"status": status, "event_id": event_id})

    async def _write_dead_letter(self, letter: DeadLetter) -> bool:
        """Write the batch's dead letter (reduced when too large). ``False`` when even the reduced
        letter fails for good: the terminal event goes out regardless (upstream must hear that the
        batch ended; the dead letter is for operators), and the failure is logged and counted.
        Transient errors raise (the next tick tries again)."""
        error: DispatcherError | None = None
        for candidate in (letter, reduce_dead_letter(letter)):
            try:
                await self.producer.dead_letter(candidate)
            except DispatcherError as exc:
                if exc.retriable:
                    raise
                error = exc
                continue
            log.info("dead letter written", extra={"reason": letter.reason, "reduced": candidate.reduced})
            return True
        self.metrics.dead_letters_failed.labels(stage="terminal").inc()
        log.error(
            "dead letter not written, publishing the terminal event without it",
            extra={"reason": letter.reason, "error": str(error)},
        )
        return False


async def gather_sends(futures: list[SendFuture]) -> list[Any]:
    """Await broker acknowledgements (aiokafka ``RecordMetadata``, in order); raise the first error
    after all have settled."""
    if not futures:
        return []
    results = await asyncio.gather(*futures, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results
