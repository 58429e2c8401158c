"""Kafka producer side: result events, dead letters, and the idempotent terminal-event protocol.

Terminal events are published by :meth:`TerminalPublisher.publish_pending`: for each batch that
reached a terminal state and is not yet marked ``published``, it first writes the batch's dead
letter if one is due (then records ``dlt_written``), then publishes the terminal event whose
``ce_id`` was fixed when the terminal state was recorded, and only then records ``published``.
A crash in between republishes the SAME event id; consumers drop the duplicate.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiokafka import AIOKafkaProducer

from dispatcher import logs
from dispatcher.dlt import DeadLetter, build_dead_letter
from dispatcher.errors import BrokerUnavailable, DispatcherError, classify
from dispatcher.events import Outcome, build_terminal
from dispatcher.intake import original_with_value
from dispatcher.metrics import Metrics
from dispatcher.states import State, terminal_event_state
from dispatcher.store import BatchRecord, StateStore
from llmbatch.settings import KafkaSettings
from schemas.cloudevents import Envelope, encode

log = logging.getLogger(__name__)

SendFuture = Awaitable[Any]


class EventProducer:
    """An idempotent aiokafka producer (acks=all) for the results and dead-letter topics."""

    def __init__(
        self,
        kafka: KafkaSettings,
        metrics: Metrics | None = None,
        *,
        linger_ms: int = 5,
        max_request_size: int = 16 << 20,
    ) -> None:
        self.kafka = kafka
        self.metrics = metrics or Metrics()
        self._producer = AIOKafkaProducer(
            acks="all",
            enable_idempotence=True,
            linger_ms=linger_ms,
            max_request_size=max_request_size,
            **kafka.client_kwargs(),
        )
        self._started = False

    async def start(self) -> None:
        try:
            await self._producer.start()
        except Exception as exc:
            raise classify(exc, default=BrokerUnavailable) from exc
        self._started = True

    async def stop(self) -> None:
        if self._started:
            self._started = False
            try:
                await self._producer.stop()
            except Exception:
                log.warning("producer stop failed", exc_info=True)

    async def _send(
        self, topic: str, value: bytes | None, key: bytes | None, headers: list[tuple[str, bytes]]
    ) -> SendFuture:
        try:
            fut = await self._producer.send(topic, value=value, key=key, headers=headers)
        except Exception as exc:
            raise classify(exc, default=BrokerUnavailable) from exc

        async def wait() -> Any:
            try:
                return await fut
            except Exception as exc:
                raise classify(exc, default=BrokerUnavailable) from exc

        return wait()

    async def send_event(self, topic: str, envelope: Envelope[Any]) -> SendFuture:
        """Queue ``envelope``; await the returned awaitable for the broker's acknowledgement."""
        key, value, headers = encode(envelope)
        fut = await self._send(topic, value, key, headers)
        self.metrics.published.labels(type=envelope.type.value).inc()
        return fut

    async def send_dead_letter(self, letter: DeadLetter) -> SendFuture:
        fut = await self._send(letter.topic, letter.value, letter.key, letter.headers)
        self.metrics.dead_lettered.labels(reason=letter.reason).inc()
        return fut

    async def publish(self, topic: str, envelope: Envelope[Any]) -> None:
        await (await self.send_event(topic, envelope))

    async def dead_letter(self, letter: DeadLetter) -> None:
        await (await self.send_dead_letter(letter))

    async def ping(self) -> bool:
        try:
            await self._producer.client.fetch_all_metadata()
            return True
        except Exception:
            return False


def late_dead_letter(record: BatchRecord, outcome: Outcome, *, dlt_topic: str, group_id: str) -> DeadLetter:
    """The dead letter of an accepted batch that failed for good (e.g. ``attempts_exhausted``)."""
    origin = original_with_value(record.get("origin") or "{}", record.get("request"))
    message = f"{outcome.error_code or 'failed'}: {outcome.error_message or ''}".strip()
    return build_dead_letter(
        origin,
        dlt_topic=dlt_topic,
        reason=outcome.dlt_reason or "internal_error",
        group_id=group_id,
        fqcn="dispatcher.errors.BatchFailed",
        message=message,
    )


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
    ) -> None:
        self.store = store
        self.producer = producer
        self.results_topic = results_topic
        self.dlt_topic = dlt_topic
        self.group_id = group_id
        self.source = source
        self.metrics = metrics
        self.crash = crash

    async def publish_pending(self, limit: int = 200) -> int:
        """Publish what is pending; returns how many terminal events were published."""
        ids = await self.store.unpublished_ids(limit)
        published = 0
        for record in await self.store.get_many(ids):
            if (
                record is None
                or record.state not in {State.COMPLETED, State.FAILED, State.CANCELLED, State.EXPIRED}
                or record.flag("published")
            ):
                continue
            with logs.bind(
                batch_id=record.batch_id,
                attempt=record.attempt,
                trace_id=logs.trace_id_of(record.get("traceparent")),
            ):
                try:
                    await self.publish_one(record)
                    published += 1
                except DispatcherError as exc:
                    if exc.retriable:
                        raise  # the broker or Redis is down: the next tick tries again
                    log.error("cannot publish terminal event", extra={"error": str(exc)})
                except Exception:  # a bad record must not hold back the others
                    log.exception("cannot build or publish terminal event")
        return published

    async def publish_one(self, record: BatchRecord) -> None:
        event_id = record.get("terminal_event_id") or ""
        outcome = Outcome.from_json(record.get("outcome") or "{}")
        if record.flag("dlt_pending") and not record.flag("dlt_written"):
            letter = late_dead_letter(record, outcome, dlt_topic=self.dlt_topic, group_id=self.group_id)
            await self.producer.dead_letter(letter)
            log.info("dead letter written", extra={"reason": letter.reason})
            self.crash("after_dlt")
            await self.store.mark_dlt_written(record.batch_id, event_id)
        envelope = build_terminal(record, source=self.source)
        await self.producer.publish(self.results_topic, envelope)
        self.crash("after_publish")
        await self.store.mark_published(record.batch_id, event_id)
        status = terminal_event_state(record.state).value
        started = outcome.started_at
        if started is not None:
            self.metrics.job_duration.labels(status=status).observe(max(0.0, outcome.finished_at - started))
        log.info("terminal event published", extra={"status": status, "event_id": event_id})


async def gather_sends(futures: list[SendFuture]) -> None:
    """Await broker acknowledgements; raise the first error after all have settled."""
    if not futures:
        return
    results = await asyncio.gather(*futures, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
