"""The requests-topic consumer: read, validate, record durably, then commit.

For each fetched batch of records the consumer

1. classifies every record (:func:`llmbatch.dispatcher.intake.commands.classify`, pure): accept, cancel or
   reject;
2. applies them in record order, in segments (a cancel ends a segment;
   :mod:`llmbatch.dispatcher.intake.intake_apply`):
   intake scripts pipelined into Redis, then the ``accepted`` events and dead letters, awaited until
   the broker acknowledged, then the ``rejected`` answers to every request that was not accepted and
   names a batch id (:mod:`llmbatch.dispatcher.intake.answers`: invalid, a batch id in use, or given up on);
3. commits the offsets of what is done (:mod:`llmbatch.dispatcher.intake.offsets`).

A transient failure (Redis, broker) retries the same segment with backoff, without limit; everything
it does is idempotent (batch-id dedupe, event-id markers), so a retry or a redelivery after a crash
is harmless. Nothing is committed before its effects are durable. Any other failure (a permanent
error such as Redis' ``OOM command not allowed``, or an unexpected exception) splits the segment
into single records, and a record that still fails ``record_max_attempts`` times is dead-lettered
(``processing_failed``), counted, logged, answered and passed (:mod:`llmbatch.dispatcher.intake.record_retry`,
:mod:`llmbatch.dispatcher.intake.failed_records`): one record never stops the consumer. When the queue in
Redis is full the consumer pauses its partitions (backpressure) and resumes when it drains; meanwhile
cancels behind the backlog still apply (:mod:`llmbatch.dispatcher.intake.fetch_flow`). A rebalance
listener commits the done offsets of revoked partitions; processing of a revoked partition is abandoned.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition

from llmbatch.dispatcher.domain.dlt import OriginalRecord
from llmbatch.dispatcher.domain.retry import Backoff
from llmbatch.dispatcher.domain.scheduler import Backpressure
from llmbatch.dispatcher.errors import KafkaUnavailable, classify, classify_kafka_start
from llmbatch.dispatcher.intake.cancel import apply_cancel
from llmbatch.dispatcher.intake.cancel_scan import CancelScanner
from llmbatch.dispatcher.intake.commands import Accept, Cancel, Command, IntakeRules, intake_rules
from llmbatch.dispatcher.intake.commands import classify as classify_record
from llmbatch.dispatcher.intake.failed_records import FailedRecords
from llmbatch.dispatcher.intake.fetch_flow import FetchFlow
from llmbatch.dispatcher.intake.intake_apply import IntakeApplier, SizeOf
from llmbatch.dispatcher.intake.offsets import DoneOffsets
from llmbatch.dispatcher.intake.record_retry import Abandoned, GaveUp, RecordRetry, describe
from llmbatch.dispatcher.kafka.publisher import EventProducer
from llmbatch.dispatcher.metrics import Metrics
from llmbatch.dispatcher.settings import DispatcherSettings
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.schemas.cloudevents import peek_type
from llmbatch.schemas.events import EventType

log = logging.getLogger(__name__)
Entry = tuple[TopicPartition, int, Command, float | None]

__all__ = ["Abandoned", "RequestConsumer"]


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, owner: RequestConsumer) -> None:
        self.owner = owner

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self.owner.on_revoked(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self.owner.on_assigned(assigned)


class RequestConsumer:
    def __init__(
        self,
        settings: DispatcherSettings,
        store: StateStore,
        producer: EventProducer,
        metrics: Metrics,
        *,
        crash: Callable[[str], None] = lambda point: None,
        clock: Callable[[], float] = time.time,
        size_of: SizeOf | None = None,
    ) -> None:
        self.settings = settings
        self.opts = settings.dispatcher
        self.store = store
        self.producer = producer
        self.metrics = metrics
        self.crash = crash
        self.clock = clock
        self.rules: IntakeRules = intake_rules(settings)
        self.applier = IntakeApplier(
            store,
            producer,
            metrics,
            results_topic=settings.kafka.topics.results,
            source=self.opts.source,
            clock=clock,
            crash=crash,
            rules=self.rules,
            size_of=size_of,
        )
        self.backoff: Backoff = self.opts.io_backoff
        self.backpressure = Backpressure(self.opts.max_queued, self.opts.resume_ratio)
        self.flow = FetchFlow(
            store,
            metrics,
            self.backpressure,
            CancelScanner(settings, store, self.rules, metrics, clock=clock),
        )
        self._consumer: AIOKafkaConsumer | None = None
        self.offsets = DoneOffsets(metrics)
        self._lock = asyncio.Lock()
        self._epoch = 0
        self._stopping = asyncio.Event()
        self.last_progress = time.monotonic()  # read by /livez: the loop or a retry moved then
        self.retry = RecordRetry(self.backoff, metrics, self._stopping, lambda: self._epoch, beat=self._beat)
        self.failed = FailedRecords(settings, self.retry, producer, metrics, self.rules, clock=clock)
        self.accepted_total = 0
        self._loop_failures = 0  # consecutive unexpected failures of process()
        self.on_accepted: Callable[[], None] | None = None  # e.g. wake the local tracker

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        opts = self.opts
        self._consumer = AIOKafkaConsumer(
            group_id=opts.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_poll_records=opts.max_poll_records,
            session_timeout_ms=opts.session_timeout_ms,
            heartbeat_interval_ms=opts.heartbeat_interval_ms,
            max_poll_interval_ms=opts.max_poll_interval_ms,
            isolation_level="read_committed",
            # a record up to the requests topic's max.message.bytes must fit one partition fetch
            max_partition_fetch_bytes=max(1 << 20, self.settings.kafka.topics.max_message_bytes),
            **self.settings.kafka.client_kwargs(),
        )
        self._consumer.subscribe([self.settings.kafka.topics.requests], listener=_Listener(self))
        try:
            await self._consumer.start()
        except Exception as exc:
            raise await classify_kafka_start(exc, self.settings.kafka) from exc

    def request_stop(self) -> None:
        self._stopping.set()

    async def stop(self) -> None:
        """Commit what is done and leave the group (partitions go to the other replicas)."""
        self._stopping.set()
        if self._consumer is None:
            return
        async with self._lock:
            await self.offsets.commit(self._consumer)
        with contextlib.suppress(Exception):
            await self._consumer.stop()
        self._consumer = None

    @property
    def assignment(self) -> set[TopicPartition]:
        return set(self._consumer.assignment()) if self._consumer is not None else set()

    # -- rebalance ---------------------------------------------------------------------------------
    def on_assigned(self, assigned: set[TopicPartition]) -> None:
        self.offsets.assigned = set(assigned)
        log.info("partitions assigned", extra={"partitions": sorted(tp.partition for tp in assigned)})

    async def on_revoked(self, revoked: set[TopicPartition]) -> None:
        self._epoch += 1  # in-flight processing of these partitions stops retrying
        self.offsets.assigned -= set(revoked)  # a segment still in hand may not mark them done any more
        try:
            await asyncio.wait_for(
                self._lock.acquire(), timeout=max(1.0, self.opts.session_timeout_ms / 2000)
            )
        except TimeoutError:
            await self.offsets.commit(self._consumer, only=revoked)
        else:
            try:
                await self.offsets.commit(self._consumer, only=revoked)
            finally:
                self._lock.release()
        self.offsets.forget(revoked)
        log.info("partitions revoked", extra={"partitions": sorted(tp.partition for tp in revoked)})

    # -- main loop ---------------------------------------------------------------------------------
    async def run(self) -> None:
        assert self._consumer is not None, "start() first"
        consumer = self._consumer
        while not self._stopping.is_set():
            self.last_progress = time.monotonic()
            paused = await self.flow.before_fetch(consumer)
            try:
                batch = await consumer.getmany(
                    timeout_ms=200 if paused else 500, max_records=self.opts.max_poll_records
                )
            except Exception as exc:
                err = classify(exc, default=KafkaUnavailable)
                self.metrics.transient_errors.labels(component="kafka").inc()
                log.warning("fetch failed", extra={"error": str(err)})
                await self._sleep(self.backoff.delay(1))
                continue
            if batch:
                async with self._lock:
                    await self._process_or_rewind(consumer, batch)
                    await self.offsets.commit(self._consumer)
            await self.flow.update_lag(consumer)

    async def _process_or_rewind(
        self, consumer: AIOKafkaConsumer, batch: dict[TopicPartition, list[Any]]
    ) -> None:
        """:meth:`process`; should it fail unexpectedly (a bug: every record's own failure is handled
        inside), what it had not finished is read again after a backoff, neither committed nor lost,
        and the consumer goes on."""
        try:
            await self.process(batch)
        except Abandoned:
            return
        except Exception:
            self._loop_failures += 1
            self.metrics.loop_errors.labels(loop="consumer").inc()
            log.exception(
                "processing fetched records failed; reading the unfinished ones again",
                extra={"failures": self._loop_failures},
            )
            assignment = consumer.assignment()
            for tp, records in batch.items():
                if records and tp in assignment:
                    first = records[0].offset
                    consumer.seek(tp, self.offsets.resume_at(tp, first))
            await self._sleep(self.backoff.delay(self._loop_failures))
        else:
            self._loop_failures = 0

    def _beat(self) -> None:
        self.last_progress = time.monotonic()

    async def _sleep(self, seconds: float) -> None:
        await self.retry.sleep(seconds)

    # -- processing --------------------------------------------------------------------------------
    async def process(self, batch: dict[TopicPartition, list[Any]]) -> None:
        """Apply a fetched batch in record order; marks offsets done segment by segment."""
        epoch = self._epoch
        fetched_at = self.clock()
        now = self.clock()
        entries: list[Entry] = []
        received: dict[str, int] = {}
        for tp, records in batch.items():
            for record in records:
                label = _type_label(record.headers)
                received[label] = received.get(label, 0) + 1
                origin = OriginalRecord.from_consumer_record(record)
                entries.append((tp, record.offset, classify_record(origin, self.rules, now), None))
        for label, count in received.items():
            self.metrics.received.labels(type=label).inc(count)
        segment: list[Entry] = []
        for entry in entries:
            if isinstance(entry[2], Cancel):
                await self._run_segment(segment, epoch, fetched_at)
                segment = []
                await self._run_cancel(entry, entry[2], epoch)
            else:
                segment.append(entry)
        await self._run_segment(segment, epoch, fetched_at)

    def _mark_done(self, entries: Sequence[Entry]) -> None:
        self.offsets.mark((tp, offset) for tp, offset, _, _ in entries)

    async def _run_cancel(self, entry: Entry, cancel: Cancel, epoch: int) -> None:
        try:
            await self.retry.run(
                "cancel",
                lambda: apply_cancel(self.store, self.metrics, cancel, self.clock),
                epoch,
                max_attempts=self.opts.record_max_attempts,
            )
        except GaveUp as failed:
            await self.failed.give_up(entry[2], failed, epoch)
        self._mark_done([entry])

    async def _run_segment(self, segment: list[Entry], epoch: int, fetched_at: float) -> None:
        """Apply ``segment`` (records without a cancel) at once; if that fails for another reason
        than an outage, apply its records one by one, so only a failing record is given up on."""
        if not segment:
            return
        commands = [entry[2] for entry in segment]
        single = len(segment) == 1
        try:
            await self.retry.run(
                "intake",
                lambda: self._apply(commands),
                epoch,
                max_attempts=self.opts.record_max_attempts if single else 1,
            )
        except GaveUp as failed:
            if not single:
                log.warning(
                    "intake failed, retrying the records one by one",
                    extra={"records": len(segment), "error": describe(failed.error)},
                )
                for entry in segment:
                    await self._run_segment([entry], epoch, fetched_at)
                return
            await self.failed.give_up(segment[0][2], failed, epoch)
            self._mark_done(segment)
            return
        self._mark_done(segment)
        latency = self.clock() - fetched_at
        histogram = self.metrics.accept_latency
        for command in commands:
            if isinstance(command, Accept):
                histogram.observe(latency)

    async def _apply(self, commands: Sequence[Command]) -> None:
        accepted = await self.applier.apply(commands)
        self.accepted_total += accepted
        if accepted and self.on_accepted is not None:
            self.on_accepted()


def _type_label(headers: Any) -> str:
    value = peek_type(headers)
    if value is None:
        return "unreadable"
    # a closed set of labels: a series per type a producer makes up would grow without bound
    return value if value in EventType._value2member_map_ else "unknown"
