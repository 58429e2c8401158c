"""llmbatch's batch state -> OpenAI's Batch object. Pure: records in, a :class:`~llmbatch.api.objects.Batch`
out.

Inputs: the API's own record of the batch (:class:`~llmbatch.api.store.records.StoredBatch`, written when it
was created), what the dispatcher knows about it in Redis, read the way ``llmbatch jobs get`` reads it
(:class:`llmbatch.dispatcher.ops.jobs.JobDetail`, ``None`` while the request waits on Kafka or after Redis
forgot the batch), and, when Redis has nothing, the batch's manifest from the results bucket.

Statuses (the dispatcher's states are in :mod:`llmbatch.dispatcher.domain.states`):

=====================================================  ==============
llmbatch                                               OpenAI
=====================================================  ==============
no Redis record yet (request not yet taken in)         ``validating``
``accepted``, ``queued``, ``submitted``, ``running``   ``in_progress``
``finalizing``                                         ``finalizing``
``completed``                                          ``completed``
``failed``, ``dead_lettered`` (rejected at intake)     ``failed``
``expired``                                            ``expired``
``cancelled``                                          ``cancelled``
any non-terminal state after a cancel was requested    ``cancelling``
(via the API, or recorded by the dispatcher)
no Redis record any more: the manifest's status        the same name;
                                                       ``partial`` -> ``failed``
=====================================================  ==============

The input file is validated at upload, so ``validating`` only means "published, not yet accepted"
(the dispatcher may be paused by backpressure: that can last).

Timestamps: ``in_progress_at`` = accepted by the dispatcher; ``finalizing_at`` = the job ended
(``job_ended_at``); ``cancelling_at`` = the first cancel request known; ``completed_at`` /
``failed_at`` / ``expired_at`` / ``cancelled_at`` = when the batch ended (``finished_at``; a
rejection: when it was rejected); ``expires_at`` = the dispatcher's deadline, else created +
completion window. ``request_counts`` are the dispatcher's (live progress counters while running),
with ``total`` at least the file's line count. ``errors`` is set on ``failed`` only.
``output_file_id`` / ``error_file_id`` are set once the batch ended with at least one output / error
shard: one id each, however many shards (:mod:`llmbatch.api.batches.results`).
"""

from __future__ import annotations

from datetime import datetime

from llmbatch.api.objects import (
    Batch,
    BatchError,
    BatchErrors,
    BatchRequestCounts,
    BatchStatusName,
    BatchUsage,
)
from llmbatch.api.store.records import StoredBatch
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.ops.jobs import JobDetail
from llmbatch.schemas.job import Manifest

OUTPUT_PREFIX = "file-output-"
ERROR_PREFIX = "file-error-"

_BY_STATE: dict[State, BatchStatusName] = {
    State.ACCEPTED: "in_progress",
    State.QUEUED: "in_progress",
    State.SUBMITTED: "in_progress",
    State.RUNNING: "in_progress",
    State.FINALIZING: "finalizing",
    State.COMPLETED: "completed",
    State.FAILED: "failed",
    State.DEAD_LETTERED: "failed",
    State.EXPIRED: "expired",
    State.CANCELLED: "cancelled",
}
_BY_MANIFEST: dict[str, BatchStatusName] = {
    "completed": "completed",
    "failed": "failed",
    "cancelled": "cancelled",
    "expired": "expired",
    "partial": "failed",
}


def output_file_id(batch_id: str) -> str:
    """The id of a batch's output file (all its output shards, in order)."""
    return f"{OUTPUT_PREFIX}{batch_id}"


def error_file_id(batch_id: str) -> str:
    """The id of a batch's error file (all its error shards, in order)."""
    return f"{ERROR_PREFIX}{batch_id}"


def openai_status(state: State | None, *, cancel_requested: bool) -> BatchStatusName:
    """The OpenAI status of a batch in ``state`` (``None``: not taken in yet)."""
    status: BatchStatusName = "validating" if state is None else _BY_STATE[state]
    if cancel_requested and (state is None or not state.is_terminal):
        return "cancelling"
    return status


def _ts(value: datetime | float | None) -> int | None:
    if value is None:
        return None
    return int(value.timestamp() if isinstance(value, datetime) else value)


def _step_at(job: JobDetail, step: str) -> datetime | None:
    times = [entry.at for entry in job.timeline if entry.step == step]
    return max(times) if times else None


def _earliest(*values: int | None) -> int | None:
    known = [v for v in values if v is not None]
    return min(known) if known else None


def to_batch(stored: StoredBatch, job: JobDetail | None, manifest: Manifest | None = None) -> Batch:
    """The OpenAI Batch object of ``stored`` given what the dispatcher (or the manifest) says."""
    if job is not None and not _same_batch(stored, job):
        job = None  # never show another batch's state (defensive: the API's ids are random)
    if job is not None:
        return _from_job(stored, job)
    if manifest is not None and manifest.batch_id == stored.id:
        return _from_manifest(stored, manifest)
    cancelling_at = _ts(stored.cancel_requested_at)
    return _base(
        stored, openai_status(None, cancel_requested=cancelling_at is not None), cancelling_at=cancelling_at
    )


def _same_batch(stored: StoredBatch, job: JobDetail) -> bool:
    if job.batch_id != stored.id:
        return False
    # a request refused at intake is recorded without its (unread) tenant
    return job.state is State.DEAD_LETTERED or job.tenant == stored.tenant


def _base(stored: StoredBatch, status: BatchStatusName, **fields: object) -> Batch:
    values: dict[str, object] = {
        "id": stored.id,
        "endpoint": stored.endpoint.value,
        "model": stored.model,
        "input_file_id": stored.input_file_id,
        "completion_window": stored.completion_window,
        "status": status,
        "created_at": int(stored.created_at),
        "expires_at": int(stored.expires_at),
        "request_counts": BatchRequestCounts(total=stored.total),
        "metadata": dict(stored.metadata),
        "priority": stored.priority,
    }
    values.update({k: v for k, v in fields.items() if v is not None})
    return Batch.model_validate(values)


def _from_job(stored: StoredBatch, job: JobDetail) -> Batch:
    cancel_at = _earliest(_ts(_step_at(job, "cancel requested")), _ts(stored.cancel_requested_at))
    if cancel_at is None and job.cancel_requested:
        cancel_at = _ts(job.state_at)
    status = openai_status(job.state, cancel_requested=cancel_at is not None)
    ended = _ts(job.finished_at) if job.state.is_terminal else None
    if job.state is State.DEAD_LETTERED:
        ended = _ts(_step_at(job, State.DEAD_LETTERED.value)) or _ts(job.state_at)
    counts = job.counts
    total = max(counts.total, stored.total, counts.completed + counts.failed)
    errors = None
    if status == "failed" and job.last_error is not None:
        error = BatchError(code=job.last_error.code, message=job.last_error.message)
        errors = BatchErrors(data=[error])
    usage = BatchUsage(
        input_tokens=job.usage.prompt_tokens,
        output_tokens=job.usage.completion_tokens,
        total_tokens=job.usage.prompt_tokens + job.usage.completion_tokens,
    )
    terminal = job.state.is_terminal
    return _base(
        stored,
        status,
        in_progress_at=_ts(job.accepted_at),
        expires_at=_ts(job.deadline),
        finalizing_at=_ts(_step_at(job, State.FINALIZING.value)),
        cancelling_at=cancel_at,
        completed_at=ended if status == "completed" else None,
        failed_at=ended if status == "failed" else None,
        expired_at=ended if status == "expired" else None,
        cancelled_at=ended if status == "cancelled" else None,
        request_counts=BatchRequestCounts(total=total, completed=counts.completed, failed=counts.failed),
        usage=usage,
        errors=errors,
        output_file_id=output_file_id(stored.id) if terminal and job.output_uris else None,
        error_file_id=error_file_id(stored.id) if terminal and job.error_uris else None,
    )


def _from_manifest(stored: StoredBatch, manifest: Manifest) -> Batch:
    status = _BY_MANIFEST[str(manifest.status)]
    ended = _ts(manifest.timings.finished_at)
    counts = manifest.request_counts
    errors = None
    if status == "failed":
        code, message = "partial", "the batch stopped before every request ended"
        if manifest.error is not None:
            code, message = manifest.error.code, manifest.error.message
        errors = BatchErrors(data=[BatchError(code=code, message=message)])
    return _base(
        stored,
        status,
        in_progress_at=_ts(manifest.timings.started_at),
        cancelling_at=_ts(stored.cancel_requested_at),
        completed_at=ended if status == "completed" else None,
        failed_at=ended if status == "failed" else None,
        expired_at=ended if status == "expired" else None,
        cancelled_at=ended if status == "cancelled" else None,
        request_counts=BatchRequestCounts(
            total=max(counts.total, stored.total), completed=counts.completed, failed=counts.failed
        ),
        usage=BatchUsage(
            input_tokens=manifest.usage.prompt_tokens,
            output_tokens=manifest.usage.completion_tokens,
            total_tokens=manifest.usage.prompt_tokens + manifest.usage.completion_tokens,
        ),
        errors=errors,
        output_file_id=output_file_id(stored.id) if manifest.output_shards else None,
        error_file_id=error_file_id(stored.id) if manifest.error_shards else None,
    )
