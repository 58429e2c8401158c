"""One segment of the requests topic applied (see :mod:`llmbatch.dispatcher.intake.consumer`): the intake
scripts
pipelined into Redis, then the ``accepted`` events and dead letters, awaited until the broker
acknowledged them, then the ``rejected`` answers to every request that was not accepted and names a
batch id; last, the rejected records are marked in Redis so a redelivery is not answered twice.

Everything here is idempotent (batch-id dedupe, event-id markers): the consumer retries a segment
after a transient failure and commits its offsets only once this returned.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence

from llmbatch.dispatcher import logs
from llmbatch.dispatcher.domain.batch_record import BatchRecord
from llmbatch.dispatcher.domain.events import build_accepted
from llmbatch.dispatcher.domain.quota import estimate_file
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.errors import DispatcherError
from llmbatch.dispatcher.intake.answers import duplicate_answer, rejection_answer
from llmbatch.dispatcher.intake.commands import (
    Accept,
    Command,
    IntakeRules,
    Reject,
    over_quota_reject,
    over_storage_reject,
    record_marker,
)
from llmbatch.dispatcher.kafka.publisher import EventProducer, SendFuture, gather_sends
from llmbatch.dispatcher.metrics import Metrics
from llmbatch.dispatcher.state.store import StateStore

log = logging.getLogger(__name__)
_HEADS_AT_ONCE = 16
SizeOf = Callable[[str], Awaitable[int | None]]
"""An input file's size in bytes (None: no such object); the dispatcher's cached S3 HEAD."""


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
        rules: IntakeRules,
        size_of: SizeOf | None = None,
    ) -> None:
        """``rules``: the quotas, and what an over-quota refusal is dead-lettered by; ``size_of``: a file
        batch's input size (its token estimate under a limit; none: such a batch counts 0)."""
        self.rules = rules
        self.size_of = size_of
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
        accepts = await self._all_estimated([c for c in commands if isinstance(c, Accept)])
        # a request refused over quota before (its record's marker) is not taken in when it comes again
        limited = [a for a in accepts if a.item.token_limit is not None or self._storage_limit(a) is not None]
        if limited:
            refused_before = await self.store.markers_exist([record_marker(a.origin) for a in limited])
            refused_again = {id(a) for a, seen_ in zip(limited, refused_before, strict=True) if seen_}
            self.metrics.processed.labels(outcome="duplicate_rejected").inc(len(refused_again))
            accepts = [a for a in accepts if id(a) not in refused_again]
        accepts, over_storage = await self._over_storage(accepts)
        self.metrics.processed.labels(outcome="over_quota").inc(len(over_storage))
        rejects = [c for c in commands if isinstance(c, Reject)] + over_storage
        seen = await self.store.markers_exist([r.marker for r in rejects])
        fresh = [r for r, exists in zip(rejects, seen, strict=True) if not exists]
        self.metrics.processed.labels(outcome="duplicate_rejected").inc(len(rejects) - len(fresh))
        # what stands behind each rejected id, read before anything is written: the answers say it
        named = [r.key for r in fresh if r.key is not None]
        named_states = dict(zip(named, await self.store.states_many(named), strict=True))
        behind = [named_states.get(r.key) if r.key is not None else None for r in fresh]
        results = await self.store.intake_many([a.item for a in accepts])
        self.crash("after_accept")
        # over quota: nothing was written; refused as an invalid request is (dead letter, rejected answer)
        over = [(a, r) for a, r in zip(accepts, results, strict=True) if r.outcome == "over_quota"]
        if over:
            accepts = [a for a, r in zip(accepts, results, strict=True) if r.outcome != "over_quota"]
            results = [r for r in results if r.outcome != "over_quota"]
            for accept, result in over:
                assert result.quota is not None  # the script says why with every over_quota
                fresh.append(over_quota_reject(accept, self.rules, self.clock(), result.quota))
                behind.append(None)
            self.metrics.processed.labels(outcome="over_quota").inc(len(over))
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

    def _storage_limit(self, accept: Accept) -> int | None:
        return self.rules.storage_limit(accept.request.tenant)

    async def _over_storage(self, accepts: list[Accept]) -> tuple[list[Accept], list[Reject]]:
        """The accepts of tenants that keep at least their stored-bytes limit (as last measured) turned
        into refusals; one read of the tenants' figures."""
        limited = sorted({a.request.tenant for a in accepts if self._storage_limit(a) is not None})
        if not limited:
            return accepts, []
        used = dict(zip(limited, await self.store.stored_bytes_many(limited), strict=True))
        kept: list[Accept] = []
        refused: list[Reject] = []
        for accept in accepts:
            limit, measured = self._storage_limit(accept), used.get(accept.request.tenant)
            if limit is not None and measured is not None and measured >= limit:
                refused.append(over_storage_reject(accept, self.rules, self.clock(), measured, limit))
            else:
                kept.append(accept)
        return kept, refused

    async def _all_estimated(self, accepts: Sequence[Accept]) -> list[Accept]:
        """Each accept with its estimate, the S3 HEADs of a segment a few at a time (not one by one)."""
        out: list[Accept] = []
        for start in range(0, len(accepts), _HEADS_AT_ONCE):
            out += await asyncio.gather(*map(self._estimated, accepts[start : start + _HEADS_AT_ONCE]))
        return out

    async def _estimated(self, accept: Accept) -> Accept:
        """``accept`` with its file's token estimate, when its tenant has a limit (one S3 HEAD, cached)."""
        request = accept.request
        if accept.item.token_limit is None or request.input_uri is None or self.size_of is None:
            return accept
        try:
            size = await self.size_of(request.input_uri)
        except Exception:  # unreadable now: the batch fails on its own later; its estimate is 0
            log.warning("input size unknown for the token estimate", extra={"batch_id": request.batch_id})
            size = None
        item = dataclasses.replace(accept.item, tokens=estimate_file(size or 0))
        return dataclasses.replace(accept, item=item)
