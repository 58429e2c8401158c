"""Hostile records through the pure half of intake: classifying a record, building its dead letter
and its answer never raise, and whatever is built is valid on the wire (a fuzz test, hypothesis).
The same strategies drive the real consumer in tests/integration/test_consumer_fuzz.py."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import orjson
import pytest
from hypothesis import HealthCheck, given, settings

from llmbatch.dispatcher.intake.answers import failure_answer, minimal_answer, rejection_answer
from llmbatch.dispatcher.intake.commands import Accept, Cancel, IntakeRules, Reject, classify
from llmbatch.dispatcher.intake.intake_checks import claimed_tenant
from llmbatch.dispatcher.intake.record_retry import GaveUp
from llmbatch.schemas.cloudevents import decode, encode
from llmbatch.schemas.events import RESULT_EVENT_TYPES, BatchRejected
from tests.support.dispatcher_kit import MODEL, batch_request, inline_lines, origin, request_message
from tests.support.hostile_records import Record, hostile_record

pytestmark = pytest.mark.unit

NOW = 1_790_000_000.0
RULES = IntakeRules(requests_topic="req", dlt_topic="req.dlt", group_id="g", served_models=frozenset({MODEL}))


@dataclass
class Written:
    partition: int
    offset: int


def _valid_on_the_wire(answer: object) -> None:
    assert answer is not None
    envelope = decode(*encode(answer), expect=RESULT_EVENT_TYPES)  # type: ignore[arg-type]
    assert isinstance(envelope.data, BatchRejected)


def test_a_key_with_a_trailing_newline_is_no_batch_id() -> None:
    # `re.match` with `$` lets "id\n" through; the answer's contract then refused it after the dead
    # letter was written, and the exception ended the consumer task
    _, _, headers = request_message(batch_request("good-id"))
    command = classify(origin(b"good-id\n", b"{not json", headers), RULES, NOW)
    assert isinstance(command, Reject)
    assert command.batch_id is None and command.item is None and command.key is None


def test_a_tenant_with_a_trailing_newline_is_not_claimed() -> None:
    assert claimed_tenant(orjson.dumps({"tenant": "acme"})) == "acme"
    assert claimed_tenant(orjson.dumps({"tenant": "acme\n"})) is None


def test_an_answer_that_cannot_be_built_falls_back_to_the_minimal_one() -> None:
    request = batch_request("b-1", model="nope", requests=inline_lines(1, model="nope"))
    key, value, headers = request_message(request)
    command = classify(origin(key, value, headers), RULES, NOW)
    assert isinstance(command, Reject)
    # a claimed tenant the answer's contract refuses (a check that let it through): answer with less
    broken = dataclasses.replace(command, tenant="Not A Tenant")
    answer = rejection_answer(broken, Written(0, 1), None, source="urn:d", now=NOW)
    _valid_on_the_wire(answer)
    assert answer is not None and answer.batch_id == "b-1" and answer.data.error.code == "model_not_found"
    assert answer.id == rejection_answer(command, Written(0, 1), None, source="urn:d", now=NOW).id  # type: ignore[union-attr]
    # and a batch id that is none: no answer at all, and no exception
    assert (
        rejection_answer(
            dataclasses.replace(command, batch_id="b-1\n"), Written(0, 1), None, source="urn:d", now=NOW
        )
        is None
    )
    assert minimal_answer("b-1\n", "x", answer_of="a", source="urn:d", now=NOW) is None


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_record())
def test_no_record_makes_intake_raise_and_every_answer_is_valid(record: Record) -> None:
    key, value, headers = record
    command = classify(origin(key, value, headers, offset=7), RULES, NOW)
    assert isinstance(command, Accept | Cancel | Reject)
    if isinstance(command, Reject):
        letter = command.dead_letter
        assert (letter.key, letter.value) == (key, value)  # nothing of the record is lost
        assert all(isinstance(n, str) and isinstance(v, bytes) for n, v in letter.headers)
        if command.item is not None:
            assert all(isinstance(v, str) for v in command.item.fields.values())
            orjson.dumps(command.item.fields)
        if command.batch_id is not None:
            _valid_on_the_wire(rejection_answer(command, Written(0, 1), None, source="urn:d", now=NOW))
    if not isinstance(command, Cancel) and (
        batch_id := getattr(command, "batch_id", None)
        or (command.request.batch_id if isinstance(command, Accept) else None)
    ):
        failed = GaveUp("intake", RuntimeError("boom\n" + (value or b"")[:50].decode(errors="replace")), 3)
        _valid_on_the_wire(failure_answer(command, batch_id, failed, None, source="urn:d", now=NOW))
