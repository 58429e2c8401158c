"""Operator tools, pure parts: replay planning, records, pacing, parsing, job views (no services)."""

from __future__ import annotations

import struct
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import pytest

from llmbatch.dispatcher.domain.batch_record import BatchRecord
from llmbatch.dispatcher.domain.dlt import OriginalRecord, build_dead_letter
from llmbatch.dispatcher.domain.keys import batch_key
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.ops.common import OpsError, parse_when, safe_url
from llmbatch.dispatcher.ops.dlq_reader import DeadLetterView, decode_payload, describe_header, parse_locator
from llmbatch.dispatcher.ops.jobs import detail_of, summary_of, timeline_of
from llmbatch.dispatcher.ops.replay import (
    Decision,
    LedgerEntry,
    RateLimiter,
    ReplayFilter,
    Summary,
    build_record,
    parse_rate,
    plan,
    replay_id_for,
)
from llmbatch.schemas import dlt
from llmbatch.schemas.batch import CancelRequest
from llmbatch.schemas.dlt import ReplayInfo
from tests.support.dispatcher_kit import batch_request, request_message

pytestmark = pytest.mark.unit

REQUESTS = "llm.batch.requests.v1"
DLT = "llm.batch.requests.v1.dlt"
T0 = datetime(2026, 1, 10, 12, 0, tzinfo=UTC)


def letter(
    batch_id: str = "b-1",
    *,
    offset: int = 0,
    reason: str = "input_not_found",
    minutes: int = 0,
    cancel: bool = False,
    original_topic: str = REQUESTS,
    replayed: ReplayInfo | None = None,
) -> DeadLetterView:
    data = CancelRequest(batch_id=batch_id) if cancel else batch_request(batch_id)
    extra = replayed.to_headers() if replayed else []
    key, value, headers = request_message(data, event_id=f"ev-{batch_id}", extra_headers=extra)
    origin = OriginalRecord(original_topic, 1, 40 + offset, key, value, tuple(headers), 1_700_000_000_000, 0)
    dead = build_dead_letter(origin, dlt_topic=DLT, reason=reason, group_id="g", fqcn="x.Y", message="boom")
    ts = int((T0 + timedelta(minutes=minutes)).timestamp() * 1000)
    return DeadLetterView(
        DLT,
        0,
        offset,
        ts,
        dead.key,
        dead.value,
        tuple(dead.headers),
        dlt.DltRecord.from_headers(dead.headers),
    )


def entry(replay_id: str = "rp-old-1", round_: int = 1) -> LedgerEntry:
    return LedgerEntry(replay_id=replay_id, round=round_, at=T0, by="ops@host", to_topic=REQUESTS)


def decide(
    letters: list[DeadLetterView], states: dict[str, State | None] | None = None, **kw: Any
) -> list[Any]:
    by_key = {batch_key(None, batch_id): state for batch_id, state in (states or {}).items()}
    return plan(letters, ledger=kw.pop("ledger", {}), states=by_key, default_topic=REQUESTS, **kw)


# --- planning ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        (None, Decision.REPLAY),
        (State.DEAD_LETTERED, Decision.REPLAY),
        (State.FAILED, Decision.REPLAY),
        (State.COMPLETED, Decision.REFUSED),
        (State.CANCELLED, Decision.REFUSED),
        (State.EXPIRED, Decision.REFUSED),
        (State.QUEUED, Decision.REFUSED),
        (State.RUNNING, Decision.REFUSED),
    ],
)
def test_decision_follows_the_batch_state(state: State | None, expected: Decision) -> None:
    [item] = decide([letter("b-1")], {"b-1": state})
    assert item.decision is expected, item.why
    assert item.why


def test_force_replays_refused_but_not_already_replayed() -> None:
    letters = [letter("done", offset=0), letter("again", offset=1)]
    ledger = {"0:1": entry()}
    items = decide(letters, {"done": State.COMPLETED, "again": State.FAILED}, ledger=ledger, force=True)
    assert [i.decision for i in items] == [Decision.REPLAY, Decision.ALREADY_REPLAYED]
    assert items[0].why.startswith("forced: batch already completed")
    assert items[1].replay_id == "rp-old-1"


def test_include_replayed_replays_again_under_a_new_id() -> None:
    v = letter("b-1")
    [item] = decide(
        [v], {"b-1": State.FAILED}, ledger={"0:0": entry(replay_id_for(v, 1), 1)}, include_replayed=True
    )
    assert item.decision is Decision.REPLAY and item.round == 2
    assert item.replay_id == replay_id_for(v, 2) != replay_id_for(v, 1)


def test_cancel_commands_replay_whatever_the_state() -> None:
    [item] = decide([letter("b-1", cancel=True)], {"b-1": State.COMPLETED})
    assert item.decision is Decision.REPLAY


def test_target_topic_original_or_override() -> None:
    v = letter(original_topic="other.requests")
    assert decide([v])[0].target_topic == "other.requests"
    assert decide([v], to_topic="staging.requests")[0].target_topic == "staging.requests"


def test_replay_id_is_deterministic_per_dead_letter() -> None:
    a, b = letter("b-1", offset=3), letter("b-1", offset=4)
    assert replay_id_for(a) == replay_id_for(letter("zzz", offset=3))  # coordinates, not content
    assert replay_id_for(a) != replay_id_for(b)
    assert replay_id_for(a).startswith("rp-") and replay_id_for(a).endswith("-1")


def test_filter_reason_key_time_and_limit_oldest_first() -> None:
    letters = [
        letter(f"b-{i}", offset=i, minutes=i, reason="invalid_event" if i % 2 else "input_not_found")
        for i in range(6)
    ]
    assert [v.key_text for v in ReplayFilter(reasons=frozenset({"invalid_event"})).select(letters)] == [
        "b-1",
        "b-3",
        "b-5",
    ]
    by_key = ReplayFilter(keys=frozenset({"b-2", "b-4"}))
    assert [v.key_text for v in by_key.select(letters)] == ["b-2", "b-4"]
    window = ReplayFilter(since=T0 + timedelta(minutes=2), until=T0 + timedelta(minutes=4))
    assert [v.offset for v in window.select(letters)] == [2, 3, 4]
    assert [v.offset for v in ReplayFilter(limit=2).select(letters)] == [0, 1]


def test_summary_counts() -> None:
    letters = [letter("a", offset=0), letter("b", offset=1), letter("c", offset=2)]
    items = decide(letters, {"b": State.COMPLETED}, ledger={"0:2": entry()})
    summary = Summary.of(items, dry_run=True)
    assert (summary.selected, summary.to_replay, summary.refused, summary.already_replayed) == (3, 1, 1, 1)
    assert summary.to_json()["by_reason"] == {"input_not_found": 3}


# --- the record --------------------------------------------------------------------------------------------


def test_replayed_record_keeps_payload_and_ce_id_and_adds_provenance() -> None:
    earlier = ReplayInfo(replay_id="rp-earlier", replayed_at=T0, replayed_by="someone")
    v = letter("b-1", replayed=earlier)
    [item] = decide([v])
    info = ReplayInfo(replay_id=item.replay_id, replayed_at=T0 + timedelta(hours=1), replayed_by="ops@host")
    record = build_record(item, info)
    assert (record.topic, record.key, record.value) == (REQUESTS, v.key, v.value)
    names = [n for n, _ in record.headers]
    assert not (set(names) & dlt.DLT_HEADERS)
    assert names.count(dlt.REPLAY_ID) == 1  # the earlier replay's headers are replaced
    headers = dict(record.headers)
    assert headers["ce_id"] == b"ev-b-1"
    assert headers[dlt.REPLAY_ID] == item.replay_id.encode()
    assert headers[dlt.REPLAY_BY] == b"ops@host"
    assert ReplayInfo.from_headers(record.headers) == info
    assert v.previous_replay == earlier


def test_with_the_replay_key_the_record_is_signed_for_its_original_event() -> None:
    key = b"s" * 32
    [item] = decide([letter("b-1")])
    info = ReplayInfo(replay_id=item.replay_id, replayed_at=T0, replayed_by="ops@host")
    record = build_record(item, info, key)
    back = ReplayInfo.from_headers(record.headers)
    headers = dict(record.headers)
    assert back is not None and back.signature is not None
    assert back.verify(key, source=headers["ce_source"].decode(), event_id="ev-b-1")
    assert not back.verify(key, source=headers["ce_source"].decode(), event_id="ev-b-2")
    assert dlt.REPLAY_SIG not in dict(build_record(item, info).headers)  # no key: unsigned, as before


# --- pacing --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "per_second"),
    [("10", 10.0), ("10/s", 10.0), ("2.5/s", 2.5), ("120/m", 2.0), ("0", None), (None, None)],
)
def test_parse_rate(text: str | None, per_second: float | None) -> None:
    assert parse_rate(text) == per_second


@pytest.mark.parametrize("text", ["fast", "10/h", "-1", "1/s/s"])
def test_parse_rate_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="--rate"):
        parse_rate(text)


async def test_rate_limiter_spaces_calls() -> None:
    now = [100.0]
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    limiter = RateLimiter(4.0, clock=lambda: now[0], sleep=sleep)
    for _ in range(5):
        await limiter.acquire()
    assert slept == pytest.approx([0.25, 0.25, 0.25, 0.25])
    assert now[0] == pytest.approx(101.0)
    unlimited = RateLimiter(None, clock=lambda: now[0], sleep=sleep)
    assert await unlimited.acquire() == 0.0


# --- parsing and display --------------------------------------------------------------------------------


def test_parse_when_durations_and_times() -> None:
    now = datetime(2026, 1, 10, tzinfo=UTC)
    assert parse_when("90s", "--since", now=now) == now - timedelta(seconds=90)
    assert parse_when("2h", "--since", now=now) == now - timedelta(hours=2)
    assert parse_when("1w", "--since", now=now) == now - timedelta(days=7)
    assert parse_when("2026-01-01T00:00:00Z", "--until") == datetime(2026, 1, 1, tzinfo=UTC)
    assert parse_when(None, "--since") is None
    for bad in ("yesterday", "2026-01-01T00:00:00"):
        with pytest.raises(OpsError) as info:
            parse_when(bad, "--since")
        assert info.value.code == 2 and "--since" in str(info.value)


def test_parse_locator() -> None:
    assert parse_locator("2:17") == (2, 17)
    assert parse_locator("17") == (None, 17)
    assert parse_locator("batch-17") is None
    assert parse_locator("a:1") is None


def test_header_and_payload_decoding() -> None:
    assert describe_header(dlt.ORIGINAL_OFFSET, struct.pack(">q", 42))["value"] == 42
    assert describe_header(dlt.ORIGINAL_PARTITION, struct.pack(">i", 3))["value"] == 3
    assert describe_header("ce_id", b"abc") == {"name": "ce_id", "value": "abc", "encoding": "utf-8"}
    assert describe_header("bin", b"\xff\x00")["encoding"] == "base64"
    assert decode_payload(b'{"a": 1}') == {"a": 1}
    assert decode_payload(b"{not json") == {"not_json": "{not json"}
    assert decode_payload(None) is None


def test_dead_letter_view_reads_spring_headers() -> None:
    v = letter("b-9", offset=5, reason="invalid_event")
    assert v.coordinate == "0:5" and v.reason == "invalid_event" and v.key_text == "b-9"
    assert v.record is not None and v.record.original_offset == 45 and v.record.consumer_group == "g"
    assert v.event_id == "ev-b-9" and v.validation_now() is None
    broken = DeadLetterView(DLT, 0, 6, None, b"b-9", b"{nope", v.headers, v.record)
    assert broken.validation_now() is not None and broken.full()["valid_now"] is False


def test_safe_url_hides_password() -> None:
    assert safe_url("redis://:hunter2@h:6379/0") == "redis://:***@h:6379/0"
    assert "hunter2" not in safe_url("redis://user:hunter2@h/0")
    assert safe_url("redis://h:1/0") == "redis://h:1/0"


# --- job views ---------------------------------------------------------------------------------------------


def _record(state: State, **fields: Any) -> BatchRecord:
    base = {
        "state": state.value,
        "version": "7",
        "tenant": "acme",
        "model": "m",
        "attempt": "2",
        "attempt_base": "0",
        "accepted_at": "1000.0",
        "total": "5",
        "metadata": orjson.dumps({"k": "v"}).decode(),
    }
    base.update({k: str(v) for k, v in fields.items()})
    return BatchRecord.from_hash(batch_key("acme", "b-1"), base)


def test_job_views_of_a_finished_batch() -> None:
    outcome = {
        "state": "completed",
        "finished_at": 1100.0,
        "output_uris": ["s3://r/acme/b-1/output-a2-00000.jsonl"],
        "error_uris": [],
        "manifest_uri": "s3://r/acme/b-1/manifest.json",
        "counts": {"total": 5, "completed": 4, "failed": 1},
        "usage": {"prompt_tokens": 50, "completion_tokens": 80},
    }
    record = _record(
        State.COMPLETED,
        submitted_at=1010.0,
        running_at=1020.0,
        job_ended_at=1090.0,
        finished_at=1100.0,
        state_at=1100.0,
        submission_id="b-1-a2",
        outcome=orjson.dumps(outcome).decode(),
        last_error_code="job_lost",
        last_error_message="ray forgot it",
        published="1",
    )
    summary = summary_of(record)
    assert (summary.counts.completed, summary.counts.failed, summary.counts.total) == (4, 1, 5)
    detail = detail_of(record)
    assert [a.submission_id for a in detail.attempts] == ["b-1-a1", "b-1-a2"] and detail.attempts[1].current
    assert detail.usage.completion_tokens == 80 and detail.output_uris == outcome["output_uris"]
    assert detail.last_error is not None and detail.last_error.code == "job_lost"
    assert detail.terminal_event_published is True and detail.metadata == {"k": "v"}
    steps = [e.step for e in timeline_of(record)]
    assert steps == ["queued", "submitted", "running", "finalizing", "completed"]


def test_job_views_of_a_running_batch_use_live_counters() -> None:
    record = _record(State.RUNNING, submitted_at=1010.0, running_at=1020.0, state_at=1020.0)
    summary = summary_of(record, {"completed": "3", "failed": "0", "total": "5", "completion_tokens": "9"})
    assert (summary.counts.completed, summary.counts.total) == (3, 5)
    assert detail_of(record, {"completion_tokens": "9"}).usage.completion_tokens == 9
    assert timeline_of(record)[-1].step == "running"


def test_jobs_get_says_when_a_running_batch_ends_and_whether_that_misses_its_deadline() -> None:
    # 25 of 100 answered in the 100 s since it first started: 300 s more at that rate
    record = _record(State.RUNNING, total=100, started_at=1000.0, deadline=1250.0, state_at=1000.0)
    progress = {"completed": "20", "failed": "5", "total": "100"}
    late = detail_of(record, progress, now=1100.0)
    assert late.expected_finish_at is not None and late.expected_finish_at.timestamp() == 1400.0
    assert late.at_risk
    on_time = detail_of(
        _record(State.RUNNING, total=100, started_at=1000.0, deadline=1500.0), progress, now=1100.0
    )
    assert on_time.expected_finish_at == late.expected_finish_at and not on_time.at_risk
    # before its first answer, and once it ended, nothing is said
    assert detail_of(record, {"total": "100"}, now=1100.0).expected_finish_at is None
    ended = detail_of(_record(State.COMPLETED, started_at=1000.0, deadline=1050.0), progress, now=1100.0)
    assert ended.expected_finish_at is None and not ended.at_risk
