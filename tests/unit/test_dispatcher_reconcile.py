"""Which batches the reconcile pass looks at (pure): accepted and not ended, per the results topic."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from llmbatch.dispatcher.domain.batch_record import BatchRecord
from llmbatch.dispatcher.domain.events import build_accepted
from llmbatch.dispatcher.domain.keys import batch_key
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.intake.commands import Accept, IntakeRules, classify
from llmbatch.dispatcher.intake.reconcile import unfinished
from llmbatch.schemas.cloudevents import Envelope
from llmbatch.schemas.events import BatchCancelled, BatchProgress, RecordRef
from tests.support.dispatcher_kit import MODEL, batch_request, origin, request_message

pytestmark = pytest.mark.unit

NOW = 1_790_000_000.0
RULES = IntakeRules(requests_topic="req", dlt_topic="req.dlt", group_id="g", served_models=frozenset({MODEL}))


def accepted(batch_id: str, offset: int, tenant: str = "default") -> Envelope[Any]:
    key, value, headers = request_message(batch_request(batch_id, tenant=tenant))
    command = classify(origin(key, value, headers, topic="req", partition=1, offset=offset), RULES, NOW)
    assert isinstance(command, Accept)
    record = BatchRecord(command.item.key, State.QUEUED, 1, {**command.item.fields, "generation": "0"})
    return build_accepted(record, source="urn:d")


def ended(batch_id: str, tenant: str = "default") -> Envelope[Any]:
    at = datetime.fromtimestamp(NOW, UTC)
    return Envelope.new(
        BatchCancelled(batch_id=batch_id, tenant=tenant, model=MODEL, accepted_at=at, finished_at=at),
        source="urn:d",
    )


def test_accepted_batches_without_a_terminal_event_are_unfinished() -> None:
    progress = Envelope.new(BatchProgress(batch_id="a", updated_at=datetime.now(UTC)), source="urn:d")
    events = [accepted("a", 3), accepted("b", 4), progress, ended("b"), accepted("c", 5)]
    pending = unfinished(events)
    assert set(pending) == {"a", "c"}
    assert pending[batch_key(None, "a")].request == RecordRef(topic="req", partition=1, offset=3)
    assert pending[batch_key(None, "a")].accepted_at.timestamp() == pytest.approx(NOW, abs=0.001)


def test_a_batch_accepted_again_after_it_ended_is_unfinished_with_its_new_request() -> None:
    pending = unfinished([accepted("a", 3), ended("a"), accepted("a", 9)])
    assert pending[batch_key(None, "a")].request.offset == 9
    assert unfinished([accepted("a", 3), accepted("a", 9), ended("a")]) == {}


def test_two_tenants_batches_of_one_id_are_told_apart() -> None:
    events = [accepted("a", 3, "acme"), accepted("a", 4, "globex"), ended("a", "acme")]
    pending = unfinished(events)
    assert set(pending) == {"globex/a"} and pending[batch_key("globex", "a")].request.offset == 4
    assert set(unfinished(events[:2])) == {"acme/a", "globex/a"}


def test_an_accepted_event_that_names_no_request_is_not_reconciled() -> None:
    old = accepted("a", 3)
    data = old.data.model_copy(update={"request": None})
    assert unfinished([old.model_copy(update={"data": data})]) == {}
