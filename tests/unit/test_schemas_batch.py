"""Batch and cancel requests: structural rules, acceptance checks, effective deadline."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from pydantic import ValidationError

from llmbatch.schemas import (
    BatchRequest,
    CancelRequest,
    InlineLimits,
    SchemaError,
    check_deadline,
    check_inline_limits,
    check_submittable,
    parse_batch_request,
)
from llmbatch.schemas.errors import Reason

pytestmark = pytest.mark.unit

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def line(custom_id: str = "r1", url: str = "/v1/chat/completions", **body: Any) -> dict[str, Any]:
    if url == "/v1/chat/completions":
        payload: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], **body}
    else:
        payload = {"prompt": "hi", **body}
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": payload}


def request(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "batch_id": "b-1",
        "model": "Qwen/Qwen2.5-0.5B-Instruct",
        "endpoint": "/v1/chat/completions",
        "input_uri": "s3://llmbatch-input/default/inputs/abc.jsonl",
    }
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not ...}


def reject(data: dict[str, Any]) -> SchemaError:
    with pytest.raises(SchemaError) as info:
        parse_batch_request(data)
    return info.value


def test_minimal_file_request_defaults() -> None:
    req = parse_batch_request(request())
    assert (req.priority, req.tenant, req.metadata, req.completion_window, req.deadline) == (
        5,
        "default",
        {},
        None,
        None,
    )
    assert req.request_count is None
    assert req.inline_size_bytes() == 0


def test_inline_request_and_json_round_trip() -> None:
    req = parse_batch_request(request(input_uri=..., requests=[line("a"), line("b")], metadata={"k": "v"}))
    assert req.request_count == 2
    again = parse_batch_request(req.model_dump_json())
    assert again == req


@pytest.mark.parametrize("batch_id", ["a", "A9", "batch_123", "x.y-z_1", "9" * 128, "b" + "-" * 127])
def test_batch_id_accepted(batch_id: str) -> None:
    assert parse_batch_request(request(batch_id=batch_id)).batch_id == batch_id


@pytest.mark.parametrize("batch_id", ["", "-a", ".a", "_a", "a/b", "a b", "a" * 129, "é", "a:b", "..", "a\n"])
def test_batch_id_rejected(batch_id: str) -> None:
    error = reject(request(batch_id=batch_id))
    assert (error.reason, error.field) == (Reason.INVALID_FIELD, "batch_id")
    assert "letters, digits" in error.message


@pytest.mark.parametrize(
    "uri",
    [
        "s3://llmbatch-input/a.jsonl",
        "s3://my.bucket-1/deep/path/file.jsonl",
        "s3://abc/" + "k" * 1000,
    ],
)
def test_input_uri_accepted(uri: str) -> None:
    assert parse_batch_request(request(input_uri=uri)).input_uri == uri


@pytest.mark.parametrize(
    ("uri", "hint"),
    [
        ("http://bucket/key", "s3://bucket/key"),
        ("s3://bucket", "no object key"),
        ("s3://bucket/", "no object key"),
        ("s3://Bucket/key", "bucket name"),
        ("s3://ab/key", "bucket name"),
        ("s3://a..b/key", "bucket name"),
        ("s3://192.168.1.1/key", "bucket name"),
        ("s3://bucket//key", "must not start"),
        ("s3://bucket/" + "k" * 1025, "1024"),
        ("s3://bucket/a\x01b", "control"),
    ],
)
def test_input_uri_rejected(uri: str, hint: str) -> None:
    error = reject(request(input_uri=uri))
    assert error.field == "input_uri"
    assert hint in error.message


def test_exactly_one_input() -> None:
    neither = reject(request(input_uri=None))
    assert (neither.reason, neither.field) == (Reason.MISSING_FIELD, "input_uri")
    assert "exactly one of input_uri" in neither.message
    both = reject(request(requests=[line()]))
    assert (both.reason, both.field) == (Reason.INVALID_FIELD, "input_uri")
    empty = reject(request(input_uri=None, requests=[]))
    assert empty.field == "requests"


@pytest.mark.parametrize("endpoint", ["/v1/moderations", "chat", "/v1/chat/completions/", ""])
def test_endpoint_enum(endpoint: str) -> None:
    assert reject(request(endpoint=endpoint)).field == "endpoint"


@pytest.mark.parametrize("model", ["", "has space", "-lead", "a" * 257, "m\n"])
def test_model_name_rejected(model: str) -> None:
    assert reject(request(model=model)).field == "model"


def test_model_name_accepted() -> None:
    for model in ["m", "org/model-1.5B_v2", "local:path@rev", "a" * 256]:
        assert parse_batch_request(request(model=model)).model == model


def test_metadata_limits() -> None:
    ok = {f"k{i}": "v" * 512 for i in range(16)}
    ok["k" * 64] = ok.pop("k0")
    assert parse_batch_request(request(metadata=ok)).metadata == ok
    assert reject(request(metadata={f"k{i}": "v" for i in range(17)})).field == "metadata"
    assert reject(request(metadata={"k" * 65: "v"})).field == "metadata (key)"
    assert reject(request(metadata={"k": "v" * 513})).field == "metadata.k"
    assert reject(request(metadata={"k": 1})).field == "metadata.k"
    assert reject(request(metadata={"": "v"})).field == "metadata (key)"


@pytest.mark.parametrize(
    ("priority", "ok"),
    [(0, True), (9, True), (5, True), (-1, False), (10, False), ("5", False), (True, False), (5.0, False)],
)
def test_priority_range_and_type(priority: Any, ok: bool) -> None:
    if ok:
        assert parse_batch_request(request(priority=priority)).priority == priority
    else:
        assert reject(request(priority=priority)).field == "priority"


@pytest.mark.parametrize("tenant", ["default", "a", "team-1", "x" * 64])
def test_tenant_accepted(tenant: str) -> None:
    assert parse_batch_request(request(tenant=tenant)).tenant == tenant


@pytest.mark.parametrize("tenant", ["", "Team", "-a", "a-", "a_b", "a/b", "x" * 65])
def test_tenant_rejected(tenant: str) -> None:
    assert reject(request(tenant=tenant)).field == "tenant"


@pytest.mark.parametrize(
    ("window", "ok"),
    [
        ("24h", True),
        ("1m", True),
        ("7d", True),
        ("90s", True),
        ("8d", False),
        ("30s", False),
        ("0h", False),
        ("24", False),
        ("1w", False),
        ("h", False),
        ("-1h", False),
    ],
)
def test_completion_window(window: str, ok: bool) -> None:
    if ok:
        assert parse_batch_request(request(completion_window=window)).completion_window == window
    else:
        assert reject(request(completion_window=window)).field == "completion_window"


def test_deadline_must_be_aware_and_is_normalised_to_utc() -> None:
    assert reject(request(deadline="2030-01-01T00:00:00")).field == "deadline"
    assert reject(request(deadline="tomorrow")).field == "deadline"
    req = parse_batch_request(request(deadline="2030-01-01T02:00:00+02:00"))
    assert req.deadline == datetime(2030, 1, 1, tzinfo=UTC)
    assert req.deadline is not None
    assert req.deadline.utcoffset() == timedelta(0)
    assert '"deadline":"2030-01-01T00:00:00Z"' in req.model_dump_json()


def test_effective_deadline_combinations() -> None:
    accepted = NOW
    assert parse_batch_request(request()).effective_deadline(accepted) == NOW + timedelta(hours=24)
    assert parse_batch_request(request(completion_window="2h")).effective_deadline(
        accepted
    ) == NOW + timedelta(hours=2)
    far = NOW + timedelta(days=3)
    assert parse_batch_request(request(deadline=far)).effective_deadline(accepted) == far
    near = NOW + timedelta(minutes=30)
    both = parse_batch_request(request(deadline=near, completion_window="2h"))
    assert both.effective_deadline(accepted) == near
    both_late = parse_batch_request(request(deadline=far, completion_window="2h"))
    assert both_late.effective_deadline(accepted) == NOW + timedelta(hours=2)


def test_check_deadline_is_separate_from_parsing() -> None:
    past = parse_batch_request(request(deadline=NOW - timedelta(seconds=1)))  # redelivery: still parses
    with pytest.raises(SchemaError) as info:
        check_deadline(past, now=NOW)
    assert (info.value.reason, info.value.field) == (Reason.DEADLINE_PASSED, "deadline")
    with pytest.raises(SchemaError):
        check_deadline(parse_batch_request(request(deadline=NOW)), now=NOW)
    check_deadline(parse_batch_request(request(deadline=NOW + timedelta(seconds=1))), now=NOW)
    check_deadline(parse_batch_request(request()), now=NOW)
    other_tz = timezone(timedelta(hours=-5))
    check_deadline(
        parse_batch_request(request(deadline=datetime(2026, 1, 1, 8, 0, tzinfo=other_tz))), now=NOW
    )


def test_inline_lines_must_match_endpoint_model_and_be_unique() -> None:
    mismatch = reject(request(input_uri=None, requests=[line(), line("r2", url="/v1/completions")]))
    assert (mismatch.reason, mismatch.field) == (Reason.URL_MISMATCH, "requests[1].url")
    dup = reject(request(input_uri=None, requests=[line("a"), line("b"), line("a")]))
    assert (dup.reason, dup.field) == (Reason.DUPLICATE_CUSTOM_ID, "requests[2].custom_id")
    model = reject(request(input_uri=None, requests=[line(model="other")]))
    assert (model.reason, model.field) == (Reason.MODEL_MISMATCH, "requests[0].body.model")
    bad_body = reject(request(input_uri=None, requests=[line(), line("r2", temperature=7)]))
    assert (bad_body.reason, bad_body.field) == (Reason.INVALID_FIELD, "requests[1].body.temperature")


def test_inline_limits_by_count_and_bytes() -> None:
    req = parse_batch_request(request(input_uri=None, requests=[line(f"r{i}") for i in range(5)]))
    check_inline_limits(req, InlineLimits(max_requests=5))
    with pytest.raises(SchemaError) as info:
        check_inline_limits(req, InlineLimits(max_requests=4))
    assert (info.value.reason, info.value.field) == (Reason.LIMIT_EXCEEDED, "requests")
    assert "input_uri" in info.value.message
    size = req.inline_size_bytes()
    check_inline_limits(req, InlineLimits(max_bytes=max(size, 1024)))
    big = parse_batch_request(
        request(input_uri=None, requests=[line(f"r{i}", user="u" * 200) for i in range(8)])
    )
    with pytest.raises(SchemaError, match="bytes"):
        check_inline_limits(big, InlineLimits(max_bytes=1024))
    check_inline_limits(parse_batch_request(request()), InlineLimits(max_requests=1, max_bytes=1024))


def test_inline_limits_defaults_and_bounds() -> None:
    limits = InlineLimits()
    assert (limits.max_requests, limits.max_bytes) == (1000, 1 << 20)
    with pytest.raises(ValidationError, match="max_requests"):
        InlineLimits(max_requests=0)


def test_check_submittable_applies_both() -> None:
    req = parse_batch_request(request(input_uri=None, requests=[line("a"), line("b")], deadline=NOW))
    with pytest.raises(SchemaError, match="limit"):
        check_submittable(req, InlineLimits(max_requests=1), now=NOW - timedelta(hours=1))
    with pytest.raises(SchemaError, match="future"):
        check_submittable(req, InlineLimits(), now=NOW)
    check_submittable(req, None, now=NOW - timedelta(hours=1))


def test_unknown_fields_rejected_on_commands() -> None:
    error = reject(request(priorty=3))
    assert (error.reason, error.field) == (Reason.UNKNOWN_FIELD, "priorty")


def test_parse_batch_request_from_bytes_and_bad_json() -> None:
    assert (
        parse_batch_request(BatchRequest.model_validate(request()).model_dump_json().encode()).batch_id
        == "b-1"
    )
    with pytest.raises(SchemaError) as info:
        parse_batch_request(b"{nope")
    assert info.value.reason == Reason.INVALID_JSON


def test_cancel_request() -> None:
    cancel = CancelRequest(batch_id="b-1", reason="no longer needed", requested_by="svc")
    assert cancel.model_dump() == {
        "batch_id": "b-1",
        "tenant": "default",
        "reason": "no longer needed",
        "requested_by": "svc",
    }
    with pytest.raises(ValidationError, match="tenant"):
        CancelRequest(batch_id="b", tenant="Not A Tenant")
    with pytest.raises(ValidationError, match="batch_id"):
        CancelRequest(batch_id="bad id")
    with pytest.raises(ValidationError, match="reason"):
        CancelRequest(batch_id="b", reason="x" * 1025)
    with pytest.raises(ValidationError, match="why"):
        CancelRequest.model_validate({"batch_id": "b", "why": "x"})
