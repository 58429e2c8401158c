"""Reconcile pass: accepted batches whose state Redis lost are taken in again.

The consumer commits a request's offset only after Redis acknowledged the intake and ``accepted``
is on the results topic, and Redis runs with ``appendfsync always`` (the local stack, compose and
the Kubernetes manifests set it), so an acknowledged intake survives a Redis crash. What is lost
anyway (a disk that dies, a failover to a replica that lagged, a flush by mistake) is found here:
the results topic says which batches were accepted and have not ended; one of those without a
record in Redis is read again from the requests topic (its ``accepted`` event names the record) and
taken in as it was: the same lifecycle (fixed by the record), acceptance time and deadline. It then
runs (a Ray job of its lifecycle that is still there is picked up by its submission id) and ends in
one terminal event, with the id it would have had. A batch whose request record has left the topic too
is taken in from its ``accepted`` event alone, marked ``request_gone``: it fails at launch with that
code (:mod:`llmbatch.dispatcher.kafka.request_body`), so it still ends in one terminal event and a dead
letter.
Ray jobs and manifests never exist without an ``accepted`` event (it is sent before the state is
written), so finding batches from these events finds them all.

**A published answer is final.** The same read finds, for each batch, the terminal event its last
lifecycle got. A record that Redis lost writes of (a failover to a lagging replica, a restore of an
older snapshot) shows that lifecycle running again, or ended another way and not yet published: the
pass records the published outcome instead (through the state machine's own transitions, marked
published), so the batch never gets a second, different terminal event. Ids say which lifecycle an
event is of (:func:`~llmbatch.dispatcher.domain.events.published_state`).

The tracker leader runs a pass when it becomes leader and every ``reconcile_interval_s``. Memory is
bounded by the batches accepted within ``reconcile_lookback_s``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson

from llmbatch.dispatcher.domain.batch_record import BatchRecord, IntakeItem
from llmbatch.dispatcher.domain.dlt import OriginalRecord
from llmbatch.dispatcher.domain.events import Outcome, outcome_of_event, published_state, terminal_fields
from llmbatch.dispatcher.domain.keys import BatchKey, batch_key
from llmbatch.dispatcher.domain.scheduler import ready_score
from llmbatch.dispatcher.domain.states import State, is_terminal
from llmbatch.dispatcher.errors import KafkaUnavailable, classify
from llmbatch.dispatcher.intake.commands import Accept, IntakeRules
from llmbatch.dispatcher.intake.commands import classify as classify_record
from llmbatch.dispatcher.kafka.record_reader import RecordReader
from llmbatch.dispatcher.kafka.side_consumer import side_consumer
from llmbatch.dispatcher.metrics import Metrics
from llmbatch.dispatcher.settings import DispatcherSettings
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.schemas.cloudevents import Envelope, decode, peek_type
from llmbatch.schemas.errors import SchemaError
from llmbatch.schemas.events import TERMINAL_EVENT_TYPES, BatchAccepted, EventType, RecordRef

log = logging.getLogger(__name__)

_WANTED = frozenset({EventType.ACCEPTED.value, *(t.value for t in TERMINAL_EVENT_TYPES)})
_CHUNK = 500


@dataclass(frozen=True)
class Pending:
    """A batch accepted and not ended (as far as the results topic says)."""

    key: BatchKey
    request: RecordRef
    accepted_at: datetime
    accepted: BatchAccepted | None = None


def track(
    pending: dict[BatchKey, Pending],
    event: Envelope[Any],
    ended: dict[BatchKey, Envelope[Any]] | None = None,
) -> None:
    """Update ``pending`` (and ``ended``: each id's terminal event, when its latest lifecycle has
    one) with one event of the results topic (events of an id come in order: they share a
    partition). Pure."""
    data = event.data
    key = batch_key(event.tenant, event.batch_id)
    if isinstance(data, BatchAccepted):
        if ended is not None:
            ended.pop(key, None)
        if data.request is None:  # accepted before events named their request: nothing to re-read
            pending.pop(key, None)
        else:
            pending[key] = Pending(key, data.request, data.accepted_at, data)
    elif event.is_terminal:
        pending.pop(key, None)
        if ended is not None:
            ended[key] = event


def unfinished(events: Iterable[Envelope[Any]]) -> dict[BatchKey, Pending]:
    """The batches of ``events`` (the results topic, each partition in order) accepted and not
    ended: each id's latest ``accepted`` that no terminal event followed. Pure."""
    pending: dict[BatchKey, Pending] = {}
    for event in events:
        track(pending, event)
    return pending


# the transitions that lead a record from each non-terminal state to where a terminal state is allowed
_TO_FINALIZING = {
    State.ACCEPTED: (State.QUEUED, State.SUBMITTED, State.FINALIZING),
    State.QUEUED: (State.SUBMITTED, State.FINALIZING),
    State.SUBMITTED: (State.FINALIZING,),
    State.RUNNING: (State.FINALIZING,),
    State.FINALIZING: (),
}


class Reconciler:
    """Finds accepted batches without state and takes them in again (see the module docstring)."""

    def __init__(
        self,
        settings: DispatcherSettings,
        store: StateStore,
        rules: IntakeRules,
        metrics: Metrics,
        *,
        clock: Callable[[], float] = time.time,
        read_timeout_s: float = 30.0,
        reader: RecordReader | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.rules = rules
        self.metrics = metrics
        self.clock = clock
        self.reader = reader or RecordReader(settings.kafka, read_timeout_s=read_timeout_s)

    async def run_once(self) -> int:
        """One pass; returns how many batches were taken in again. Raises
        :class:`~llmbatch.dispatcher.errors.DispatcherError` when Kafka or Redis fails (the next pass
        retries)."""
        since = self.clock() - self.settings.dispatcher.reconcile_lookback_s
        ended: dict[BatchKey, Envelope[Any]] = {}
        pending = await self._unfinished_since(since, ended)
        await self._keep_published(ended)
        ids = list(pending)
        lost: list[Pending] = []
        for start in range(0, len(ids), _CHUNK):
            chunk = ids[start : start + _CHUNK]
            states = await self.store.states_many(chunk)
            lost += [pending[i] for i, state in zip(chunk, states, strict=True) if state is None]
        restored = 0
        for item in lost:
            restored += await self._restore(item)
        log.info(
            "reconcile pass done", extra={"unfinished": len(pending), "lost": len(lost), "restored": restored}
        )
        return restored

    async def _restore(self, pending: Pending) -> int:
        origin = await self.reader.read(pending.request)
        where = f"{pending.request.topic}[{pending.request.partition}]@{pending.request.offset}"
        if origin is None:
            return await self._restore_gone(pending, where)
        command = classify_record(origin, self.rules, pending.accepted_at.timestamp())
        if not isinstance(command, Accept) or command.item.key != pending.key:
            self.metrics.reconciled.labels(outcome="request_invalid").inc()
            log.error(
                "batch state lost and its request no longer validates: it cannot be restored",
                extra={"batch_id": pending.key, "request": where},
            )
            return 0
        # it was accepted once (its accepted event is out): no quota refuses it now
        [result] = await self.store.intake_many([dataclasses.replace(command.item, token_limit=None)])
        if not result.is_new:  # taken in meanwhile (a redelivery, another pass)
            return 0
        self.metrics.reconciled.labels(outcome="restored").inc()
        log.warning(
            "batch state was lost; taken in again from its request",
            extra={"batch_id": pending.key, "request": where},
        )
        return 1

    async def _restore_gone(self, pending: Pending, where: str) -> int:
        """Take in a batch whose request left the topic, from its ``accepted`` event: it fails with
        ``request_gone`` at launch, so it still gets its one terminal event."""
        self.metrics.reconciled.labels(outcome="request_gone").inc()
        if pending.accepted is None:
            log.error(
                "batch state lost and its request is no longer on the topic: it cannot be restored",
                extra={"batch_id": pending.key, "request": where},
            )
            return 0
        [result] = await self.store.intake_many([gone_item(pending.accepted, pending.request)])
        if result.is_new:
            log.error(
                "batch state lost and its request is no longer on the topic: it ends failed (request_gone)",
                extra={"batch_id": pending.key, "request": where},
            )
        return 0

    async def _keep_published(self, ended: dict[BatchKey, Envelope[Any]]) -> int:
        """Record the published outcome on each record that shows its lifecycle otherwise (see the
        module docstring); return how many were set back."""
        keys, settled = list(ended), 0
        for start in range(0, len(keys), _CHUNK):
            chunk = keys[start : start + _CHUNK]
            for record in await self.store.get_many(chunk):
                if record is None or record.flag("published"):
                    continue
                event = ended[record.key]
                if record.get("terminal_event_id") == event.id:
                    continue  # the same answer, waiting to be (re)published: nothing differs
                state = published_state(record, event.id)
                if state is None:
                    continue  # another lifecycle's (or generation's) event
                settled += await self._settle(record, event, state)
        return settled

    async def _settle(self, record: BatchRecord, event: Envelope[Any], state: State) -> int:
        if is_terminal(record.state):  # ended another way, unpublished: that answer must not go out
            log.error(
                "a batch ended differently than the answer it published (Redis lost writes); its "
                "published answer stands and the other is dropped",
                extra={"batch_id": record.key, "published": state.value, "recorded": record.state.value},
            )
            self.metrics.reconciled.labels(outcome="answer_kept").inc()
            try:  # its usage goes to the day it ended; an outcome that does not read back has none
                ended: float | None = Outcome.from_json(record.get("outcome") or "{}").finished_at
            except Exception:
                ended = None
            await self.store.mark_published(record.key, record.get("terminal_event_id") or "", ended_at=ended)
            return 1
        version, current = record.version, record.state
        for step in _TO_FINALIZING[record.state] if state is State.COMPLETED else ():
            moved = await self.store.transition(
                record.key, step, expected_version=version, from_states=[current]
            )
            if not moved.ok:
                return 0
            current, version = step, moved.version
        outcome = outcome_of_event(event.data, state)
        fields = terminal_fields(record, outcome)
        fields["terminal_event_id"] = event.id
        moved = await self.store.transition(record.key, state, expected_version=version, fields=fields)
        if not moved.ok:
            return 0
        await self.store.mark_published(record.key, event.id, ended_at=outcome.finished_at)
        self.metrics.reconciled.labels(outcome="answer_kept").inc()
        log.error(
            "a batch answered already was running again (Redis lost writes): its published answer stands",
            extra={"batch_id": record.key, "published": state.value, "was": record.state.value},
        )
        return 1

    # -- Kafka ------------------------------------------------------------------------------------
    async def _unfinished_since(
        self, since: float, ended: dict[BatchKey, Envelope[Any]] | None = None
    ) -> dict[BatchKey, Pending]:
        from aiokafka import TopicPartition

        topic = self.settings.kafka.topics.results
        consumer = side_consumer(self.settings.kafka)
        try:
            await consumer.start()
            # partitions_for_topic() only knows subscribed topics: ask the cluster
            cluster = await consumer._client.fetch_all_metadata()
            partitions = sorted(cluster.partitions_for_topic(topic) or ())
            tps = [TopicPartition(topic, p) for p in partitions]
            if not tps:
                return {}
            found = await consumer.offsets_for_times({tp: int(since * 1000) for tp in tps})
            ends = await consumer.end_offsets(tps)
            starts = {tp: (hit.offset if hit is not None else ends[tp]) for tp, hit in found.items()}
            todo = {tp for tp in tps if starts[tp] < ends[tp]}
            consumer.assign(tps)
            for tp in tps:
                consumer.seek(tp, starts[tp])
            pending: dict[BatchKey, Pending] = {}
            while todo:
                batches = await consumer.getmany(*todo, timeout_ms=1000, max_records=2000)
                for tp, records in batches.items():
                    for event in _events(records):
                        track(pending, event, ended)
                    if await consumer.position(tp) >= ends[tp]:
                        todo.discard(tp)
            return pending
        except Exception as exc:
            raise classify(exc, default=KafkaUnavailable) from exc
        finally:
            await consumer.stop()


def gone_item(accepted: BatchAccepted, request: RecordRef) -> IntakeItem:
    """The batch of ``accepted`` taken in without its request (which left the topic): queued, so the
    tracker fails it with ``request_gone`` and publishes its terminal event. Pure."""
    at = accepted.accepted_at.timestamp()
    # the request's key is its batch id (the contract); its value and headers left with the record
    key = accepted.batch_id.encode()
    origin = OriginalRecord(request.topic, request.partition, request.offset, key, None)
    fields = {
        "batch_id": accepted.batch_id,
        "tenant": accepted.tenant,
        "model": accepted.model,
        "endpoint": accepted.endpoint.value,
        "priority": str(accepted.priority),
        "accepted_at": repr(at),
        "origin": origin.to_json(),
        "request_gone": "1",
        "source": "urn:llmbatch:reconcile",
        "event_id": f"gone-{request.topic}-{request.partition}-{request.offset}",
        "metadata": orjson.dumps(accepted.metadata).decode(),
        "attempt": "0",
    }
    if accepted.total_requests is not None:
        fields["total"] = str(accepted.total_requests)
    return IntakeItem(
        key=batch_key(accepted.tenant, accepted.batch_id),
        fields=fields,
        marker=(fields["source"], fields["event_id"]),
        initial=State.QUEUED,
        ready_score=ready_score(accepted.priority, accepted.expires_at.timestamp()),
        deadline=accepted.expires_at.timestamp(),
    )


def _events(records: Iterable[Any]) -> Iterable[Envelope[Any]]:
    """The accepted and terminal events among ``records`` (others are skipped without decoding)."""
    for record in records:
        headers = list(record.headers or ())
        if peek_type(headers) not in _WANTED:
            continue
        try:
            yield decode(record.key, record.value, headers)
        except SchemaError:
            continue
