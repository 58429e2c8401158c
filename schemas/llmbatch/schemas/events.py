"""Event types and the data models of ``llm.batch.results.v1`` events, plus the type registry.

Result events are read by services we do not own, so their models ignore unknown fields (a tolerant
reader survives additive changes within ``v1``); commands (:mod:`llmbatch.schemas.batch`) reject them.
Exactly one terminal event per batch is the goal; a redelivered one carries the same ``ce_id``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from llmbatch.schemas.batch import BatchRequest, CancelRequest
from llmbatch.schemas.common import (
    BatchId,
    BatchStatus,
    Endpoint,
    Metadata,
    ModelName,
    S3Uri,
    Tenant,
    UtcDatetime,
)
from llmbatch.schemas.compat import StrEnum
from llmbatch.schemas.openai import ErrorObject, RequestCounts, Usage


class EventType(StrEnum):
    """CloudEvents ``type`` values (``ce_type``). The ``.v1`` suffix versions the data schema."""

    BATCH_REQUESTED = "llmbatch.batch.requested.v1"
    CANCEL_REQUESTED = "llmbatch.batch.cancel_requested.v1"
    ACCEPTED = "llmbatch.batch.accepted.v1"
    PROGRESS = "llmbatch.batch.progress.v1"
    COMPLETED = "llmbatch.batch.completed.v1"
    FAILED = "llmbatch.batch.failed.v1"
    CANCELLED = "llmbatch.batch.cancelled.v1"
    EXPIRED = "llmbatch.batch.expired.v1"
    REJECTED = "llmbatch.batch.rejected.v1"

    @property
    def is_terminal(self) -> bool:
        """True for the four terminal result events."""
        return self in TERMINAL_EVENT_TYPES


REQUEST_EVENT_TYPES = frozenset({EventType.BATCH_REQUESTED, EventType.CANCEL_REQUESTED})
"""Types carried by the requests topic."""
TERMINAL_EVENT_TYPES = frozenset(
    {EventType.COMPLETED, EventType.FAILED, EventType.CANCELLED, EventType.EXPIRED}
)
"""Terminal result types: a batch gets exactly one of them."""
RESULT_EVENT_TYPES = frozenset(
    {EventType.ACCEPTED, EventType.PROGRESS, EventType.REJECTED, *TERMINAL_EVENT_TYPES}
)
"""Types carried by the results topic."""

_EVENT_CONFIG = ConfigDict(extra="ignore")


class RecordRef(BaseModel):
    """Where a Kafka record is: the request an ``accepted`` event answers, or a dead letter (the
    operator's ``llmbatch dlq`` reads and replays it)."""

    model_config = _EVENT_CONFIG

    topic: str
    partition: int = Field(ge=0)
    offset: int = Field(ge=0)


class BatchAccepted(BaseModel):
    """Data of ``llmbatch.batch.accepted.v1``: the dispatcher validated and recorded the batch."""

    model_config = _EVENT_CONFIG

    batch_id: BatchId
    status: Literal[BatchStatus.ACCEPTED] = BatchStatus.ACCEPTED
    tenant: Tenant = "default"
    model: ModelName
    endpoint: Endpoint
    priority: int = Field(default=5, ge=0, le=9)
    input_uri: S3Uri | None = Field(default=None, description="The input file, for file batches.")
    total_requests: int | None = Field(default=None, ge=0, description="Known for inline batches.")
    request: RecordRef | None = Field(
        default=None, description="The accepted request record (what a reconcile pass reads again)."
    )
    accepted_at: UtcDatetime
    expires_at: UtcDatetime = Field(description="Effective deadline (completion window or deadline).")
    metadata: Metadata = Field(default_factory=dict)


class BatchProgress(BaseModel):
    """Data of ``llmbatch.batch.progress.v1`` (throttled): counts and tokens so far."""

    model_config = _EVENT_CONFIG

    batch_id: BatchId
    status: Literal[BatchStatus.RUNNING, BatchStatus.FINALIZING] = BatchStatus.RUNNING
    tenant: Tenant = "default"
    attempt: int = Field(default=1, ge=1)
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    usage: Usage = Field(default_factory=Usage)
    started_at: UtcDatetime | None = None
    updated_at: UtcDatetime


class TerminalEventData(BaseModel):
    """Fields shared by the terminal events (completed, failed, cancelled, expired).

    ``output_uris``/``error_uris`` list the final result shards (OpenAI batch output lines);
    ``manifest_uri`` points at the job's manifest, which lists the same shards.
    """

    model_config = _EVENT_CONFIG

    batch_id: BatchId
    status: BatchStatus
    tenant: Tenant = "default"
    model: ModelName
    output_uris: list[S3Uri] = Field(default_factory=list)
    error_uris: list[S3Uri] = Field(default_factory=list)
    manifest_uri: S3Uri | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    usage: Usage = Field(default_factory=Usage)
    accepted_at: UtcDatetime
    started_at: UtcDatetime | None = None
    finished_at: UtcDatetime
    attempts: int = Field(default=0, ge=0, description="Ray job attempts made (0 if none started).")
    ray_submission_id: str | None = Field(default=None, description="Of the last attempt.")
    error: ErrorObject | None = None
    metadata: Metadata = Field(default_factory=dict)


class BatchCompleted(TerminalEventData):
    """Data of ``llmbatch.batch.completed.v1``: every request ended (some may have failed per line)."""

    status: Literal[BatchStatus.COMPLETED] = BatchStatus.COMPLETED


class BatchFailed(TerminalEventData):
    """Data of ``llmbatch.batch.failed.v1``: the batch as a whole failed; ``error`` says why."""

    status: Literal[BatchStatus.FAILED] = BatchStatus.FAILED
    error: ErrorObject


class BatchCancelled(TerminalEventData):
    """Data of ``llmbatch.batch.cancelled.v1``: stopped on request; partial results are listed."""

    status: Literal[BatchStatus.CANCELLED] = BatchStatus.CANCELLED


class BatchExpired(TerminalEventData):
    """Data of ``llmbatch.batch.expired.v1``: stopped at its deadline; partial results are listed."""

    status: Literal[BatchStatus.EXPIRED] = BatchStatus.EXPIRED


class BatchRejected(BaseModel):
    """Data of ``llmbatch.batch.rejected.v1``: the answer to a request for ``batch_id`` that was not
    accepted (invalid event, unknown model, deadline already past, a batch id already in use, ...).

    It answers one *request* (``request_id`` = its ``ce_id``), not a batch: it is not a terminal
    event, and a batch that is already accepted under the same id goes on and still ends in exactly
    one terminal event (``batch_status`` says what that batch was doing). ``batch_status`` is
    ``dead_lettered`` when no accepted batch stands behind the id (the rejected request can be
    replayed from ``dead_letter``) and absent when the dispatcher could not tell (Redis refused).
    """

    model_config = _EVENT_CONFIG

    batch_id: BatchId
    tenant: Tenant | None = Field(
        default=None,
        description="The tenant the request named, when readable (batch ids are scoped by tenant: the "
        "answer is about this tenant's batch of that id; absent: the default tenant's).",
    )
    status: Literal["rejected"] = "rejected"
    request_id: str | None = Field(default=None, description="ce_id of the rejected request, if readable.")
    request_source: str | None = Field(default=None, description="ce_source of the rejected request.")
    error: ErrorObject = Field(
        description="Why: a stable ``code`` (e.g. ``invalid_field``), the message, "
        "and ``param`` when one field is at fault."
    )
    batch_status: BatchStatus | None = Field(
        default=None, description="State of the batch under this id after the rejection, if known."
    )
    dead_letter: RecordRef | None = Field(
        default=None, description="The dead letter of the request (none for a duplicate batch id)."
    )
    rejected_at: UtcDatetime

    @property
    def is_final(self) -> bool:
        """True when no terminal event about ``batch_id`` is still to come: no batch stands behind
        the id (``dead_lettered``, or unknown), or the one that does has already finished."""
        return self.batch_status is None or self.batch_status.is_terminal


EventData = (
    BatchRequest
    | CancelRequest
    | BatchAccepted
    | BatchProgress
    | BatchCompleted
    | BatchFailed
    | BatchCancelled
    | BatchExpired
    | BatchRejected
)
"""Any event's data model."""

EVENT_DATA_MODELS: dict[EventType, type[BaseModel]] = {
    EventType.BATCH_REQUESTED: BatchRequest,
    EventType.CANCEL_REQUESTED: CancelRequest,
    EventType.ACCEPTED: BatchAccepted,
    EventType.PROGRESS: BatchProgress,
    EventType.COMPLETED: BatchCompleted,
    EventType.FAILED: BatchFailed,
    EventType.CANCELLED: BatchCancelled,
    EventType.EXPIRED: BatchExpired,
    EventType.REJECTED: BatchRejected,
}
"""Registry: event type -> data model."""

_TYPE_BY_MODEL: dict[type[BaseModel], EventType] = {model: t for t, model in EVENT_DATA_MODELS.items()}

TERMINAL_TYPE_BY_STATUS: dict[BatchStatus, EventType] = {
    BatchStatus.COMPLETED: EventType.COMPLETED,
    BatchStatus.FAILED: EventType.FAILED,
    BatchStatus.CANCELLED: EventType.CANCELLED,
    BatchStatus.EXPIRED: EventType.EXPIRED,
}
"""Terminal status -> the event type announcing it."""


def event_type_for(data: BaseModel | type[BaseModel]) -> EventType:
    """The event type whose data model is ``data``'s class; ``KeyError`` for other models."""
    cls = data if isinstance(data, type) else type(data)
    try:
        return _TYPE_BY_MODEL[cls]
    except KeyError:
        raise KeyError(f"{cls.__name__} is not the data model of any llmbatch event type") from None
