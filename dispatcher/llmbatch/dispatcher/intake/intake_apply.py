"""One segment of the requests topic applied (see :mod:`llmbatch.dispatcher.intake.consumer`): the intake
scripts
pipelined into Redis, then the ``accepted`` events and dead letters, awaited until the broker
acknowledged them, then the ``rejected`` answers to every request that was not accepted and names a
batch id; last, the rejected records are marked in Redis so a redelivery is not answered twice.

Everything here is idempotent (batch-id dedupe, event-id markers): the consumer retries a segment
after a transient failure and commits its offsets only once this returned.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence

from llmbatch.dispatcher import logs
from llmbatch.dispatcher.domain.batch_record import BatchRecord
from llmbatch.dispatcher.domain.events import build_accepted
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.errors import DispatcherError
from llmbatch.dispatcher.intake.answers import duplicate_answer, rejection_answer
from llmbatch.dispatcher.intake.commands import Accept, Command, Reject
from llmbatch.dispatcher.kafka.publisher import EventProducer, SendFuture, gather_sends
from llmbatch.dispatcher.metrics import Metrics
from llmbatch.dispatcher.state.store import StateStore

log = logging.getLogger(__name__)


class IntakeApplier:
    """Applies segments of classified records (:func:`llmbatch.dispatcher.intake.commands.classify`) for the
    consumer."""

    def __init__(
        self,
        store: StateStore,
        producer: EventProducer,
        metrics: Metrics,
        *,
        results_topic: str,
        source: str,
        clock: Callable[[], float],
        crash: Callable[[str], None],
    ) -> None:
        self.store = store
        self.producer = producer
        self.metrics = metrics
        self.results_topic = results_topic
        self.source = source
        self.clock = clock
        self.crash = crash

    async def apply(self, commands: Sequence[Command]) -> int:
        """Apply one segment (no cancel in it); returns how many batches it accepted anew. Raises the
        store's or the producer's :class:`DispatcherError`; applying the same segment again is harmless."""
        accepts = [c for c in commands if isinstance(c, Accept)]
        rejects = [c for c in commands if isinstance(c, Reject)]
        seen = await self.store.markers_exist([r.marker for r in rejects])
        fresh = [r for r, exists in zip(rejects, seen, strict=True) if not exists]
        self.metrics.processed.labels(outcome="duplicate_rejected").inc(len(rejects) - len(fresh))
        # what stands behind each rejected id, read before anything is written: the answers say it
        named = [r.key for r in fresh if r.key is not None]
        named_states = dict(zip(named, await self.store.states_many(named), strict=True))
        behind = [named_states.get(r.key) if r.key is not None else None for r in fresh]
        results = await self.store.intake_many([a.item for a in accepts])
        self.crash("after_accept")
        sends: list[SendFuture] = []
        outcomes: Counter[str] = Counter()
        results_topic = self.results_topic
        # a redelivered request whose batch has not ended: its 'accepted' may never have gone out (a
        # crash between the intake and the publish); send it again, as stored (the original time)
        again = [
            a.item.key
            for a, r in zip(accepts, results, strict=True)
            if r.outcome == "dup_event" and r.state is not None and not r.state.is_terminal
        ]
        stored = {r.key: r for r in await self.store.get_many(again) if r is not None} if again else {}
        for accept, result in zip(accepts, results, strict=True):
            with logs.bind(
                batch_id=accept.request.batch_id,
                tenant=accept.request.tenant,
                trace_id=logs.trace_id_of(accept.traceparent),
            ):
                record: BatchRecord | None = stored.get(accept.item.key)
                if result.is_new:
                    record = BatchRecord(
                        accept.item.key,
                        State.QUEUED,
                        result.version,
                        {
                            **accept.item.fields,
                            "generation": str(result.generation),
                            "deadline": repr(accept.item.deadline or 0.0),
                            "replay_id": accept.item.replay_id or "",
                        },
                    )
                if record is not None:  # the same stable id each time: consumers drop the copies
                    sends.append(
                        await self.producer.send_event(
                            results_topic, build_accepted(record, source=self.source)
                        )
                    )
                if result.outcome == "duplicate":
                    answer = duplicate_answer(accept, result, source=self.source, now=self.clock())
                    if answer is not None:
                        sends.append(await self.producer.send_event(results_topic, answer))
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
        letters = [await self.producer.send_dead_letter(r.dead_letter) for r in fresh]
        for reject in fresh:
            log.warning(
                "record dead-lettered",
                extra={
                    "reason": reject.dead_letter.reason,
                    "error": str(reject.error)[:500],
                    "topic": reject.origin.topic,
                    "partition": reject.origin.partition,
                    "offset": reject.origin.offset,
                    "batch_id": reject.batch_id,
                },
            )
            self.metrics.processed.labels(outcome="dead_lettered").inc()
        for outcome, count in outcomes.items():
            self.metrics.processed.labels(outcome=outcome).inc(count)
        written = (await gather_sends(sends + letters))[len(sends) :]
        answers: list[SendFuture] = []
        for reject, meta, state in zip(fresh, written, behind, strict=True):
            if reject.batch_id is not None:  # the answer names where its dead letter is
                rejected = rejection_answer(reject, meta, state, source=self.source, now=self.clock())
                if rejected is not None:
                    answers.append(await self.producer.send_event(results_topic, rejected))
        await gather_sends(answers)
        if fresh:
            try:
                await self.store.intake_many([r.item for r in fresh if r.item is not None])
                await self.store.set_markers([r.marker for r in fresh])
            except DispatcherError as exc:
                if exc.retriable:
                    raise
                # the dead letters and answers are written: a retry would only write them again
                log.warning("dead-lettered records not recorded in Redis", extra={"error": str(exc)})
        return sum(1 for r in results if r.is_new)
