"""Result events built from batch records (pure), with stable ids.

Every event the dispatcher publishes about a batch has a deterministic ``ce_id`` derived from the
batch's key, its lifecycle (fixed by the request record that started it: a batch id sent again after
its record expired starts another), its generation (0, +1 per reopen), the replay id that reopened it,
and what the event announces. A terminal event re-published after a crash therefore carries the SAME
id, and consumers drop the duplicate; two lifecycles of one batch id never share an id.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson
from pydantic import BaseModel

from llmbatch.dispatcher.domain.batch_record import BatchRecord
from llmbatch.dispatcher.domain.dlt import OriginalRecord
from llmbatch.dispatcher.domain.keys import BatchKey
from llmbatch.dispatcher.domain.states import State, terminal_event_state
from llmbatch.schemas.cloudevents import Envelope, stable_event_id
from llmbatch.schemas.common import Endpoint
from llmbatch.schemas.events import (
    TERMINAL_TYPE_BY_STATUS,
    BatchAccepted,
    BatchCancelled,
    BatchCompleted,
    BatchExpired,
    BatchFailed,
    BatchProgress,
    BatchRejected,
    EventType,
    RecordRef,
)
from llmbatch.schemas.openai import ErrorObject, RequestCounts, Usage

_TERMINAL_MODELS: dict[State, type[BaseModel]] = {
    State.COMPLETED: BatchCompleted,
    State.FAILED: BatchFailed,
    State.CANCELLED: BatchCancelled,
    State.EXPIRED: BatchExpired,
}


def _lineage(generation: int, replay_id: str | None, lifecycle: str) -> tuple[str, ...]:
    # a record from before lifecycles existed has none: its ids stay what they were
    base = (str(generation), replay_id or "")
    return (*base, lifecycle) if lifecycle else base


def accepted_event_id(key: BatchKey, generation: int, replay_id: str | None, lifecycle: str = "") -> str:
    """Event ids derive from the batch's key, so two tenants' batches of one id get distinct ids."""
    return stable_event_id(key, EventType.ACCEPTED, *_lineage(generation, replay_id, lifecycle))


def terminal_event_id(
    key: BatchKey, state: State, generation: int, replay_id: str | None, lifecycle: str = ""
) -> str:
    """The one ``ce_id`` of the terminal event of this batch lifecycle."""
    event_state = terminal_event_state(state)
    return stable_event_id(
        key, TERMINAL_TYPE_BY_STATUS[event_state], *_lineage(generation, replay_id, lifecycle)
    )


def progress_event_id(
    key: BatchKey,
    generation: int,
    replay_id: str | None,
    attempt: int,
    counts: RequestCounts,
    lifecycle: str = "",
) -> str:
    return stable_event_id(
        key,
        EventType.PROGRESS,
        *_lineage(generation, replay_id, lifecycle),
        str(attempt),
        str(counts.completed),
        str(counts.failed),
    )


def ts(value: float | None) -> datetime | None:
    return datetime.fromtimestamp(value, UTC) if value is not None else None


def _metadata(record: BatchRecord) -> dict[str, str]:
    value = record.json_field("metadata")
    return dict(value) if isinstance(value, dict) else {}


@dataclass(frozen=True)
class Outcome:
    """How a batch ended: stored (as JSON) with the terminal state, published later verbatim."""

    state: State
    finished_at: float
    output_uris: list[str] = field(default_factory=list)
    error_uris: list[str] = field(default_factory=list)
    manifest_uri: str | None = None
    counts: dict[str, int] = field(default_factory=dict)
    usage: dict[str, int] = field(default_factory=dict)
    started_at: float | None = None
    error_code: str | None = None
    error_message: str | None = None
    dlt_reason: str | None = None

    def to_json(self) -> str:
        return orjson.dumps(
            {
                "state": self.state.value,
                "finished_at": self.finished_at,
                "output_uris": self.output_uris,
                "error_uris": self.error_uris,
                "manifest_uri": self.manifest_uri,
                "counts": self.counts,
                "usage": self.usage,
                "started_at": self.started_at,
                "error_code": self.error_code,
                "error_message": self.error_message,
                "dlt_reason": self.dlt_reason,
            }
        ).decode()

    @classmethod
    def from_json(cls, text: str) -> Outcome:
        d: dict[str, Any] = orjson.loads(text)
        return cls(
            State(d["state"]),
            float(d["finished_at"]),
            list(d.get("output_uris") or []),
            list(d.get("error_uris") or []),
            d.get("manifest_uri"),
            dict(d.get("counts") or {}),
            dict(d.get("usage") or {}),
            d.get("started_at"),
            d.get("error_code"),
            d.get("error_message"),
            d.get("dlt_reason"),
        )


def safe_counts(counts: dict[str, int], total_hint: int | None = None) -> RequestCounts:
    """Request counts that satisfy ``completed + failed <= total`` whatever the sources said."""
    completed = max(0, int(counts.get("completed", 0)))
    failed = max(0, int(counts.get("failed", 0)))
    total = max(int(counts.get("total", 0) or 0), total_hint or 0, completed + failed)
    return RequestCounts(total=total, completed=completed, failed=failed)


def build_accepted(record: BatchRecord, *, source: str) -> Envelope[Any]:
    """The ``accepted`` event. Built without re-validation: every field comes from the request that
    was just validated (this runs once per accepted event, on the intake hot path)."""
    accepted_at = record.number("accepted_at") or 0.0
    deadline = record.number("deadline") or accepted_at
    total = record.get("total")
    accepted = datetime.fromtimestamp(accepted_at, UTC)
    data = BatchAccepted.model_construct(
        batch_id=record.batch_id,
        status=State.ACCEPTED,
        tenant=record.tenant,
        model=record.get("model", "unknown") or "unknown",
        endpoint=Endpoint(record.get("endpoint") or Endpoint.CHAT_COMPLETIONS.value),
        priority=int(record.get("priority", "5") or 5),
        input_uri=record.get("input_uri"),
        total_requests=int(total) if total is not None else None,
        request=_request_ref(record.get("origin")),
        accepted_at=accepted,
        expires_at=datetime.fromtimestamp(deadline, UTC),
        metadata=_metadata(record),
    )
    return Envelope.model_construct(
        id=accepted_event_id(
            record.key, record.generation, record.get("replay_id"), record.get("lifecycle") or ""
        ),
        source=source,
        type=EventType.ACCEPTED,
        time=accepted,
        subject=record.batch_id,
        data=data,
        traceparent=record.get("traceparent"),
        extra_headers=(),
    )


def _request_ref(origin_json: str | None) -> RecordRef | None:
    """Where the accepted request is on the requests topic (from the stored ``origin``)."""
    if not origin_json:
        return None
    try:
        origin = OriginalRecord.from_json(origin_json)
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None
    return RecordRef.model_construct(topic=origin.topic, partition=origin.partition, offset=origin.offset)


def build_rejected(
    batch_id: str,
    error: ErrorObject,
    *,
    source: str,
    answer_of: str,
    now: float,
    request_id: str | None = None,
    request_source: str | None = None,
    batch_status: State | None = None,
    dead_letter: RecordRef | None = None,
    traceparent: str | None = None,
    tenant: str | None = None,
) -> Envelope[Any]:
    """The ``rejected`` answer to one request. ``answer_of`` names the rejected request (its Kafka
    coordinates, or its source and id) and fixes the event id: a request rejected again after a
    redelivery gets an answer with the same ``ce_id``. ``tenant``: the one the request named."""
    data = BatchRejected(
        batch_id=batch_id,
        tenant=tenant,
        request_id=request_id,
        request_source=request_source,
        error=error,
        batch_status=batch_status,
        dead_letter=dead_letter,
        rejected_at=datetime.fromtimestamp(now, UTC),
    )
    return Envelope.new(
        data,
        source=source,
        id=stable_event_id(batch_id, EventType.REJECTED, answer_of),
        time=datetime.fromtimestamp(now, UTC),
        traceparent=traceparent,
    )


def build_progress(
    record: BatchRecord, counts: RequestCounts, usage: Usage, *, source: str, now: float
) -> Envelope[Any]:
    data = BatchProgress(
        batch_id=record.batch_id,
        status=State.FINALIZING if record.state is State.FINALIZING else State.RUNNING,
        tenant=record.tenant,
        attempt=max(1, record.attempt),
        request_counts=counts,
        usage=usage,
        started_at=ts(record.number("started_at")),
        updated_at=ts(now),
    )
    return Envelope.new(
        data,
        source=source,
        id=progress_event_id(
            record.key,
            record.generation,
            record.get("replay_id"),
            record.attempt,
            counts,
            record.get("lifecycle") or "",
        ),
        time=ts(now),
        traceparent=record.get("traceparent"),
    )


def build_terminal(record: BatchRecord, *, source: str) -> Envelope[Any]:
    """The terminal event of a batch in a terminal state, from the outcome stored with it."""
    raw = record.get("outcome")
    if raw is None:
        raise ValueError(f"{record.batch_id} has no stored outcome")
    outcome = Outcome.from_json(raw)
    event_state = terminal_event_state(record.state)
    model = _TERMINAL_MODELS[event_state]
    total_hint = record.get("total")
    error = None
    if outcome.error_code or event_state is State.FAILED:
        error = ErrorObject(
            code=outcome.error_code or "failed", message=outcome.error_message or "batch failed"
        )
    data = model(
        batch_id=record.batch_id,
        tenant=record.tenant,
        model=record.get("model", "unknown") or "unknown",
        output_uris=outcome.output_uris,
        error_uris=outcome.error_uris,
        manifest_uri=outcome.manifest_uri,
        request_counts=safe_counts(outcome.counts, int(total_hint) if total_hint else None),
        usage=Usage(
            prompt_tokens=int(outcome.usage.get("prompt_tokens", 0)),
            completion_tokens=int(outcome.usage.get("completion_tokens", 0)),
        ),
        accepted_at=ts(record.number("accepted_at") or outcome.finished_at),
        started_at=ts(outcome.started_at),
        finished_at=ts(outcome.finished_at),
        attempts=record.attempts_made,
        ray_submission_id=record.submission_id,
        error=error,
        metadata=_metadata(record),
    )
    event_id = record.get("terminal_event_id") or terminal_event_id(
        record.key, record.state, record.generation, record.get("replay_id"), record.get("lifecycle") or ""
    )
    return Envelope.new(
        data, source=source, id=event_id, time=ts(outcome.finished_at), traceparent=record.get("traceparent")
    )


def terminal_fields(record: BatchRecord, outcome: Outcome) -> dict[str, str]:
    """Fields recorded with a terminal transition: the outcome and the one terminal event id."""
    return {
        "outcome": outcome.to_json(),
        "terminal_event_id": terminal_event_id(
            record.key,
            outcome.state,
            record.generation,
            record.get("replay_id"),
            record.get("lifecycle") or "",
        ),
        "finished_at": repr(outcome.finished_at),
        "published": "0",
        "dlt_pending": "1" if outcome.dlt_reason else "0",
        "error_code": outcome.error_code or "",
        "error_message": (outcome.error_message or "")[:2000],
    }


TERMINAL_STATES_PUBLISHED = (State.COMPLETED, State.FAILED, State.CANCELLED, State.EXPIRED)


def published_state(record: BatchRecord, event_id: str) -> State | None:
    """The terminal state ``event_id`` announced for this record's lifecycle (key, lifecycle,
    generation and replay id), or None when it is not one of this lifecycle's terminal ids. Pure."""
    for state in TERMINAL_STATES_PUBLISHED:
        if (
            terminal_event_id(
                record.key, state, record.generation, record.get("replay_id"), record.get("lifecycle") or ""
            )
            == event_id
        ):
            return state
    return None


def outcome_of_event(data: Any, state: State) -> Outcome:
    """The outcome a published terminal event announced (its data model), to record as final."""
    counts = data.request_counts
    error = data.error
    return Outcome(
        state,
        data.finished_at.timestamp() if data.finished_at else 0.0,
        list(data.output_uris),
        list(data.error_uris),
        data.manifest_uri,
        {"total": counts.total, "completed": counts.completed, "failed": counts.failed},
        {"prompt_tokens": data.usage.prompt_tokens, "completion_tokens": data.usage.completion_tokens},
        data.started_at.timestamp() if data.started_at else None,
        error.code if error else None,
        error.message if error else None,
        None,  # its dead letter, if any, went out with it
    )
