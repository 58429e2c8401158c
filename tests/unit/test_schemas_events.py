"""Event registry, result event models, job contract, DLT headers."""

from __future__ import annotations

import struct
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import ValidationError

from llmbatch.schemas import (
    EVENT_DATA_MODELS,
    REQUEST_EVENT_TYPES,
    RESULT_EVENT_TYPES,
    TERMINAL_EVENT_TYPES,
    TERMINAL_TYPE_BY_STATUS,
    BatchCancelled,
    BatchCompleted,
    BatchExpired,
    BatchFailed,
    BatchRejected,
    BatchRequest,
    BatchStatus,
    DltReason,
    DltRecord,
    EngineConfig,
    ErrorObject,
    EventType,
    JobSpec,
    Manifest,
    ReplayInfo,
    SchemaError,
    TerminalEventData,
    dlt,
    event_type_for,
    output_prefix,
    parse_job_spec,
    parse_manifest,
    shard_name,
    submission_id,
)

pytestmark = pytest.mark.unit

T0 = datetime(2026, 3, 1, tzinfo=UTC)


def terminal(**overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "batch_id": "b",
        "model": "m",
        "accepted_at": T0,
        "finished_at": T0 + timedelta(hours=1),
    }
    data.update(overrides)
    return data


def test_event_type_values_are_the_contract() -> None:
    assert {t.value for t in EventType} == {
        "llmbatch.batch.requested.v1",
        "llmbatch.batch.cancel_requested.v1",
        "llmbatch.batch.accepted.v1",
        "llmbatch.batch.progress.v1",
        "llmbatch.batch.completed.v1",
        "llmbatch.batch.failed.v1",
        "llmbatch.batch.cancelled.v1",
        "llmbatch.batch.expired.v1",
        "llmbatch.batch.rejected.v1",
    }
    assert set(EventType) == REQUEST_EVENT_TYPES | RESULT_EVENT_TYPES
    assert not REQUEST_EVENT_TYPES & RESULT_EVENT_TYPES
    assert {t for t in EventType if t.is_terminal} == TERMINAL_EVENT_TYPES
    assert len(TERMINAL_EVENT_TYPES) == 4


def test_a_rejection_is_final_only_when_no_batch_will_end_later() -> None:
    def rejected(status: BatchStatus | None) -> BatchRejected:
        return BatchRejected(
            batch_id="b",
            error=ErrorObject(code="invalid_field", message="m", param="model"),
            batch_status=status,
            rejected_at=T0,
        )

    assert not EventType.REJECTED.is_terminal
    assert rejected(None).is_final and rejected(BatchStatus.DEAD_LETTERED).is_final
    assert rejected(BatchStatus.COMPLETED).is_final
    assert not rejected(BatchStatus.RUNNING).is_final and not rejected(BatchStatus.QUEUED).is_final


def test_registry_is_a_bijection() -> None:
    assert set(EVENT_DATA_MODELS) == set(EventType)
    assert len(set(EVENT_DATA_MODELS.values())) == len(EVENT_DATA_MODELS)
    for event_type, model in EVENT_DATA_MODELS.items():
        assert event_type_for(model) is event_type
    assert event_type_for(BatchRequest) is EventType.BATCH_REQUESTED
    with pytest.raises(KeyError, match="TerminalEventData"):
        event_type_for(TerminalEventData)


def test_terminal_models_fix_their_status() -> None:
    for status, event_type in TERMINAL_TYPE_BY_STATUS.items():
        model = EVENT_DATA_MODELS[event_type]
        extra = {"error": {"code": "x", "message": "y"}} if status is BatchStatus.FAILED else {}
        instance = model.model_validate(terminal(**extra))
        assert isinstance(instance, TerminalEventData)
        assert instance.status is status
        assert status.is_terminal
    assert not BatchStatus.RUNNING.is_terminal


def test_failed_needs_an_error_others_do_not() -> None:
    with pytest.raises(ValidationError, match="error"):
        BatchFailed.model_validate(terminal())
    assert BatchCancelled.model_validate(terminal()).error is None
    assert (
        BatchExpired.model_validate(terminal(error={"code": "deadline", "message": "late"})).error is not None
    )


def test_terminal_fields_validated() -> None:
    with pytest.raises(ValidationError):
        BatchCompleted.model_validate(terminal(output_uris=["not-a-uri"]))
    with pytest.raises(ValidationError):
        BatchCompleted.model_validate(terminal(attempts=-1))
    with pytest.raises(ValidationError):
        BatchCompleted.model_validate(terminal(finished_at="2026-03-01T00:00:00"))  # no offset
    with pytest.raises(ValidationError):
        BatchCompleted.model_validate(terminal(request_counts={"total": 1, "completed": 2}))
    ok = BatchCompleted.model_validate(terminal(metadata={"k": "v"}, tenant="acme"))
    assert (ok.metadata, ok.tenant, ok.status) == ({"k": "v"}, "acme", BatchStatus.COMPLETED)


# ------------------------------------------------------------------------------ job contract


def job(**overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "batch_id": "b-1",
        "attempt": 1,
        "endpoint": "/v1/completions",
        "model": "m",
        "input_uri": "s3://inputs/x.jsonl",
        "output_prefix": "s3://results/default/b-1/",
    }
    data.update(overrides)
    return data


def test_job_spec_rules_and_helpers() -> None:
    spec = parse_job_spec(JobSpec.model_validate(job()).model_dump_json())
    assert spec.submission_id == "b-1-a1" == submission_id("b-1", 1)
    assert spec.manifest_uri == "s3://results/default/b-1/manifest.json"
    assert spec.engine == EngineConfig()
    assert output_prefix("results", "default", "b-1") == spec.output_prefix
    later = parse_job_spec(_json(job(lifecycle="abc", output_prefix="s3://results/default/b-1/abc/")))
    assert later.submission_id == "b-1-abc-a1" == submission_id("b-1", 1, "abc")
    assert later.output_prefix == output_prefix("results", "default", "b-1", "abc")
    for bad in (
        job(attempt=0),
        job(output_prefix="s3://results/default/other/"),
        job(output_prefix="s3://results/default/b-1"),
        job(lifecycle="abc"),  # a lifecycle's prefix ends with it
        job(lifecycle="Not-Valid", output_prefix="s3://results/default/b-1/Not-Valid/"),
        job(
            requests=[{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p"}}]
        ),
        job(input_uri=None),
        job(engine={"replicas": 0}),
        job(engine={"dtype": "int4"}),
        job(engine={"unknown": 1}),
    ):
        with pytest.raises(SchemaError):
            parse_job_spec(_json(bad))


def _json(data: dict[str, Any]) -> str:
    import json

    return json.dumps(data)


def test_engine_config_defaults_suit_cpu() -> None:
    config = EngineConfig(engine_kwargs={"gpu_memory_utilization": 0.9})
    assert config.num_gpus_per_replica == 0
    assert config.engine_kwargs == {"gpu_memory_utilization": 0.9}


def test_manifest_round_trip_and_uris() -> None:
    manifest = Manifest.model_validate(
        {
            "batch_id": "b-1",
            "attempt": 2,
            "status": "completed",
            "request_counts": {"total": 3, "completed": 2, "failed": 1},
            "usage": {"prompt_tokens": 5, "completion_tokens": 6},
            "output_shards": [{"uri": "s3://res/default/b-1/output-00000.jsonl", "lines": 2, "attempt": 2}],
            "error_shards": [{"uri": "s3://res/default/b-1/error-00000.jsonl", "lines": 1}],
            "attempts": [
                {"attempt": 1, "submission_id": "b-1-a1", "status": "failed"},
                {"attempt": 2, "submission_id": "b-1-a2", "status": "completed", "completed": 2},
            ],
            "timings": {
                "started_at": T0,
                "finished_at": T0 + timedelta(seconds=30),
                "engine_start_s": 19.5,
                "generation_s": 8.0,
            },
        }
    )
    again = parse_manifest(manifest.to_json())
    assert again == manifest
    assert again.output_uris == ["s3://res/default/b-1/output-00000.jsonl"]
    assert again.error_uris == ["s3://res/default/b-1/error-00000.jsonl"]
    assert again.finished_at - again.started_at == timedelta(seconds=30)
    assert shard_name("output", 0) == "output-00000.jsonl"
    assert shard_name("error", 12) == "error-00012.jsonl"
    with pytest.raises(SchemaError):
        parse_manifest(b'{"batch_id": "b-1", "attempt": 1, "status": "running", "timings": {}}')
    with pytest.raises(SchemaError):
        parse_manifest(b"not json")


# ------------------------------------------------------------------------------ DLT


def test_dlt_header_names_are_spring_compatible() -> None:
    assert dlt.ORIGINAL_TOPIC == "kafka_dlt-original-topic"
    assert dlt.ORIGINAL_PARTITION == "kafka_dlt-original-partition"
    assert dlt.ORIGINAL_OFFSET == "kafka_dlt-original-offset"
    assert dlt.ORIGINAL_CONSUMER_GROUP == "kafka_dlt-original-consumer-group"
    assert dlt.ORIGINAL_TIMESTAMP == "kafka_dlt-original-timestamp"
    assert dlt.EXCEPTION_FQCN == "kafka_dlt-exception-fqcn"
    assert dlt.EXCEPTION_MESSAGE == "kafka_dlt-exception-message"
    assert dlt.REASON == "llmbatch-dlt-reason"
    assert (dlt.REPLAY_ID, dlt.REPLAY_AT, dlt.REPLAY_BY) == (
        "llmbatch-replay-id",
        "llmbatch-replay-at",
        "llmbatch-replay-by",
    )
    assert {"invalid_event", "input_not_found", "attempts_exhausted"} <= {r.value for r in DltReason}


def test_dlt_record_binary_encoding_and_round_trip() -> None:
    record = DltRecord(
        reason=DltReason.INVALID_EVENT,
        original_topic="llm.batch.requests.v1",
        original_partition=2,
        original_offset=1234567890123,
        original_timestamp_ms=1_700_000_000_000,
        consumer_group="dispatcher",
        exception_fqcn="llmbatch.schemas.errors.SchemaError",
        exception_message="data.priority: too big",
    )
    headers = record.to_headers()
    found = dict(headers)
    assert found["kafka_dlt-original-partition"] == struct.pack(">i", 2)
    assert found["kafka_dlt-original-offset"] == struct.pack(">q", 1234567890123)
    assert found["kafka_dlt-original-timestamp"] == struct.pack(">q", 1_700_000_000_000)
    assert found["llmbatch-dlt-reason"] == b"invalid_event"
    original = [("ce_id", b"1"), ("ce_type", b"llmbatch.batch.requested.v1")]
    assert DltRecord.from_headers(original + headers) == record
    assert DltRecord.from_headers(original) is None
    assert dlt.strip_dlt_headers(original + headers) == original


def test_dlt_record_decodes_leniently() -> None:
    headers = [
        ("kafka_dlt-original-topic", b"t"),
        ("kafka_dlt-original-partition", b"7"),
        ("kafka_dlt-original-offset", b"\x01"),
        ("llmbatch-dlt-reason", b"brand_new_reason"),
        ("kafka_dlt-exception-message", b"\xff" + b"m" * 5000),
    ]
    record = DltRecord.from_headers(headers)
    assert record is not None
    assert (record.original_partition, record.original_offset, record.reason) == (7, 0, "brand_new_reason")
    assert record.exception_message is not None
    assert len(record.exception_message) == 4096
    assert dlt.truncate_message("x" * 5000).endswith("...")


def test_replay_info_round_trip() -> None:
    info = ReplayInfo(replay_id="r-1", replayed_at=T0, replayed_by="alice")
    headers = info.to_headers()
    assert dict(headers)["llmbatch-replay-at"] == b"2026-03-01T00:00:00Z"
    assert ReplayInfo.from_headers(headers) == info
    assert ReplayInfo.from_headers([("llmbatch-replay-id", b"x")]) is None
    assert ReplayInfo.from_headers([*headers[:1], ("llmbatch-replay-at", b"bad"), headers[2]]) is None
    assert dlt.strip_dlt_headers([*headers, ("x", b"y")]) == [("x", b"y")]
