"""Record -> command (pure): valid requests, cancels, replays, and every kind of invalid record,
plus dead-letter headers and terminal event ids."""

from __future__ import annotations

import hashlib
import struct
import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import orjson
import pytest

from llmbatch.dispatcher.domain.batch_record import BatchRecord
from llmbatch.dispatcher.domain.dlt import OriginalRecord, build_dead_letter
from llmbatch.dispatcher.domain.events import (
    Outcome,
    accepted_event_id,
    build_accepted,
    build_progress,
    build_terminal,
    safe_counts,
    terminal_event_id,
    terminal_fields,
)
from llmbatch.dispatcher.domain.keys import batch_key
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.intake.commands import Accept, Cancel, IntakeRules, Reject, classify, lifecycle_of
from llmbatch.schemas import dlt as dlt_headers
from llmbatch.schemas.batch import BatchRequest, CancelRequest, InlineLimits
from llmbatch.schemas.cloudevents import decode, encode
from llmbatch.schemas.dlt import DltReason, DltRecord, ReplayInfo
from llmbatch.schemas.errors import Reason
from llmbatch.schemas.events import RESULT_EVENT_TYPES, EventType
from llmbatch.schemas.openai import RequestCounts, Usage
from tests.support.dispatcher_kit import MODEL, batch_request, inline_lines, origin, request_message

pytestmark = pytest.mark.unit

NOW = 1_790_000_000.0
RULES = IntakeRules(
    requests_topic="llm.batch.requests.v1",
    dlt_topic="llm.batch.requests.v1.dlt",
    group_id="g1",
    served_models=frozenset({MODEL, "Qwen/Qwen2.5-0.5B-Instruct"}),
    inline_limits=InlineLimits(max_requests=10, max_bytes=4096),
    readable_buckets=frozenset({"llmbatch-input"}),
)


def unserved_request(batch_id: str = "bad-model", model: str = "no-such-model") -> BatchRequest:
    return batch_request(batch_id, model=model, requests=inline_lines(2, model=model))


def headers_dict(headers: list[tuple[str, bytes]]) -> dict[str, bytes]:
    return dict(headers)


def test_valid_request_is_accepted_with_everything_the_batch_needs() -> None:
    request = batch_request("batch-1", priority=8, metadata={"k": "v"})
    key, value, headers = request_message(
        request, event_id="e-1", traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    )
    command = classify(origin(key, value, headers, offset=7), RULES, NOW)
    assert isinstance(command, Accept)
    item = command.item
    assert item.key == "batch-1" and item.initial is State.QUEUED  # the default tenant's key: the id
    assert item.marker == ("urn:test:upstream", "e-1")
    assert item.fields["request"] == value.decode()  # kept verbatim for the job and the DLT
    assert item.fields["total"] == "3" and item.fields["priority"] == "8"
    assert orjson.loads(item.fields["metadata"]) == {"k": "v"}
    assert item.fields["traceparent"].startswith("00-0af7")
    assert item.deadline == pytest.approx(NOW + 24 * 3600)  # default completion window
    assert OriginalRecord.from_json(item.fields["origin"]).offset == 7


def test_a_body_over_the_redis_limit_is_kept_by_size_and_digest_only() -> None:
    request = batch_request("batch-1", requests=inline_lines(5))
    key, value, headers = request_message(request)
    rules = replace(RULES, request_in_redis_max_bytes=len(value) - 1)
    command = classify(origin(key, value, headers, offset=7), rules, NOW)
    assert isinstance(command, Accept)
    fields = command.item.fields
    assert "request" not in fields and fields["request_bytes"] == str(len(value))
    assert fields["request_sha256"] == hashlib.sha256(value).hexdigest()
    assert OriginalRecord.from_json(fields["origin"]).offset == 7  # where to read it back
    same = classify(origin(key, value, headers), replace(RULES, request_in_redis_max_bytes=len(value)), NOW)
    assert isinstance(same, Accept) and same.item.fields["request"] == value.decode()


def test_deadline_and_window_take_the_earlier() -> None:
    deadline = datetime.fromtimestamp(NOW, UTC) + timedelta(minutes=10)
    request = batch_request("b", deadline=deadline.isoformat(), completion_window="1h")
    command = classify(origin(*request_message(request)), RULES, NOW)
    assert isinstance(command, Accept)
    assert command.item.deadline == pytest.approx(NOW + 600)


def test_within_a_priority_the_nearest_deadline_launches_first() -> None:
    """EDF: a batch with a 1 h window accepted after one with the default 24 h window goes first; one
    due later stays behind; priority still decides first."""

    def score(batch_id: str, at: float, **fields: object) -> float:
        command = classify(origin(*request_message(batch_request(batch_id, **fields))), RULES, at)
        assert isinstance(command, Accept)
        return command.item.ready_score

    scores = {
        "first-24h": score("a", NOW),
        "later-1h": score("b", NOW + 100, completion_window="1h"),
        "later-24h": score("c", NOW + 50),
        "urgent-later-24h": score("d", NOW + 200, priority=9),
    }
    order = sorted(scores, key=scores.__getitem__)
    assert order == ["urgent-later-24h", "later-1h", "first-24h", "later-24h"]


def test_cancel_is_recognised() -> None:
    key, value, headers = request_message(
        CancelRequest(batch_id="b-9", reason="no longer needed"), event_id="c1"
    )
    command = classify(origin(key, value, headers), RULES, NOW)
    assert isinstance(command, Cancel)
    assert command.batch_id == "b-9" and command.marker == ("urn:test:upstream", "c1")


def test_replay_headers_make_a_distinct_marker() -> None:
    replay = ReplayInfo(replay_id="r-1", replayed_at=datetime.now(UTC), replayed_by="ops")
    key, value, headers = request_message(
        batch_request("b"), event_id="e-1", extra_headers=replay.to_headers()
    )
    command = classify(origin(key, value, headers), RULES, NOW)
    assert isinstance(command, Accept)
    assert command.item.replay_id == "r-1"
    assert command.item.marker == ("urn:test:upstream", "e-1#replay:r-1")


REPLAY_KEY = b"k" * 32


def _replayed(
    info: ReplayInfo, event_id: str = "e-1"
) -> tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]:
    return request_message(batch_request("b"), event_id=event_id, extra_headers=info.to_headers())


def test_with_a_replay_key_only_a_replay_signed_for_this_event_reopens() -> None:
    """Before, any producer could add replay headers and so reopen a failed batch (a new lifecycle)."""
    rules = replace(RULES, replay_key=REPLAY_KEY)
    info = ReplayInfo(replay_id="r-1", replayed_at=datetime.now(UTC), replayed_by="ops")
    signed = info.signed(REPLAY_KEY, source="urn:test:upstream", event_id="e-1")
    command = classify(origin(*_replayed(signed)), rules, NOW)
    assert isinstance(command, Accept) and command.item.replay_id == "r-1"
    forged = [
        ("not signed", info, "e-1"),
        ("another key", info.signed(b"x" * 32, source="urn:test:upstream", event_id="e-1"), "e-1"),
        ("another event's signature", signed, "e-2"),
        ("another replay id", signed.model_copy(update={"replay_id": "r-2"}), "e-1"),
    ]
    for what, replay, event_id in forged:
        command = classify(origin(*_replayed(replay, event_id)), rules, NOW)
        assert isinstance(command, Reject), what
        assert command.error.field == dlt_headers.REPLAY_SIG and command.error.reason == Reason.INVALID_HEADER
        assert "LLMBATCH_REPLAY__KEY" in command.error.message
        assert headers_dict(command.dead_letter.headers)[dlt_headers.REASON] == b"invalid_event"
    # without a key, replay headers are honoured as they are (the dispatcher warns as it starts)
    assert isinstance(classify(origin(*_replayed(info)), RULES, NOW), Accept)


def test_a_plain_request_needs_no_signature_under_a_replay_key() -> None:
    rules = replace(RULES, replay_key=REPLAY_KEY)
    key, value, headers = request_message(batch_request("b"), event_id="e-1")
    command = classify(origin(key, value, headers), rules, NOW)
    assert isinstance(command, Accept) and command.item.replay_id is None


def _drop(headers: list[tuple[str, bytes]], name: str) -> list[tuple[str, bytes]]:
    return [(k, v) for k, v in headers if k != name]


def _set(headers: list[tuple[str, bytes]], name: str, value: bytes) -> list[tuple[str, bytes]]:
    return [*_drop(headers, name), (name, value)]


def _cases() -> list[tuple[str, tuple[bytes | None, bytes | None, list[tuple[str, bytes]]], str, str]]:
    key, value, headers = request_message(batch_request("bad-1"), event_id="x1")
    too_many = batch_request("bad-2", requests=inline_lines(11))
    past = batch_request("bad-3")
    past_value = orjson.loads(request_message(past)[1])
    past_value["deadline"] = "2020-01-01T00:00:00Z"
    k3, _, h3 = request_message(past)
    other_bucket = batch_request("bad-4", input_uri="s3://someone-elses/x.jsonl")
    return [
        ("not json", (key, b"{nope", headers), "invalid_event", "invalid_json"),
        ("json array", (key, b"[1,2]", headers), "invalid_event", "invalid_json"),
        ("missing ce_type", (key, value, _drop(headers, "ce_type")), "invalid_event", "missing_header"),
        (
            "unknown ce_type",
            (key, value, _set(headers, "ce_type", b"com.example.other")),
            "invalid_event",
            "unsupported_type",
        ),
        (
            "result type on requests topic",
            (key, value, _set(headers, "ce_type", EventType.COMPLETED.value.encode())),
            "invalid_event",
            "unsupported_type",
        ),
        (
            "wrong specversion",
            (key, value, _set(headers, "ce_specversion", b"0.3")),
            "invalid_event",
            "unsupported_specversion",
        ),
        ("key differs from subject", (b"other", value, headers), "invalid_event", "invalid_key"),
        ("no key", (None, value, headers), "invalid_event", "invalid_key"),
        (
            "unknown field",
            (key, value.replace(b'{"batch_id"', b'{"temprature":1,"batch_id"'), headers),
            "invalid_event",
            "unknown_field",
        ),
        ("too many inline requests", request_message(too_many), "limit_exceeded", "limit_exceeded"),
        ("deadline passed", (k3, orjson.dumps(past_value), h3), "deadline_passed", "deadline_passed"),
        ("bucket not allowed", request_message(other_bucket), "limit_exceeded", "limit_exceeded"),
        ("model not served", request_message(unserved_request()), "model_not_found", "model_not_found"),
        (
            "binary garbage",
            (b"\xff\xfe", b"\x00\x01", [("ce_id", b"\xff")]),
            "invalid_event",
            "missing_header",
        ),
    ]


@pytest.mark.parametrize(
    ("name", "message", "dlt_reason", "schema_reason"), _cases(), ids=[c[0] for c in _cases()]
)
def test_invalid_records_are_dead_lettered_with_reason_and_spring_headers(
    name: str,
    message: tuple[bytes | None, bytes | None, list[tuple[str, bytes]]],
    dlt_reason: str,
    schema_reason: str,
) -> None:
    key, value, headers = message
    command = classify(origin(key, value, headers, partition=2, offset=41), RULES, NOW)
    assert isinstance(command, Reject), name
    assert command.error.reason == schema_reason
    letter = command.dead_letter
    assert letter.topic == "llm.batch.requests.v1.dlt"
    assert (letter.key, letter.value) == (key, value)  # original bytes untouched
    assert letter.headers[: len(headers)] == headers  # original headers first, in order
    h = headers_dict(letter.headers)
    assert h[dlt_headers.REASON] == dlt_reason.encode()
    assert h[dlt_headers.ORIGINAL_TOPIC] == b"llm.batch.requests.v1"
    assert struct.unpack(">i", h[dlt_headers.ORIGINAL_PARTITION])[0] == 2
    assert struct.unpack(">q", h[dlt_headers.ORIGINAL_OFFSET])[0] == 41
    assert struct.unpack(">q", h[dlt_headers.ORIGINAL_TIMESTAMP])[0] == 1_700_000_000_000
    assert h[dlt_headers.ORIGINAL_CONSUMER_GROUP] == b"g1"
    assert h[dlt_headers.EXCEPTION_FQCN] == b"llmbatch.schemas.errors.SchemaError"
    assert schema_reason.encode() in h[dlt_headers.EXCEPTION_MESSAGE]
    parsed = DltRecord.from_headers(letter.headers)
    assert parsed is not None and parsed.reason == dlt_reason and parsed.original_offset == 41


def test_unknown_model_is_dead_lettered_as_model_not_found_naming_model_served_models_and_fix() -> None:
    key, value, headers = request_message(unserved_request("b-unserved"), event_id="e-m")
    command = classify(origin(key, value, headers), RULES, NOW)
    assert isinstance(command, Reject)
    assert command.error.reason == Reason.MODEL_NOT_FOUND
    assert Reason.MODEL_NOT_FOUND.value == "model_not_found"
    assert command.error.field == "model"
    assert command.error.openai_code == "model_not_found"  # OpenAI's code for the same problem
    h = headers_dict(command.dead_letter.headers)
    assert h[dlt_headers.REASON] == DltReason.MODEL_NOT_FOUND.value.encode() == b"model_not_found"
    message = h[dlt_headers.EXCEPTION_MESSAGE].decode()
    assert "'no-such-model'" in message  # the model asked for
    assert f"'{MODEL}'" in message and "'Qwen/Qwen2.5-0.5B-Instruct'" in message  # what is served
    assert "LLMBATCH_ENGINES__MODELS" in message  # the fix
    # the batch is remembered as dead-lettered with the code a client sees in `jobs get`
    assert command.item is not None and command.item.initial is State.DEAD_LETTERED
    assert command.item.fields["dlt_reason"] == "model_not_found"
    assert command.item.fields["error_code"] == "model_not_found"
    assert "no-such-model" in command.item.fields["error_message"]


def test_every_served_model_is_accepted() -> None:
    for model in sorted(RULES.served_models):
        request = batch_request(f"b-{len(model)}", model=model, requests=inline_lines(2, model=model))
        command = classify(origin(*request_message(request)), RULES, NOW)
        assert isinstance(command, Accept), model
        assert command.item.fields["model"] == model


def test_nothing_is_accepted_when_no_model_is_served() -> None:
    rules = replace(RULES, served_models=frozenset())
    command = classify(origin(*request_message(batch_request("b-none"))), rules, NOW)
    assert isinstance(command, Reject) and command.error.reason == "model_not_found"
    assert "none configured" in command.error.message
    # cancels do not name a model: still recognised
    cancel = request_message(CancelRequest(batch_id="b-none"))
    assert isinstance(classify(origin(*cancel), rules, NOW), Cancel)


def test_rejected_record_with_readable_ids_is_remembered_as_dead_lettered() -> None:
    key, _, headers = request_message(batch_request("bad-x"), event_id="e-77")
    command = classify(origin(key, b"{}", headers), RULES, NOW)
    assert isinstance(command, Reject) and command.item is not None
    assert command.item.initial is State.DEAD_LETTERED
    assert command.item.marker == command.marker == ("record", "llm.batch.requests.v1:0:0:1700000000000")
    assert command.item.fields["dlt_reason"] == "invalid_event"


def test_a_rejected_record_keeps_the_tenant_it_names() -> None:
    """``llmbatch jobs`` showed every rejected request as the default tenant's."""
    request = batch_request("past-1", tenant="acme", deadline="2001-01-01T00:00:00Z")
    command = classify(origin(*request_message(request)), RULES, NOW)
    assert isinstance(command, Reject) and command.item is not None
    assert command.item.fields["tenant"] == "acme"
    # not JSON, no data, or no valid tenant: none recorded (read as the default tenant's)
    key, value, headers = request_message(request)
    for broken in (b"not json", b"[]", b'{"tenant": 1}', value.replace(b'"acme"', b'"ACME!"')):
        command = classify(origin(key, broken, headers), RULES, NOW)
        assert isinstance(command, Reject) and command.item is not None
        assert "tenant" not in command.item.fields, broken


def test_rejected_record_without_ids_is_only_dead_lettered() -> None:
    command = classify(origin(None, b"x", []), RULES, NOW)
    assert isinstance(command, Reject) and command.item is None


def test_dead_letter_keeps_earlier_dlt_headers_and_appends_new_ones() -> None:
    first = build_dead_letter(
        origin(b"k", b"v", [("a", b"1")]),
        dlt_topic="d",
        reason=DltReason.INVALID_EVENT,
        group_id="g",
        fqcn="x.Y",
        message="m1",
    )
    again = build_dead_letter(
        OriginalRecord("t", 1, 2, b"k", b"v", tuple(first.headers)),
        dlt_topic="d",
        reason=DltReason.ATTEMPTS_EXHAUSTED,
        group_id="g",
        fqcn="x.Z",
        message="m2",
    )
    parsed = DltRecord.from_headers(again.headers)
    assert parsed is not None and parsed.reason == "attempts_exhausted" and parsed.exception_fqcn == "x.Z"
    assert again.headers[0] == ("a", b"1")


def test_original_record_json_round_trip_keeps_binary_headers() -> None:
    rec = OriginalRecord("t", 3, 99, b"\x00key", None, (("bin", b"\xff\x00"), ("txt", b"x")), 5, 1)
    assert OriginalRecord.from_json(rec.to_json()) == rec


# --- event ids and terminal events ----------------------------------------------------------------------


B1 = batch_key("acme", "b1")


def test_terminal_event_id_is_stable_and_distinct() -> None:
    a = terminal_event_id(B1, State.COMPLETED, 0, None)
    assert a == terminal_event_id(B1, State.COMPLETED, 0, None)
    others = {
        terminal_event_id(B1, State.FAILED, 0, None),
        terminal_event_id(batch_key(None, "b2"), State.COMPLETED, 0, None),
        terminal_event_id(B1, State.COMPLETED, 1, None),
        terminal_event_id(B1, State.COMPLETED, 0, "r1"),
    }
    assert a not in others and len(others) == 4
    assert terminal_event_id(B1, State.DEAD_LETTERED, 0, None) == terminal_event_id(B1, State.FAILED, 0, None)
    assert accepted_event_id(B1, 0, None) != a
    uuid.UUID(a)


def _record(state: State, **fields: str) -> BatchRecord:
    base = {
        "state": state.value,
        "version": "5",
        "batch_id": "b1",
        "tenant": "acme",
        "model": "m",
        "endpoint": "/v1/chat/completions",
        "priority": "5",
        "accepted_at": repr(NOW),
        "deadline": repr(NOW + 60),
        "metadata": '{"k":"v"}',
        "attempt": "2",
        "attempt_base": "0",
        "submission_id": "b1-a2",
        "generation": "0",
        "total": "3",
    }
    base.update(fields)
    return BatchRecord.from_hash(B1, base)


def test_terminal_event_carries_the_stored_id_and_outcome() -> None:
    outcome = Outcome(
        State.COMPLETED,
        NOW + 30,
        ["s3://llmbatch-results/acme/b1/output-a2-00000.jsonl"],
        [],
        "s3://llmbatch-results/acme/b1/manifest.json",
        {"total": 3, "completed": 3, "failed": 0},
        {"prompt_tokens": 10, "completion_tokens": 20},
        NOW + 1,
    )
    record = _record(State.COMPLETED)
    record = BatchRecord.from_hash(B1, {**record.fields, **terminal_fields(record, outcome)})
    envelope = build_terminal(record, source="urn:d")
    assert envelope.id == terminal_event_id(B1, State.COMPLETED, 0, None)
    assert envelope.type is EventType.COMPLETED
    data = envelope.data
    assert data.request_counts.completed == 3 and data.usage.total_tokens == 30
    assert data.attempts == 2 and data.ray_submission_id == "b1-a2" and data.metadata == {"k": "v"}
    assert data.output_uris == outcome.output_uris and data.tenant == "acme"
    # encodes and decodes as a valid results-topic event; rebuilding gives the same bytes
    key, value, headers = encode(envelope)
    assert decode(key, value, headers, expect=RESULT_EVENT_TYPES).id == envelope.id
    assert encode(build_terminal(record, source="urn:d")) == (key, value, headers)


def test_failed_event_has_an_error() -> None:
    outcome = Outcome(
        State.FAILED,
        NOW,
        error_code="attempts_exhausted",
        error_message="3 attempts failed",
        dlt_reason="attempts_exhausted",
    )
    record = _record(State.FAILED)
    fields = terminal_fields(record, outcome)
    assert fields["dlt_pending"] == "1"
    envelope = build_terminal(BatchRecord.from_hash(B1, {**record.fields, **fields}), source="urn:d")
    assert envelope.type is EventType.FAILED
    assert envelope.data.error.code == "attempts_exhausted"


def test_accepted_event() -> None:
    envelope = build_accepted(_record(State.QUEUED), source="urn:d")
    assert envelope.type is EventType.ACCEPTED and envelope.id == accepted_event_id(B1, 0, None)
    assert envelope.data.total_requests == 3
    assert envelope.data.expires_at.timestamp() == pytest.approx(NOW + 60)


def test_safe_counts_never_violates_the_total() -> None:
    counts = safe_counts({"total": 2, "completed": 3, "failed": 1})
    assert (counts.total, counts.completed, counts.failed) == (4, 3, 1)
    assert safe_counts({}, 5).total == 5


def test_event_ids_are_unique_per_lifecycle_and_stable_within_one() -> None:
    """A batch id sent again after its record expired starts another lifecycle: a consumer that
    dedupes by ce_id must not drop its events as repeats of the first lifecycle's."""
    request = batch_request("b-again")

    def ids(offset: int) -> tuple[str, ...]:
        k, v, h = request_message(request, event_id="e-1")
        command = classify(origin(k, v, h, offset=offset), RULES, NOW)
        assert isinstance(command, Accept)
        record = BatchRecord.from_hash(
            command.item.key, {**command.item.fields, "state": "queued", "version": "1", "attempt": "1"}
        )
        counts = RequestCounts(total=3, completed=1, failed=0)
        ended = Outcome(State.COMPLETED, NOW, counts={"total": 3, "completed": 3})
        return (
            build_accepted(record, source="urn:d").id,
            build_progress(record, counts, Usage(), source="urn:d", now=NOW).id,
            terminal_fields(record, ended)["terminal_event_id"],
        )

    first, again, second = ids(5), ids(5), ids(9)
    assert first == again  # a redelivered record: the same lifecycle, the same ids
    assert not set(first) & set(second)  # another record of the same batch id: no id in common
    # a record from before lifecycles existed keeps the ids it had
    assert accepted_event_id(B1, 0, None) == accepted_event_id(B1, 0, None, "")


def test_a_lifecycle_is_fixed_by_the_record_that_starts_it() -> None:
    request = batch_request("b-life")
    key, value, headers = request_message(request, event_id="e-1")

    def lifecycle(offset: int, event_id: str = "e-1") -> str:
        k, v, h = request_message(request, event_id=event_id)
        command = classify(origin(k, v, h, offset=offset), RULES, NOW)
        assert isinstance(command, Accept)
        return command.item.fields["lifecycle"]

    first = lifecycle(5)
    assert first == lifecycle(5) and len(first) == 10  # a redelivery names the same lifecycle
    assert lifecycle(6) != first  # the same batch id in another record: another lifecycle
    assert lifecycle(5, "e-2") != first
    assert lifecycle_of(origin(key, value, headers, offset=5), "urn:test:upstream", "e-1") == first


@pytest.mark.parametrize(
    "key",
    [
        "acme/inputs/x.jsonl",
        "acme/files/file-1.jsonl",
        "acme/deep/er/x.jsonl",
    ],
)
def test_an_input_under_the_tenants_prefix_is_accepted(key: str) -> None:
    rules = replace(RULES, inputs_under_tenant_prefix=True)
    request = batch_request("own-1", tenant="acme", requests=None, input_uri=f"s3://llmbatch-input/{key}")
    assert isinstance(classify(origin(*request_message(request)), rules, NOW), Accept)


@pytest.mark.parametrize(
    "key",
    [
        "globex/inputs/x.jsonl",  # another tenant's input (the attack: content-addressed, guessable)
        "x.jsonl",  # no tenant at all
        "acmecorp/inputs/x.jsonl",  # a tenant whose name starts with this one's
        "acme/../globex/x.jsonl",  # a way out
        "acme//x.jsonl",
    ],
)
def test_an_input_outside_the_tenants_prefix_is_rejected_naming_field_and_fix(key: str) -> None:
    rules = replace(RULES, inputs_under_tenant_prefix=True)
    request = batch_request("other-1", tenant="acme", requests=None, input_uri=f"s3://llmbatch-input/{key}")
    command = classify(origin(*request_message(request)), rules, NOW)
    assert isinstance(command, Reject), key
    assert command.error.reason == "invalid_field" and command.error.field == "input_uri"
    assert "s3://llmbatch-input/acme/" in command.error.message
    # the rule is a setting (on by default)
    assert isinstance(classify(origin(*request_message(request)), RULES, NOW), Accept)


def test_the_settings_turn_the_tenant_prefix_rule_on_by_default() -> None:
    from llmbatch.dispatcher.intake.commands import intake_rules
    from llmbatch.dispatcher.settings import DispatcherOptions, DispatcherSettings

    assert intake_rules(DispatcherSettings(_env_file=None)).inputs_under_tenant_prefix
    off = DispatcherSettings(_env_file=None, dispatcher=DispatcherOptions(inputs_under_tenant_prefix=False))
    assert not intake_rules(off).inputs_under_tenant_prefix
