"""The ``rejected`` answers (pure): what they say, and that a request answered again after a
redelivery gets the same event id while another request gets another."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from llmbatch.dispatcher.domain.batch_record import IntakeResult
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.intake.answers import duplicate_answer, failure_answer, rejection_answer
from llmbatch.dispatcher.intake.commands import Accept, IntakeRules, Reject, classify
from llmbatch.dispatcher.intake.record_retry import GaveUp
from llmbatch.schemas.cloudevents import decode, encode
from llmbatch.schemas.events import RESULT_EVENT_TYPES, BatchRejected, EventType, RecordRef
from tests.support.dispatcher_kit import MODEL, batch_request, inline_lines, origin, request_message

pytestmark = pytest.mark.unit

NOW = 1_790_000_000.0
RULES = IntakeRules(requests_topic="req", dlt_topic="req.dlt", group_id="g", served_models=frozenset({MODEL}))


@dataclass
class Written:
    """What aiokafka's RecordMetadata carries that an answer uses."""

    partition: int
    offset: int


def rejected(offset: int = 3, event_id: str = "e-1", model: str = "no-such-model") -> Reject:
    request = batch_request("b-1", model=model, requests=inline_lines(1, model=model))
    command = classify(origin(*request_message(request, event_id=event_id), offset=offset), RULES, NOW)
    assert isinstance(command, Reject)
    return command


def test_a_rejection_names_the_reason_the_field_the_request_and_its_dead_letter() -> None:
    envelope = rejection_answer(rejected(), Written(1, 42), None, source="urn:d", now=NOW)
    assert envelope is not None
    assert envelope.type is EventType.REJECTED and envelope.batch_id == "b-1"
    data = envelope.data
    assert isinstance(data, BatchRejected)
    assert (data.error.code, data.error.param, data.request_id) == ("model_not_found", "model", "e-1")
    assert "no-such-model" in data.error.message
    assert data.dead_letter == RecordRef(topic="req.dlt", partition=1, offset=42)
    assert data.batch_status is State.DEAD_LETTERED and data.is_final
    # it is a valid result event on the wire
    assert decode(*encode(envelope), expect=RESULT_EVENT_TYPES).data == data


def test_the_same_record_is_answered_with_the_same_id_another_record_with_another() -> None:
    first = rejection_answer(rejected(), Written(0, 1), None, source="urn:d", now=NOW)
    again = rejection_answer(rejected(), Written(0, 9), None, source="urn:d", now=NOW + 5)
    other = rejection_answer(rejected(offset=4), Written(0, 2), None, source="urn:d", now=NOW)
    assert first is not None and again is not None and other is not None
    assert first.id == again.id != other.id


def test_a_rejection_for_a_running_batch_is_not_final() -> None:
    envelope = rejection_answer(rejected(), Written(0, 1), State.RUNNING, source="urn:d", now=NOW)
    assert envelope is not None
    assert isinstance(envelope.data, BatchRejected)
    assert envelope.data.batch_status is State.RUNNING and not envelope.data.is_final


def test_a_duplicate_request_is_answered_with_the_state_of_the_batch_that_holds_the_id() -> None:
    command = classify(origin(*request_message(batch_request("b-2"), event_id="e-2")), RULES, NOW)
    assert isinstance(command, Accept)
    result = IntakeResult("duplicate", State.COMPLETED, 7, 0)
    envelope = duplicate_answer(command, result, source="urn:d", now=NOW)
    assert envelope is not None
    data = envelope.data
    assert isinstance(data, BatchRejected)
    assert (data.error.code, data.error.param, data.request_id) == ("duplicate_batch_id", "batch_id", "e-2")
    assert data.batch_status is State.COMPLETED and data.dead_letter is None
    assert "completed" in data.error.message
    again = duplicate_answer(command, result, source="urn:d", now=NOW + 1)
    assert again is not None
    assert again.id == envelope.id


def test_a_duplicate_names_the_requesters_tenant_whose_batch_holds_the_id() -> None:
    # batch ids are scoped by tenant: the batch a duplicate runs into is always the requester's own
    command = classify(
        origin(*request_message(batch_request("b-2", tenant="globex"), event_id="e-2")), RULES, NOW
    )
    assert isinstance(command, Accept) and command.item.key == "globex/b-2"
    result = IntakeResult("duplicate", State.RUNNING, 7, 0)
    envelope = duplicate_answer(command, result, source="urn:d", now=NOW)
    assert envelope is not None
    data = envelope.data
    assert isinstance(data, BatchRejected) and data.tenant == "globex" and data.batch_id == "b-2"
    assert data.batch_status is State.RUNNING and "running" in data.error.message


def test_a_rejection_names_the_tenant_its_request_claims() -> None:
    request = batch_request(
        "b-1", tenant="acme", model="no-such-model", requests=inline_lines(1, model="no-such-model")
    )
    command = classify(origin(*request_message(request, event_id="e-9")), RULES, NOW)
    assert isinstance(command, Reject) and command.key == "acme/b-1"
    envelope = rejection_answer(command, Written(0, 1), None, source="urn:d", now=NOW)
    assert envelope is not None
    data = envelope.data
    assert isinstance(data, BatchRejected) and data.tenant == "acme"
    default = rejection_answer(rejected(), Written(0, 1), None, source="urn:d", now=NOW)
    assert default is not None
    assert default.data.tenant == "default"
    _, _, headers = request_message(request, event_id="e-10")
    unreadable = classify(origin(b"b-1", b"not json", headers), RULES, NOW)
    assert isinstance(unreadable, Reject) and unreadable.tenant is None and unreadable.key == "b-1"


def test_a_request_given_up_on_is_answered_processing_failed() -> None:
    command = classify(origin(*request_message(batch_request("b-3"), event_id="e-3")), RULES, NOW)
    assert isinstance(command, Accept)
    failed = GaveUp("intake", RuntimeError("boom"), 3)
    envelope = failure_answer(command, "b-3", failed, None, source="urn:d", now=NOW)
    assert envelope is not None
    data = envelope.data
    assert isinstance(data, BatchRejected)
    assert data.error.code == "processing_failed" and "boom" in data.error.message
    assert data.request_id == "e-3" and data.batch_status is None and data.is_final
