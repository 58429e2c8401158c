"""The requests-topic consumer: read, validate, record durably, then commit.

For each fetched batch of records the consumer

1. classifies every record (:func:`dispatcher.intake.classify`, pure): accept, cancel or reject;
2. applies them in record order, in segments (a cancel ends a segment): intake scripts pipelined
   into Redis, then the ``accepted`` events and dead letters, awaited until the broker acknowledged;
3. commits the offsets of what is done.

A transient failure (Redis, broker) retries the same segment with backoff; everything it does is
idempotent (batch-id dedupe, event-id markers), so a retry or a redelivery after a crash is
harmless. Nothing is committed before its effects are durable. When the queue in Redis is full the
consumer pauses its partitions (backpressure) and resumes when it drains. A rebalance listener
commits the done offsets of revoked partitions; processing of a revoked partition is abandoned.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition

from dispatcher import logs
from dispatcher.dlt import OriginalRecord
from dispatcher.errors import BrokerUnavailable, DispatcherError, TransientError, classify
from dispatcher.events import Outcome, build_accepted, terminal_fields
from dispatcher.intake import Accept, Cancel, Command, IntakeRules, Reject
from dispatcher.intake import classify as classify_record
from dispatcher.metrics import Metrics
from dispatcher.publisher import EventProducer, SendFuture, gather_sends
from dispatcher.retry import Backoff
from dispatcher.scheduler import Backpressure
from dispatcher.settings import DispatcherSettings
from dispatcher.states import State
from dispatcher.store import BatchRecord, StateStore
from schemas.cloudevents import peek_type

log = logging.getLogger(__name__)
T = TypeVar("T")


class Abandoned(Exception):
    """Processing stopped: shutdown, or the partition was revoked meanwhile."""


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
    ) -> None:
        self.settings = settings
        self.opts = settings.dispatcher
        self.store = store
        self.producer = producer
        self.metrics = metrics
        self.crash = crash
        self.clock = clock
        topics = settings.kafka.topics
        self.rules = IntakeRules(
            requests_topic=topics.requests,
            dlt_topic=topics.dead_letter,
            group_id=self.opts.group_id,
            served_models=settings.served_models,
            inline_limits=self.opts.inline_limits,
            readable_buckets=frozenset(settings.s3.readable_buckets()),
        )
        self.backoff: Backoff = self.opts.io_backoff
        self.backpressure = Backpressure(self.opts.max_queued, self.opts.resume_ratio)
        self._consumer: AIOKafkaConsumer | None = None
        self._done: dict[TopicPartition, int] = {}  # next offset to commit, effects durable
        self._lock = asyncio.Lock()
        self._epoch = 0
        self._stopping = asyncio.Event()
        self._assigned: set[TopicPartition] = set()
        self.last_progress = time.monotonic()
        self.accepted_total = 0
        self._lag_at = 0.0
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
            **self.settings.kafka.client_kwargs(),
        )
        self._consumer.subscribe([self.settings.kafka.topics.requests], listener=_Listener(self))
        try:
            await self._consumer.start()
        except Exception as exc:
            raise classify(exc, default=BrokerUnavailable) from exc

    def request_stop(self) -> None:
        self._stopping.set()

    async def stop(self) -> None:
        """Commit what is done and leave the group (partitions go to the other replicas)."""
        self._stopping.set()
        if self._consumer is None:
            return
        async with self._lock:
            await self._commit()
        with contextlib.suppress(Exception):
            await self._consumer.stop()
        self._consumer = None

    @property
    def assignment(self) -> set[TopicPartition]:
        return set(self._consumer.assignment()) if self._consumer is not None else set()

    # -- rebalance ---------------------------------------------------------------------------------
    def on_assigned(self, assigned: set[TopicPartition]) -> None:
        self._assigned = set(assigned)
        log.info("partitions assigned", extra={"partitions": sorted(tp.partition for tp in assigned)})

    async def on_revoked(self, revoked: set[TopicPartition]) -> None:
        self._epoch += 1  # in-flight processing of these partitions stops retrying
        try:
            await asyncio.wait_for(
                self._lock.acquire(), timeout=max(1.0, self.opts.session_timeout_ms / 2000)
            )
        except TimeoutError:
            await self._commit(only=revoked)
        else:
            try:
                await self._commit(only=revoked)
            finally:
                self._lock.release()
        for tp in revoked:
            self._done.pop(tp, None)
        log.info("partitions revoked", extra={"partitions": sorted(tp.partition for tp in revoked)})

    async def _commit(self, only: set[TopicPartition] | None = None) -> None:
        if self._consumer is None or not self._done:
            return
        offsets = {tp: off for tp, off in self._done.items() if only is None or tp in only}
        if not offsets:
            return
        try:
            await self._consumer.commit(offsets)
            self.metrics.commits.labels(result="ok").inc()
            for tp, off in offsets.items():
                if self._done.get(tp) == off:
                    del self._done[tp]
        except Exception as exc:
            # a rebalance took the partitions: the new owner re-reads them, all effects are idempotent
            self.metrics.commits.labels(result="failed").inc()
            log.warning("offset commit failed", extra={"error": f"{type(exc).__name__}: {exc}"})

    # -- main loop ---------------------------------------------------------------------------------
    async def run(self) -> None:
        assert self._consumer is not None, "start() first"
        consumer = self._consumer
        while not self._stopping.is_set():
            self.last_progress = time.monotonic()
            paused = await self._apply_backpressure(consumer)
            try:
                batch = await consumer.getmany(
                    timeout_ms=200 if paused else 500, max_records=self.opts.max_poll_records
                )
            except Exception as exc:
                err = classify(exc, default=BrokerUnavailable)
                self.metrics.transient_errors.labels(component="kafka").inc()
                log.warning("fetch failed", extra={"error": str(err)})
                await self._sleep(self.backoff.delay(1))
                continue
            if batch:
                async with self._lock:
                    with contextlib.suppress(Abandoned):
                        await self.process(batch)
                    await self._commit()
            await self._update_lag(consumer)

    async def _apply_backpressure(self, consumer: AIOKafkaConsumer) -> bool:
        try:
            queued = await self.store.queued_count()
        except DispatcherError:
            self.metrics.transient_errors.labels(component="redis").inc()
            return self.backpressure.paused
        was = self.backpressure.paused
        paused = self.backpressure.update(queued)
        assignment = consumer.assignment()
        if paused:
            consumer.pause(*assignment)
        elif assignment:
            consumer.resume(*assignment)
        if paused != was:
            log.info("partitions paused" if paused else "partitions resumed", extra={"queued": queued})
        self.metrics.paused.set(1 if paused else 0)
        return paused

    async def _update_lag(self, consumer: AIOKafkaConsumer) -> None:
        now = time.monotonic()
        if now - self._lag_at < 5:
            return
        self._lag_at = now
        for tp in consumer.assignment():
            with contextlib.suppress(Exception):
                high = consumer.highwater(tp)
                if high is not None:
                    position = await consumer.position(tp)
                    self.metrics.consumer_lag.labels(partition=str(tp.partition)).set(max(0, high - position))

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    async def _retrying(self, what: str, fn: Callable[[], Awaitable[T]], epoch: int) -> T:
        """Run ``fn`` until it succeeds; transient errors back off, nothing is skipped."""
        failures = 0
        while True:
            if self._stopping.is_set() or epoch != self._epoch:
                raise Abandoned(what)
            try:
                return await fn()
            except DispatcherError as exc:
                if not exc.retriable:
                    raise
                failures += 1
                component = "redis" if exc.code == "redis_unavailable" else "kafka"
                self.metrics.transient_errors.labels(component=component).inc()
                delay = self.backoff.delay(failures)
                log.warning(
                    "transient failure, retrying",
                    extra={"what": what, "error": str(exc), "retry_in_s": round(delay, 2)},
                )
                await self._sleep(delay)

    # -- processing --------------------------------------------------------------------------------
    async def process(self, batch: dict[TopicPartition, list[Any]]) -> None:
        """Apply a fetched batch in record order; marks offsets done segment by segment."""
        epoch = self._epoch
        fetched_at = self.clock()
        now = self.clock()
        entries: list[tuple[TopicPartition, int, Command, float | None]] = []
        received: dict[str, int] = {}
        for tp, records in batch.items():
            for record in records:
                label = _type_label(record.headers)
                received[label] = received.get(label, 0) + 1
                origin = OriginalRecord.from_consumer_record(record)
                entries.append((tp, record.offset, classify_record(origin, self.rules, now), None))
        for label, count in received.items():
            self.metrics.received.labels(type=label).inc(count)
        segment: list[tuple[TopicPartition, int, Command, float | None]] = []
        for entry in entries:
            if isinstance(entry[2], Cancel):
                await self._run_segment(segment, epoch, fetched_at)
                segment = []
                cancel = entry[2]
                await self._retrying("cancel", lambda c=cancel: self._apply_cancel(c), epoch)  # type: ignore[misc]
                self._mark_done([entry])
            else:
                segment.append(entry)
        await self._run_segment(segment, epoch, fetched_at)

    def _mark_done(self, entries: Sequence[tuple[TopicPartition, int, Command, float | None]]) -> None:
        for tp, offset, _, _ in entries:
            if offset + 1 > self._done.get(tp, -1):
                self._done[tp] = offset + 1

    async def _run_segment(
        self, segment: list[tuple[TopicPartition, int, Command, float | None]], epoch: int, fetched_at: float
    ) -> None:
        if not segment:
            return
        commands = [entry[2] for entry in segment]
        await self._retrying("intake", lambda: self._apply_intake(commands), epoch)
        self._mark_done(segment)
        latency = self.clock() - fetched_at
        histogram = self.metrics.accept_latency
        for command in commands:
            if isinstance(command, Accept):
                histogram.observe(latency)

    async def _apply_intake(self, commands: Sequence[Command]) -> None:
        accepts = [c for c in commands if isinstance(c, Accept)]
        rejects = [c for c in commands if isinstance(c, Reject)]
        seen = await self.store.markers_exist([r.marker for r in rejects])
        already = {id(r) for r, exists in zip(rejects, seen, strict=True) if exists}
        results = await self.store.intake_many([a.item for a in accepts])
        self.crash("after_accept")
        sends: list[SendFuture] = []
        outcomes: Counter[str] = Counter()
        results_topic = self.settings.kafka.topics.results
        for accept, result in zip(accepts, results, strict=True):
            with logs.bind(batch_id=accept.item.batch_id, trace_id=logs.trace_id_of(accept.traceparent)):
                if result.is_new or (result.outcome == "dup_event" and result.state is State.QUEUED):
                    record = BatchRecord(
                        accept.item.batch_id,
                        State.QUEUED,
                        result.version,
                        {
                            **accept.item.fields,
                            "generation": str(result.generation),
                            "deadline": repr(accept.item.deadline or 0.0),
                            "replay_id": accept.item.replay_id or "",
                        },
                    )
                    sends.append(
                        await self.producer.send_event(
                            results_topic, build_accepted(record, source=self.opts.source)
                        )
                    )
                if result.is_new:
                    log.info(
                        "batch accepted",
                        extra={
                            "outcome": result.outcome,
                            "generation": result.generation,
                            "priority": accept.request.priority,
                        },
                    )
                else:
                    log.info(
                        "duplicate request ignored",
                        extra={
                            "outcome": result.outcome,
                            "state": result.state.value if result.state else None,
                        },
                    )
                outcomes[result.outcome if not result.is_new else "accepted"] += 1
        for reject in rejects:
            if id(reject) in already:
                self.metrics.processed.labels(outcome="duplicate_rejected").inc()
                continue
            sends.append(await self.producer.send_dead_letter(reject.dead_letter))
            log.warning(
                "record dead-lettered",
                extra={
                    "reason": reject.dead_letter.reason,
                    "error": str(reject.error)[:500],
                    "topic": reject.origin.topic,
                    "partition": reject.origin.partition,
                    "offset": reject.origin.offset,
                    "batch_id": reject.item.batch_id if reject.item else None,
                },
            )
            self.metrics.processed.labels(outcome="dead_lettered").inc()
        for outcome, count in outcomes.items():
            self.metrics.processed.labels(outcome=outcome).inc(count)
        await gather_sends(sends)
        fresh = [r for r in rejects if id(r) not in already]
        if fresh:
            await self.store.intake_many([r.item for r in fresh if r.item is not None])
            await self.store.set_markers([r.marker for r in fresh])
        accepted = sum(1 for r in results if r.is_new)
        self.accepted_total += accepted
        if accepted and self.on_accepted is not None:
            self.on_accepted()

    async def _apply_cancel(self, cancel: Cancel) -> None:
        with logs.bind(batch_id=cancel.batch_id, trace_id=logs.trace_id_of(cancel.traceparent)):
            if (await self.store.markers_exist([cancel.marker]))[0]:
                self.metrics.processed.labels(outcome="duplicate_cancel").inc()
                return
            for _ in range(20):
                record = await self.store.get(cancel.batch_id)
                if record is None or record.state.is_terminal:
                    log.info(
                        "cancel ignored: batch unknown or finished",
                        extra={"state": record.state.value if record else None},
                    )
                    self.metrics.processed.labels(outcome="cancel_ignored").inc()
                    break
                reason = cancel.request.reason or "cancel requested"
                if record.state in {State.ACCEPTED, State.QUEUED} and record.attempt == 0:
                    outcome = Outcome(
                        State.CANCELLED, self.clock(), counts={"total": int(record.get("total") or 0)}
                    )
                    result = await self.store.transition(
                        cancel.batch_id,
                        State.CANCELLED,
                        expected_version=record.version,
                        fields={
                            **terminal_fields(record, outcome),
                            "cancel_requested": "1",
                            "cancel_reason": reason,
                        },
                    )
                else:  # the tracker stops the job and reports partial results (a queued retry: at once)
                    result = await self.store.transition(
                        cancel.batch_id,
                        record.state,
                        expected_version=record.version,
                        from_states=[record.state],
                        fields={
                            "cancel_requested": "1",
                            "cancel_reason": reason,
                            "cancel_requested_at": repr(self.clock()),
                            "cancel_requested_by": cancel.request.requested_by or "",
                        },
                    )
                if result.ok:
                    log.info("cancel recorded", extra={"state": record.state.value})
                    self.metrics.processed.labels(outcome="cancel").inc()
                    break
            else:  # the batch kept changing under us: try the whole record again (nothing committed)
                raise TransientError(f"cancel of {cancel.batch_id}: state kept changing")
            await self.store.set_marker(cancel.marker)


def _type_label(headers: Any) -> str:
    value = peek_type(headers)
    if value is None:
        return "unreadable"
    return value if value.startswith("llmbatch.") and len(value) < 64 else "unknown"
