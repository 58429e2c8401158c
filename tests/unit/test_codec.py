"""CloudEvents binary-mode codec: round trips, exact headers, every malformed case, fuzzing."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from llmbatch.schemas import (
    EVENT_DATA_MODELS,
    RESULT_EVENT_TYPES,
    BatchAccepted,
    BatchCompleted,
    BatchFailed,
    BatchProgress,
    BatchRequest,
    CancelRequest,
    Endpoint,
    Envelope,
    ErrorObject,
    EventType,
    RequestCounts,
    SchemaError,
    Usage,
    decode,
    encode,
    stable_event_id,
)
from llmbatch.schemas.cloudevents import peek_type
from llmbatch.schemas.errors import Reason

pytestmark = pytest.mark.unit

T0 = datetime(2026, 3, 1, 10, 30, 15, 123456, tzinfo=UTC)
TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def batch_request(**overrides: Any) -> BatchRequest:
    data: dict[str, Any] = {
        "batch_id": "batch-42",
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "endpoint": "/v1/chat/completions",
        "input_uri": "s3://llmbatch-input/default/inputs/0f.jsonl",
        "metadata": {"team": "search", "üñí": "cödé"},
        "priority": 7,
    }
    data.update(overrides)
    return BatchRequest.model_validate(data)


def completed(**overrides: Any) -> BatchCompleted:
    data: dict[str, Any] = {
        "batch_id": "batch-42",
        "model": "m",
        "output_uris": ["s3://llmbatch-results/default/batch-42/output-00000.jsonl"],
        "error_uris": [],
        "request_counts": {"total": 3, "completed": 2, "failed": 1},
        "usage": {"prompt_tokens": 10, "completion_tokens": 20},
        "accepted_at": T0,
        "started_at": T0 + timedelta(seconds=2),
        "finished_at": T0 + timedelta(minutes=1),
        "attempts": 1,
        "ray_submission_id": "batch-42-a1",
    }
    data.update(overrides)
    return BatchCompleted.model_validate(data)


def envelope(data: Any = None, **kwargs: Any) -> Envelope[Any]:
    return Envelope.new(data if data is not None else batch_request(), source="urn:test", time=T0, **kwargs)


def valid_record(data: Any = None, **kwargs: Any) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
    return encode(envelope(data, **kwargs))


def replace_header(headers: list[tuple[str, bytes]], name: str, value: bytes | None) -> list[Any]:
    return [(n, value if n == name else v) for n, v in headers]


def drop_header(headers: list[tuple[str, bytes]], name: str) -> list[tuple[str, bytes]]:
    return [(n, v) for n, v in headers if n != name]


def reject(key: bytes | None, value: bytes | None, headers: Any, **kwargs: Any) -> SchemaError:
    with pytest.raises(SchemaError) as info:
        decode(key, value, headers, **kwargs)
    return info.value


# ------------------------------------------------------------------------------ encode


def test_encode_produces_binary_mode_record() -> None:
    env = envelope(traceparent=TRACE, id="evt-1")
    key, value, headers = encode(env)
    assert key == b"batch-42"
    assert headers == [
        ("ce_specversion", b"1.0"),
        ("ce_id", b"evt-1"),
        ("ce_source", b"urn:test"),
        ("ce_type", b"llmbatch.batch.requested.v1"),
        ("ce_time", b"2026-03-01T10:30:15.123456Z"),
        ("ce_subject", b"batch-42"),
        ("content-type", b"application/json"),
        ("traceparent", TRACE.encode()),
    ]
    body = orjson.loads(value)
    assert body["batch_id"] == "batch-42"
    assert body["metadata"] == {"team": "search", "üñí": "cödé"}
    assert "ce_id" not in body  # binary mode: attributes are not in the value


def test_new_fills_type_subject_id_and_time() -> None:
    env = Envelope.new(CancelRequest(batch_id="b-9"), source="urn:x")
    assert env.type is EventType.CANCEL_REQUESTED
    assert env.subject == env.batch_id == "b-9"
    assert len(env.id) == 36
    assert env.time.tzinfo is not None
    assert abs(env.time - datetime.now(UTC)) < timedelta(seconds=5)
    assert Envelope.new(CancelRequest(batch_id="b-9"), source="urn:x").id != env.id


def test_new_drops_invalid_traceparent_and_rejects_non_events() -> None:
    assert envelope(traceparent="garbage").traceparent is None
    with pytest.raises(TypeError):
        Envelope.new(Usage(), source="urn:x")
    with pytest.raises(ValidationError, match="source"):
        Envelope.new(CancelRequest(batch_id="b"), source="")


def test_time_in_other_offset_is_written_in_utc() -> None:
    env = Envelope.new(
        CancelRequest(batch_id="b"),
        source="s",
        time=datetime(2026, 1, 1, 5, 0, tzinfo=timezone(timedelta(hours=5))),
    )
    headers = dict(encode(env)[2])
    assert headers["ce_time"] == b"2026-01-01T00:00:00Z"


# ------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize(
    "data",
    [
        batch_request(),
        batch_request(
            input_uri=None,
            requests=[
                {
                    "custom_id": "a",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.2},
                }
            ],
            deadline=T0 + timedelta(days=1),
            completion_window="2h",
            tenant="acme",
        ),
        CancelRequest(batch_id="batch-42", reason="stop"),
        BatchAccepted(
            batch_id="batch-42",
            model="m",
            endpoint=Endpoint.COMPLETIONS,
            accepted_at=T0,
            expires_at=T0 + timedelta(hours=24),
            total_requests=3,
        ),
        BatchProgress(
            batch_id="batch-42",
            attempt=2,
            request_counts=RequestCounts(total=5, completed=1),
            usage=Usage(prompt_tokens=3, completion_tokens=4),
            updated_at=T0,
        ),
        completed(),
        BatchFailed(
            **{
                **completed().model_dump(),
                "status": "failed",
                "error": ErrorObject(code="attempts_exhausted", message="lost 3 times"),
            }
        ),
    ],
    ids=lambda d: type(d).__name__,
)
def test_round_trip_every_event_type(data: Any) -> None:
    env = envelope(data, traceparent=TRACE, extra_headers=[("x-tenant", b"acme")])
    decoded = decode(*encode(env))
    assert decoded == env
    assert type(decoded.data) is type(data)
    assert decoded.data == data


def test_round_trip_keeps_unknown_headers_in_order_including_dlt_and_replay() -> None:
    key, value, headers = valid_record()
    extras = [
        ("kafka_dlt-original-partition", b"\x00\x00\x00\x02"),
        ("ce_partitionkey", b"pk"),
        ("llmbatch-replay-id", b"r-1"),
        ("x-binary", b"\xff\x00"),
        ("x-empty", b""),
    ]
    decoded = decode(key, value, headers + extras)
    assert list(decoded.extra_headers) == extras
    assert decoded.header("llmbatch-replay-id") == b"r-1"
    assert decoded.header("absent") is None
    assert encode(decoded)[2][-len(extras) :] == extras


def test_decode_tolerates_header_order_content_type_params_and_missing_content_type() -> None:
    key, value, headers = valid_record()
    shuffled = list(reversed(headers))
    assert decode(key, value, shuffled).id == decode(key, value, headers).id
    with_params = replace_header(headers, "content-type", b"application/json; charset=utf-8")
    assert decode(key, value, with_params).subject == "batch-42"
    assert decode(key, value, drop_header(headers, "content-type")).subject == "batch-42"
    capital = [("Content-Type" if n == "content-type" else n, v) for n, v in headers]
    assert decode(key, value, capital).subject == "batch-42"


def test_decode_accepts_times_with_offsets_and_normalises() -> None:
    key, value, headers = valid_record()
    decoded = decode(key, value, replace_header(headers, "ce_time", b"2026-03-01T12:30:15+02:00"))
    assert decoded.time == datetime(2026, 3, 1, 10, 30, 15, tzinfo=UTC)


def test_invalid_traceparent_is_ignored_but_kept() -> None:
    key, value, headers = valid_record()
    decoded = decode(key, value, [*headers, ("traceparent", b"nope")])
    assert decoded.traceparent is None
    assert decoded.header("traceparent") == b"nope"


def test_expect_restricts_types() -> None:
    record = valid_record()
    error = reject(*record, expect=RESULT_EVENT_TYPES)
    assert (error.reason, error.field) == (Reason.UNSUPPORTED_TYPE, "ce_type")
    assert "does not belong" in error.message
    assert decode(*valid_record(completed()), expect=RESULT_EVENT_TYPES).is_terminal


def test_stable_event_id_is_deterministic() -> None:
    a = stable_event_id("b", EventType.COMPLETED)
    assert a == stable_event_id("b", "llmbatch.batch.completed.v1")
    assert a != stable_event_id("b", EventType.FAILED)
    assert a != stable_event_id("b", EventType.COMPLETED, "2")


def test_peek_type() -> None:
    assert peek_type(valid_record()[2]) == "llmbatch.batch.requested.v1"
    assert peek_type([]) is None
    assert peek_type(None) is None


# ------------------------------------------------------------------------------ malformed


@pytest.mark.parametrize("name", ["ce_specversion", "ce_id", "ce_source", "ce_type", "ce_time", "ce_subject"])
def test_missing_required_header(name: str) -> None:
    key, value, headers = valid_record()
    error = reject(key, value, drop_header(headers, name))
    assert (error.reason, error.field) == (Reason.MISSING_HEADER, name)


@pytest.mark.parametrize(
    ("name", "bad", "reason"),
    [
        ("ce_specversion", b"0.3", Reason.UNSUPPORTED_SPECVERSION),
        ("ce_specversion", b"", Reason.INVALID_HEADER),
        ("ce_type", b"llmbatch.batch.requested.v2", Reason.UNSUPPORTED_TYPE),
        ("ce_type", b"com.example.other", Reason.UNSUPPORTED_TYPE),
        ("ce_time", b"yesterday", Reason.INVALID_HEADER),
        ("ce_time", b"2026-03-01T10:30:15", Reason.INVALID_HEADER),
        ("ce_id", b"", Reason.INVALID_HEADER),
        ("ce_id", b"x" * 257, Reason.INVALID_HEADER),
        ("ce_source", b"\xff\xfe", Reason.INVALID_HEADER),
        ("ce_source", None, Reason.INVALID_HEADER),
        ("content-type", b"application/cloudevents+json", Reason.WRONG_CONTENT_TYPE),
        ("content-type", b"text/plain", Reason.WRONG_CONTENT_TYPE),
    ],
)
def test_malformed_header(name: str, bad: bytes | None, reason: str) -> None:
    key, value, headers = valid_record()
    error = reject(key, value, replace_header(headers, name, bad))
    assert (error.reason, error.field) == (reason, name)
    assert error.retriable is False


def test_duplicate_known_header_is_ambiguous() -> None:
    key, value, headers = valid_record()
    error = reject(key, value, [*headers, ("ce_type", b"llmbatch.batch.cancel_requested.v1")])
    assert (error.reason, error.field) == (Reason.INVALID_HEADER, "ce_type")


def test_key_must_be_the_batch_id() -> None:
    _, value, headers = valid_record()
    assert reject(None, value, headers).reason == Reason.INVALID_KEY
    error = reject(b"other", value, headers)
    assert (error.reason, error.field) == (Reason.INVALID_KEY, "key")


def test_data_batch_id_must_match_subject() -> None:
    key, _, headers = valid_record()
    other = batch_request(batch_id="other").model_dump_json().encode()
    error = reject(key, other, headers)
    assert (error.reason, error.field) == (Reason.INVALID_FIELD, "data.batch_id")


@pytest.mark.parametrize("value", [None, b"", b"{", b"[1]", b'"s"', b"\xff", b"null", b'{"batch_id": }'])
def test_value_not_a_json_object(value: bytes | None) -> None:
    key, _, headers = valid_record()
    error = reject(key, value, headers)
    assert error.reason == Reason.INVALID_JSON


def test_invalid_data_names_the_field_with_data_prefix() -> None:
    key, value, headers = valid_record()
    body = orjson.loads(value)
    body["priority"] = 42
    error = reject(key, orjson.dumps(body), headers)
    assert (error.reason, error.field) == (Reason.INVALID_FIELD, "data.priority")
    body = orjson.loads(value)
    del body["model"]
    error = reject(key, orjson.dumps(body), headers)
    assert (error.reason, error.field) == (Reason.MISSING_FIELD, "data.model")
    body = orjson.loads(value)
    body["input_uri"] = None
    body["requests"] = [
        {
            "custom_id": "a",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "x"}], "top_p": 7},
        }
    ]
    error = reject(key, orjson.dumps(body), headers)
    assert error.field == "data.requests[0].body.top_p"


def test_result_events_tolerate_unknown_fields_commands_do_not() -> None:
    key, value, headers = valid_record(completed())
    body = orjson.loads(value)
    body["new_field_in_v1_1"] = {"x": 1}
    assert decode(key, orjson.dumps(body), headers).data == completed()
    key, value, headers = valid_record()
    body = orjson.loads(value)
    body["unexpected"] = 1
    assert reject(key, orjson.dumps(body), headers).reason == Reason.UNKNOWN_FIELD


def test_terminal_status_must_match_type() -> None:
    key, value, headers = valid_record(completed())
    body = orjson.loads(value)
    body["status"] = "failed"
    assert reject(key, orjson.dumps(body), headers).field == "data.status"


def test_header_shapes() -> None:
    key, value, headers = valid_record()
    assert decode(key, value, [(n.encode(), v) for n, v in headers]).subject == "batch-42"
    assert reject(key, value, [*headers, (b"\xff", b"v")]).reason == Reason.INVALID_HEADER
    assert reject(key, value, [*headers, ("x", "text")]).reason == Reason.INVALID_HEADER
    assert reject(key, value, [*headers, ("only-name",)]).reason == Reason.INVALID_HEADER
    assert reject(key, value, [*headers, (1, b"v")]).reason == Reason.INVALID_HEADER
    assert reject(key, value, None).reason == Reason.MISSING_HEADER


# ------------------------------------------------------------------------------ fuzzing

KNOWN_NAMES = [
    "ce_specversion",
    "ce_id",
    "ce_source",
    "ce_type",
    "ce_time",
    "ce_subject",
    "content-type",
    "traceparent",
]
GOOD_VALUES = [
    b"1.0",
    b"batch-42",
    b"urn:test",
    b"2026-03-01T10:30:15Z",
    b"application/json",
    *(t.value.encode() for t in EventType),
    TRACE.encode(),
]

header_names = st.one_of(st.sampled_from(KNOWN_NAMES), st.text(max_size=16), st.binary(max_size=8))
header_values = st.one_of(st.none(), st.sampled_from(GOOD_VALUES), st.binary(max_size=48))
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20)),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=12), children, max_size=5)
    ),
    max_leaves=25,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    key=st.one_of(st.none(), st.binary(max_size=32), st.just(b"batch-42")),
    value=st.one_of(st.none(), st.binary(max_size=256)),
    headers=st.lists(st.tuples(header_names, header_values), max_size=12),
)
def test_fuzz_arbitrary_bytes_and_headers_only_raise_schema_error(
    key: bytes | None, value: bytes | None, headers: list[tuple[Any, Any]]
) -> None:
    reason = None
    try:
        decode(key, value, headers)
    except SchemaError as exc:
        reason = exc.reason
    assert reason is None or reason in set(Reason)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    event_type=st.sampled_from(sorted(EVENT_DATA_MODELS)),
    data=st.one_of(
        json_values,
        st.dictionaries(
            st.sampled_from(
                [
                    "batch_id",
                    "model",
                    "endpoint",
                    "input_uri",
                    "requests",
                    "priority",
                    "metadata",
                    "deadline",
                    "status",
                    "accepted_at",
                    "finished_at",
                    "request_counts",
                    "usage",
                    "output_uris",
                    "error",
                    "updated_at",
                    "expires_at",
                    "reason",
                    "attempt",
                ]
            ),
            json_values,
            max_size=10,
        ).map(lambda d: {**d, "batch_id": "batch-42"}),
    ),
    extra=st.lists(st.tuples(st.text(max_size=10), st.binary(max_size=10)), max_size=3),
)
def test_fuzz_valid_envelope_with_arbitrary_data_only_raises_schema_error(
    event_type: EventType, data: Any, extra: list[tuple[str, bytes]]
) -> None:
    headers = [
        ("ce_specversion", b"1.0"),
        ("ce_id", b"1"),
        ("ce_source", b"s"),
        ("ce_type", event_type.value.encode()),
        ("ce_time", b"2026-03-01T10:30:15Z"),
        ("ce_subject", b"batch-42"),
        *extra,
    ]
    reason: str | None
    try:
        envelope = decode(b"batch-42", json.dumps(data).encode(), headers)
    except SchemaError as exc:
        envelope, reason = None, exc.reason
    else:
        reason = None
    assert reason is None or reason in set(Reason)
    if envelope is not None:
        assert envelope.type is event_type
        assert decode(*encode(envelope)) == envelope


def test_deeply_nested_json_is_a_schema_error() -> None:
    key, _, headers = valid_record()
    deep = b"[" * 100_000 + b"]" * 100_000
    assert reject(key, deep, headers).reason == Reason.INVALID_JSON
    deep_obj = b'{"batch_id": "batch-42", "metadata": ' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"}"
    assert reject(key, deep_obj, headers).reason in {Reason.INVALID_JSON, Reason.INVALID_FIELD}
