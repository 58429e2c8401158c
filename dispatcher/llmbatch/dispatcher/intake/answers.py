"""The ``rejected`` answers to requests that were not accepted (pure).

Every request that names a usable batch id (the record key) gets an answer on the results topic,
``llmbatch.batch.rejected.v1`` (:class:`~llmbatch.schemas.events.BatchRejected`): an invalid event (with where
its dead letter is), a new request for a batch id its tenant already uses (with that batch's state:
batch ids are scoped by tenant, so the batch described is always the requester's own), or a
record the consumer gave up on (``processing_failed``). A record without a usable batch id goes to
the dead-letter topic only. Each answer's ``ce_id`` is fixed by the request it answers, so one
re-sent after a redelivery carries the same id.

Building an answer never raises: the request's fields are hostile input, and an answer that fails
to build (a value the answer's contract refuses) falls back to :func:`minimal_answer`, the batch id,
a stable code and a fixed message; when even that cannot be built (the batch id is not one), there
is no answer and the dead letter alone tells.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from llmbatch.dispatcher.domain.batch_record import IntakeResult
from llmbatch.dispatcher.domain.dlt import describe_schema_error
from llmbatch.dispatcher.domain.events import build_rejected
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.intake.commands import Accept, Reject, record_marker
from llmbatch.dispatcher.intake.record_retry import GaveUp, describe
from llmbatch.schemas.cloudevents import Envelope
from llmbatch.schemas.dlt import DltReason
from llmbatch.schemas.errors import Reason
from llmbatch.schemas.events import RecordRef
from llmbatch.schemas.openai import ErrorObject

log = logging.getLogger(__name__)
MINIMAL_MESSAGE = (
    "this request was not accepted; its details could not be put into this answer: "
    "the dead letter of the request (llmbatch dlq inspect) has them"
)


def minimal_answer(
    batch_id: str, code: str, *, answer_of: str, source: str, now: float
) -> Envelope[Any] | None:
    """The smallest valid ``rejected`` answer: the batch id, ``code`` and a fixed message, with the id
    the full answer would have had. ``None`` when even that cannot be built (``batch_id`` is not a
    valid batch id): the request then has its dead letter only."""
    try:
        return build_rejected(
            batch_id,
            ErrorObject(code=code[:128] or DltReason.PROCESSING_FAILED, message=MINIMAL_MESSAGE),
            source=source,
            answer_of=answer_of,
            now=now,
        )
    except Exception:  # hostile input: nothing to answer with
        return None


def _guarded(
    build: Callable[[], Envelope[Any]], batch_id: str, code: str, *, answer_of: str, source: str, now: float
) -> Envelope[Any] | None:
    try:
        return build()
    except Exception as exc:  # a field the answer's contract refuses: answer with less
        log.warning(
            "the full answer could not be built; answering with the minimal one",
            extra={"error": f"{type(exc).__name__}: {str(exc)[:300]}"},
        )
    return minimal_answer(batch_id, code, answer_of=answer_of, source=source, now=now)


def rejection_answer(
    reject: Reject, written: Any, behind: State | None, *, source: str, now: float
) -> Envelope[Any] | None:
    """The answer to a dead-lettered request whose batch id is readable. ``written`` is the dead
    letter's ``RecordMetadata``; ``behind`` the state of the batch (of the tenant the request claims)
    that already had the id. ``None``: no answer can be built (see :func:`minimal_answer`)."""
    error = reject.error
    batch_id = reject.batch_id or ""

    def build() -> Envelope[Any]:
        return build_rejected(
            batch_id,
            ErrorObject(code=error.reason, message=describe_schema_error(error)[:2000], param=error.field),
            source=source,
            answer_of=reject.answer_of,
            now=now,
            request_id=reject.request_id,
            request_source=reject.request_source,
            batch_status=behind or State.DEAD_LETTERED,
            tenant=reject.tenant,
            dead_letter=RecordRef(
                topic=reject.dead_letter.topic, partition=written.partition, offset=written.offset
            ),
        )

    return _guarded(build, batch_id, str(error.reason), answer_of=reject.answer_of, source=source, now=now)


def duplicate_answer(
    accept: Accept, result: IntakeResult, *, source: str, now: float
) -> Envelope[Any] | None:
    """The answer to a new request (a new event id) for a batch id its tenant already uses: nothing
    applied. ``None``: no answer can be built (see :func:`minimal_answer`)."""
    batch_id = accept.request.batch_id
    answer_of = ":".join(accept.item.marker)

    def build() -> Envelope[Any]:
        state = result.state.value if result.state else "unknown"
        message = (
            f"batch {batch_id!r} already exists ({state}); this request was not applied. "
            "Follow that batch's events, or use a new batch_id for a new batch"
        )
        return build_rejected(
            batch_id,
            ErrorObject(code=Reason.DUPLICATE_BATCH_ID, message=message, param="batch_id"),
            source=source,
            answer_of=answer_of,
            now=now,
            request_id=accept.item.fields.get("event_id"),
            request_source=accept.item.fields.get("source"),
            batch_status=result.state,
            traceparent=accept.traceparent,
            tenant=accept.request.tenant,
        )

    return _guarded(build, batch_id, Reason.DUPLICATE_BATCH_ID, answer_of=answer_of, source=source, now=now)


def failure_answer(
    command: Accept | Reject,
    batch_id: str,
    failed: GaveUp,
    written: RecordRef | None,
    *,
    source: str,
    now: float,
) -> Envelope[Any] | None:
    """The answer to a request the consumer gave up on (``processing_failed``). ``None``: no answer
    can be built (see :func:`minimal_answer`)."""
    answer_of = ":".join(record_marker(command.origin))

    def build() -> Envelope[Any]:
        if isinstance(command, Accept):
            fields = command.item.fields
            request_id, request_source = fields.get("event_id"), fields.get("source")
            traceparent = command.traceparent
            tenant: str | None = command.request.tenant
        else:
            request_id, request_source, traceparent = command.request_id, command.request_source, None
            tenant = command.tenant
        return build_rejected(
            batch_id,
            ErrorObject(
                code=DltReason.PROCESSING_FAILED,
                message=f"the dispatcher could not record this request ({describe(failed.error)[:1000]}); "
                "an operator can replay its dead letter once the cause is fixed",
            ),
            source=source,
            answer_of=answer_of,
            now=now,
            request_id=request_id,
            request_source=request_source,
            dead_letter=written,
            traceparent=traceparent,
            tenant=tenant,
        )

    return _guarded(build, batch_id, DltReason.PROCESSING_FAILED, answer_of=answer_of, source=source, now=now)
