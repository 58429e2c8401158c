"""Read models of batches for operators: what Redis knows about each batch, as typed views.

:func:`summary_of` and :func:`detail_of` are pure (a :class:`~llmbatch.dispatcher.state.store.BatchRecord`
plus the
job's progress counters in, a pydantic view out); :func:`list_jobs` and :func:`get_job` query Redis
through :class:`~llmbatch.dispatcher.state.store.StateStore` and the key names of
:mod:`llmbatch.dispatcher.domain.keys`.

The batch hash keeps the latest time of each step (``accepted_at``, ``submitted_at``,
``running_at``, ``job_ended_at``, ``finished_at``, ...), so the timeline shown is "when the batch last
entered each state"; earlier attempts are listed by their Ray submission ids. The full event
history is on the results topic (``llmbatch watch ID --since 7d``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, cast

import orjson
from pydantic import BaseModel, Field

from llmbatch.dispatcher.domain.batch_record import BatchRecord
from llmbatch.dispatcher.domain.keys import BatchKey, batch_key
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.errors import StateStoreUnavailable, classify
from llmbatch.dispatcher.ops.common import from_ts
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.schemas.deadlines import outlook
from llmbatch.schemas.job import submission_id


class Counts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class Tokens(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class ErrorInfo(BaseModel):
    code: str
    message: str


class TimelineEntry(BaseModel):
    step: str = Field(description="A state, or a note such as 'cancel requested'.")
    at: datetime
    detail: str | None = None


class AttemptInfo(BaseModel):
    attempt: int
    submission_id: str
    current: bool


class JobSummary(BaseModel):
    """One row of ``llmbatch jobs list``."""

    batch_id: str
    state: State
    state_at: datetime | None
    tenant: str
    model: str
    attempt: int
    counts: Counts
    error_code: str | None = None


class JobDetail(JobSummary):
    """Everything ``llmbatch jobs get`` shows."""

    endpoint: str | None = None
    priority: int | None = None
    input_uri: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    accepted_at: datetime | None = None
    deadline: datetime | None = None
    expected_finish_at: datetime | None = Field(
        default=None,
        description="When a running batch ends at its rate so far (unknown before its first answer).",
    )
    at_risk: bool = Field(default=False, description="True while it ends after its deadline at that rate.")
    started_at: datetime | None = None
    finished_at: datetime | None = None
    usage: Tokens = Field(default_factory=Tokens)
    attempts: list[AttemptInfo] = Field(default_factory=list)
    timeline: list[TimelineEntry] = Field(default_factory=list)
    output_uris: list[str] = Field(default_factory=list)
    error_uris: list[str] = Field(default_factory=list)
    manifest_uri: str | None = None
    last_error: ErrorInfo | None = None
    dlt_reason: str | None = None
    replay_id: str | None = None
    generation: int = 0
    cancel_requested: bool = False
    terminal_event_id: str | None = None
    terminal_event_published: bool | None = None
    version: int = 0


def _int(value: Any) -> int:
    try:
        return max(0, int(float(value or 0)))
    except (TypeError, ValueError):
        return 0


def _outcome(record: BatchRecord) -> dict[str, Any]:
    raw = record.get("outcome")
    if raw is None:
        return {}
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def counts_of(record: BatchRecord, progress: Mapping[str, str]) -> tuple[Counts, Tokens]:
    """Counts and tokens: the stored outcome of a finished batch, else the job's live counters."""
    outcome = _outcome(record)
    source: Mapping[str, Any] = outcome.get("counts") or progress
    usage: Mapping[str, Any] = outcome.get("usage") or progress
    counts = Counts(
        total=max(_int(source.get("total")), _int(record.get("total"))),
        completed=_int(source.get("completed")),
        failed=_int(source.get("failed")),
    )
    return counts, Tokens(
        prompt_tokens=_int(usage.get("prompt_tokens")), completion_tokens=_int(usage.get("completion_tokens"))
    )


def _last_error(record: BatchRecord) -> ErrorInfo | None:
    pairs = (("error_code", "error_message"), ("last_error_code", "last_error_message"))
    for code_field, message_field in pairs:
        code = record.get(code_field)
        if code:
            return ErrorInfo(code=code, message=record.get(message_field) or "")
    return None


def summary_of(record: BatchRecord, progress: Mapping[str, str] | None = None) -> JobSummary:
    counts, _ = counts_of(record, progress or {})
    error = _last_error(record)
    return JobSummary(
        batch_id=record.batch_id,
        state=record.state,
        state_at=from_ts(record.number("state_at")),
        tenant=record.tenant,
        model=record.get("model", "-") or "-",
        attempt=record.attempt,
        counts=counts,
        error_code=error.code if error else None,
    )


def attempts_of(record: BatchRecord) -> list[AttemptInfo]:
    """Every attempt this batch made, oldest first (numbers keep counting across replays)."""
    return [
        AttemptInfo(
            attempt=n,
            submission_id=submission_id(record.batch_id, n, record.get("lifecycle") or None),
            current=n == record.attempt,
        )
        for n in range(1, record.attempt + 1)
    ]


_STEPS: tuple[tuple[str, str], ...] = (
    ("rejected_at", State.DEAD_LETTERED.value),
    ("accepted_at", State.QUEUED.value),
    ("submitted_at", State.SUBMITTED.value),
    ("running_at", State.RUNNING.value),
    ("cancel_requested_at", "cancel requested"),
    ("stop_requested_at", "stop requested"),
    ("job_ended_at", State.FINALIZING.value),
    ("dlt_written_at", "dead letter written"),
    ("published_at", "terminal event published"),
)


def timeline_of(record: BatchRecord) -> list[TimelineEntry]:
    """When the batch last entered each step, in time order."""
    entries: list[TimelineEntry] = []
    for field, step in _STEPS:
        at = from_ts(record.number(field))
        if at is None:
            continue
        detail = None
        if field == "submitted_at" and record.submission_id:
            detail = record.submission_id
        elif field == "accepted_at":
            detail = f"accepted (generation {record.generation})" if record.generation else "accepted"
        elif field == "stop_requested_at":
            detail = record.get("stop_reason")
        elif field == "cancel_requested_at":
            detail = record.get("cancel_reason")
        entries.append(TimelineEntry(step=step, at=at, detail=detail))
    finished = from_ts(record.number("finished_at"))
    if finished is not None and record.state.is_terminal:
        entries.append(TimelineEntry(step=record.state.value, at=finished))
    elif not any(e.step == record.state.value for e in entries):
        at = from_ts(record.number("state_at"))
        if at is not None:
            entries.append(TimelineEntry(step=record.state.value, at=at))
    entries.sort(key=lambda e: e.at)
    return entries


def outlook_of(record: BatchRecord, counts: Counts, now: float) -> tuple[float | None, bool]:
    """When a running batch ends at its rate since it first started (unix seconds, or ``None``), and
    whether that is after its deadline (:mod:`llmbatch.schemas.deadlines`)."""
    started = record.number("started_at")
    if record.state.is_terminal or started is None:
        return None, False
    seen = outlook(
        counts.completed + counts.failed, counts.total or None, started, record.number("deadline"), now
    )
    return (None if seen.need_s is None else now + seen.need_s), seen.at_risk


def detail_of(
    record: BatchRecord, progress: Mapping[str, str] | None = None, now: float | None = None
) -> JobDetail:
    """Everything known of ``record``; ``now`` (unix seconds, default the clock) for its outlook."""
    counts, usage = counts_of(record, progress or {})
    finish_at, risky = outlook_of(record, counts, time.time() if now is None else now)
    outcome = _outcome(record)
    metadata = record.json_field("metadata") if record.get("metadata") else {}
    published = record.get("published")
    base = summary_of(record, progress)
    return JobDetail(
        **base.model_dump(),
        endpoint=record.get("endpoint"),
        priority=_int(record.get("priority")) if record.get("priority") is not None else None,
        input_uri=record.get("input_uri"),
        metadata={str(k): str(v) for k, v in (metadata or {}).items()},
        accepted_at=from_ts(record.number("accepted_at")),
        deadline=from_ts(record.number("deadline")),
        expected_finish_at=from_ts(finish_at),
        at_risk=risky,
        started_at=from_ts(record.number("started_at")),
        finished_at=from_ts(record.number("finished_at")),
        usage=usage,
        attempts=attempts_of(record),
        timeline=timeline_of(record),
        output_uris=list(outcome.get("output_uris") or []),
        error_uris=list(outcome.get("error_uris") or []),
        manifest_uri=outcome.get("manifest_uri"),
        last_error=_last_error(record),
        dlt_reason=record.get("dlt_reason") or outcome.get("dlt_reason"),
        replay_id=record.get("replay_id"),
        generation=record.generation,
        cancel_requested=record.flag("cancel_requested"),
        terminal_event_id=record.get("terminal_event_id"),
        terminal_event_published=(published == "1") if published is not None else None,
        version=record.version,
    )


# --- queries ---------------------------------------------------------------------------------------


async def _progress_many(store: StateStore, records: Sequence[BatchRecord]) -> list[dict[str, str]]:
    live = [r for r in records if not r.state.is_terminal]
    if not live:
        return [{} for _ in records]
    found: dict[BatchKey, dict[str, str]] = {}
    for record in live:  # few live batches per page; one round trip each keeps it simple
        found[record.key] = await store.read_progress(record.key)
    return [found.get(r.key, {}) for r in records]


async def list_jobs(
    store: StateStore,
    *,
    states: Sequence[State] | None = None,
    since: datetime | None = None,
    limit: int = 50,
) -> list[JobSummary]:
    """Batches in ``states`` (default: all) that entered their current state at or after ``since``,
    newest first, at most ``limit``."""
    chosen = list(states) if states else list(State)
    low: str | float = since.timestamp() if since is not None else "-inf"
    scored: list[tuple[float, BatchKey]] = []
    client = store.client
    for state in chosen:
        key = store.keys.state_index(state)
        try:
            rows = await client.zrevrangebyscore(key, "+inf", low, start=0, num=limit, withscores=True)
        except Exception as exc:
            raise classify(exc, default=StateStoreUnavailable) from exc
        # withscores=True: (member, score) pairs (redis-py types the reply as a union of shapes)
        pairs = cast("list[tuple[Any, Any]]", rows)
        scored.extend((float(score), BatchKey(str(member))) for member, score in pairs)
    scored.sort(reverse=True)
    ids = [key for _, key in scored[:limit]]
    records = [r for r in await store.get_many(ids) if r is not None]
    progress = await _progress_many(store, records)
    return [summary_of(r, p) for r, p in zip(records, progress, strict=True)]


async def get_job(store: StateStore, batch_id: str, tenant: str | None = None) -> JobDetail | None:
    """The batch ``batch_id`` of ``tenant`` (``None``: the default tenant), or ``None``."""
    key = batch_key(tenant, batch_id)
    record = await store.get(key)
    if record is None:
        return None
    progress = await store.read_progress(key) if not record.state.is_terminal else {}
    return detail_of(record, progress)
