"""dispatcher.intake_apply: what one segment of the requests topic writes, for each kind of record.

The records are classified by the real rules (dispatcher.intake.classify); the store and producer are
small in-memory stand-ins that record what was asked of them, so each answer can be read. The same
segments run against real Kafka and Redis in tests/integration/test_dispatcher_consumer.py.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from llmbatch.dispatcher.domain.batch_record import BatchRecord, IntakeItem, IntakeResult
from llmbatch.dispatcher.domain.keys import BatchKey
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.errors import DispatcherError, PermanentError, StateStoreUnavailable
from llmbatch.dispatcher.intake.commands import Accept, Command, IntakeRules, Reject, classify, intake_rules
from llmbatch.dispatcher.intake.intake_apply import IntakeApplier
from llmbatch.dispatcher.kafka.publisher import EventProducer
from llmbatch.dispatcher.metrics import Metrics
from llmbatch.dispatcher.settings import DispatcherSettings
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.schemas import EventType
from tests.support.dispatcher_kit import MODEL, batch_request, inline_lines, origin, registry, request_message

pytestmark = pytest.mark.unit
NOW = 1_790_000_000.0
RESULTS, DLT = "results", "dlt"


@dataclass
class Meta:
    topic: str
    partition: int
    offset: int


@dataclass
class Store:
    """Batches by key with the event markers that made them; rejected markers apart."""

    batches: dict[str, tuple[State, IntakeItem]] = field(default_factory=dict)
    markers: set[tuple[str, str]] = field(default_factory=set)
    recorded: list[IntakeItem] = field(default_factory=list)
    fail_recording: DispatcherError | None = None

    async def markers_exist(self, markers: list[tuple[str, str]]) -> list[bool]:
        return [m in self.markers for m in markers]

    async def states_many(self, keys: list[BatchKey]) -> list[State | None]:
        return [self.batches[k][0] if k in self.batches else None for k in keys]

    async def intake_many(self, items: list[IntakeItem]) -> list[IntakeResult]:
        if items and items[0].initial is State.DEAD_LETTERED and self.fail_recording is not None:
            raise self.fail_recording
        results = []
        for item in items:
            self.recorded.append(item)
            known = self.batches.get(item.key)
            if known is None:
                self.batches[item.key] = (item.initial, item)
                results.append(IntakeResult("created", item.initial, 1, 1))
            else:
                outcome = "dup_event" if known[1].marker == item.marker else "duplicate"
                results.append(IntakeResult(outcome, known[0], 1, 1))
        return results

    async def get_many(self, keys: list[BatchKey]) -> list[BatchRecord | None]:
        # as the intake script stores it: the request's fields and what the intake added
        stored = [(k, *self.batches[k]) for k in keys]
        return [
            BatchRecord(
                k,
                state,
                1,
                {
                    **item.fields,
                    "generation": "1",
                    "replay_id": item.replay_id or "",
                    "deadline": repr(item.deadline or 0.0),
                },
            )
            for k, state, item in stored
        ]

    async def set_markers(self, markers: list[tuple[str, str]]) -> None:
        self.markers.update(markers)


@dataclass
class Producer:
    sent: list[tuple[str, Any]] = field(default_factory=list)

    async def _done(self, topic: str) -> Any:
        future: asyncio.Future[Meta] = asyncio.get_running_loop().create_future()
        future.set_result(Meta(topic, 0, len(self.sent) - 1))
        return future

    async def send_event(self, topic: str, envelope: Any) -> Any:
        self.sent.append((topic, envelope))
        return await self._done(topic)

    async def send_dead_letter(self, letter: Any) -> Any:
        self.sent.append((DLT, letter))
        return await self._done(DLT)

    def events(self, kind: EventType) -> list[Any]:
        return [e for topic, e in self.sent if topic == RESULTS and e.type == kind]


def applier(store: Store, producer: Producer) -> tuple[IntakeApplier, list[str]]:
    crashes: list[str] = []
    return IntakeApplier(
        cast(StateStore, store),  # the in-memory stand-in has the calls the applier makes
        cast(EventProducer, producer),
        Metrics(),
        results_topic=RESULTS,
        source="urn:d",
        clock=lambda: NOW,
        crash=crashes.append,
        rules=IntakeRules(
            requests_topic="req", dlt_topic="req.dlt", group_id="g", served_models=frozenset({MODEL})
        ),
    ), crashes


def command(batch_id: str, *, event_id: str, offset: int = 0, model: str = MODEL) -> Command:
    settings = DispatcherSettings(_env_file=None, engines=registry())
    request = batch_request(batch_id, model=model, requests=inline_lines(2, model=model))
    key, value, headers = request_message(request, event_id=event_id)
    return classify(origin(key, value, headers, offset=offset), intake_rules(settings), NOW)


async def test_a_new_batch_is_recorded_then_announced_once() -> None:
    store, producer = Store(), Producer()
    apply, crashes = applier(store, producer)
    first = command("b-new", event_id="e1")
    assert isinstance(first, Accept)
    assert await apply.apply([first]) == 1
    (accepted,) = producer.events(EventType.ACCEPTED)
    assert accepted.data.batch_id == "b-new" and crashes == ["after_accept"]
    assert [i.initial for i in store.recorded] == [State.QUEUED]


async def test_a_redelivered_request_repeats_its_accepted_event_from_the_stored_record() -> None:
    store, producer = Store(), Producer()
    apply, _ = applier(store, producer)
    await apply.apply([command("b-1", event_id="e1")])
    # the same record again (a crash before its offset was committed): nothing new, the same event
    assert await apply.apply([command("b-1", event_id="e1")]) == 0
    first, again = producer.events(EventType.ACCEPTED)
    assert again.id == first.id  # a stable id: consumers drop the copy
    assert producer.events(EventType.REJECTED) == []


async def test_a_new_request_for_a_batch_id_in_use_is_answered_not_applied() -> None:
    store, producer = Store(), Producer()
    apply, _ = applier(store, producer)
    await apply.apply([command("b-1", event_id="e1")])
    assert await apply.apply([command("b-1", event_id="e2")]) == 0
    (answer,) = producer.events(EventType.REJECTED)
    assert answer.data.error.code == "duplicate_batch_id" and answer.data.request_id == "e2"
    assert len(producer.events(EventType.ACCEPTED)) == 1


async def test_an_invalid_request_is_dead_lettered_answered_with_its_coordinates_and_marked() -> None:
    store, producer = Store(), Producer()
    apply, _ = applier(store, producer)
    bad = command("b-bad", event_id="e9", model="no-such-model", offset=7)
    assert isinstance(bad, Reject)
    assert await apply.apply([bad]) == 0
    letters = [e for topic, e in producer.sent if topic == DLT]
    (answer,) = producer.events(EventType.REJECTED)
    assert len(letters) == 1 and answer.data.error.code == "model_not_found"
    letter_offset = next(i for i, (topic, _) in enumerate(producer.sent) if topic == DLT)
    assert answer.data.dead_letter.offset == letter_offset  # the answer says where its letter is
    assert bad.marker in store.markers
    # delivered again: already dead-lettered and answered, so nothing is written twice
    sent = len(producer.sent)
    assert await apply.apply([bad]) == 0 and len(producer.sent) == sent


async def test_recording_a_rejection_survives_a_permanent_store_error_but_not_an_outage() -> None:
    store, producer = Store(fail_recording=PermanentError("OOM command not allowed")), Producer()
    apply, _ = applier(store, producer)
    bad = command("b-bad", event_id="e9", model="no-such-model")
    assert isinstance(bad, Reject)
    await apply.apply([bad])  # the letter and answer are out: a retry would only repeat them
    assert bad.marker not in store.markers
    store.fail_recording = StateStoreUnavailable("Redis at 127.0.0.1:1 is unreachable")
    with pytest.raises(StateStoreUnavailable):  # retried by the consumer, all of it idempotent
        await apply.apply([command("b-bad-2", event_id="e10", model="no-such-model")])
