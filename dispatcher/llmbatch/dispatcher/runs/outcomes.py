"""What a batch's outcome is: from the manifest of its last attempt, or from what stopped or failed
attempts left (their shards and progress counters); and what of Ray's message may be made public.

Reads only (MinIO through :class:`~llmbatch.dispatcher.runs.results.ResultStore`, the progress hash in
Redis); the :class:`~llmbatch.dispatcher.runs.finisher.Finisher` turns an
:class:`~llmbatch.dispatcher.domain.events.Outcome` into the batch's terminal state.
"""

from __future__ import annotations

import contextlib
import logging

from llmbatch.dispatcher.domain.batch_record import BatchRecord
from llmbatch.dispatcher.domain.events import Outcome
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.errors import DispatcherError, ManifestInvalid
from llmbatch.dispatcher.runs.context import RunContext
from llmbatch.dispatcher.runs.jobspec import results_prefix
from llmbatch.dispatcher.runs.results import Shards
from llmbatch.schemas.dlt import DltReason
from llmbatch.schemas.job import MANIFEST_NAME, Manifest

log = logging.getLogger(__name__)


class OutcomeReader:
    """Builds the outcome of a batch that did not end with a manifest of its own attempt."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx

    async def partial(
        self,
        record: BatchRecord,
        state: State,
        *,
        error_code: str | None,
        error_message: str | None,
        dlt_reason: str | None = None,
        best_effort: bool = False,
    ) -> Outcome:
        """What earlier or stopped attempts left: a manifest of the last attempt if it wrote one,
        else the shards found and the job's progress counters. ``best_effort``: when the storage
        cannot be read (a retriable error), the progress counters alone, without result files,
        instead of the error (a batch that must end now)."""
        now = self.ctx.clock()
        started = record.number("started_at")
        if record.attempt == 0:
            return Outcome(
                state,
                now,
                counts={"total": int(record.get("total") or 0)},
                started_at=started,
                error_code=error_code,
                error_message=error_message,
                dlt_reason=dlt_reason,
            )
        prefix = results_prefix(self.ctx.settings, record)
        manifest = None
        shards = Shards([], [])
        try:
            with contextlib.suppress(ManifestInvalid):
                manifest = await self.ctx.results.read_manifest(prefix)
            if manifest is None or manifest.attempt != record.attempt:
                shards = await self.ctx.results.list_shards(prefix)
        except DispatcherError as exc:
            if not (exc.retriable and best_effort):
                raise
            log.warning(
                "results unreadable: the outcome has the progress counters only", extra={"error": str(exc)}
            )
            manifest = None
        if manifest is not None and manifest.attempt == record.attempt:
            base = outcome_from_manifest(manifest, record, now, prefix + MANIFEST_NAME, state=state)
            return Outcome(
                state,
                now,
                base.output_uris,
                base.error_uris,
                base.manifest_uri,
                base.counts,
                base.usage,
                started,
                error_code,
                error_message,
                dlt_reason,
            )
        progress = await self.ctx.store.read_progress(record.key)
        counts = {k: counter(progress.get(k)) for k in ("total", "completed", "failed")}
        if not counts["total"]:
            counts["total"] = int(record.get("total") or 0)
        usage = {k: counter(progress.get(k)) for k in ("prompt_tokens", "completion_tokens")}
        return Outcome(
            state,
            now,
            shards.output_uris,
            shards.error_uris,
            None,
            counts,
            usage,
            started,
            error_code,
            error_message,
            dlt_reason,
        )


RAY_SUMMARY_CHARS = 200


def ray_message_summary(message: str | None) -> str:
    """What of Ray's job message may go into public events and dead letters: its first sentence,
    never the driver's log tail Ray appends ("..., last available logs (truncated to 20,000 chars):"
    and up to 20 kB of whatever the job printed), which only the dispatcher's log gets."""
    if not message:
        return ""
    head = message.split("\n", 1)[0]
    for marker in (", last available logs", "last available logs"):
        head = head.split(marker, 1)[0]
    head = head.strip().rstrip(",:;")
    return head if len(head) <= RAY_SUMMARY_CHARS else head[: RAY_SUMMARY_CHARS - 3] + "..."


def outcome_from_manifest(
    manifest: Manifest, record: BatchRecord, now: float, manifest_uri: str, *, state: State | None = None
) -> Outcome:
    """The outcome a manifest reports (``state`` overrides its status, e.g. for a stopped job)."""
    status = state or (State.EXPIRED if manifest.status == "partial" else State(str(manifest.status)))
    counts = manifest.request_counts
    usage = manifest.usage
    error = manifest.error
    failed = status is State.FAILED
    return Outcome(
        state=status,
        finished_at=now,
        output_uris=manifest.output_uris,
        error_uris=manifest.error_uris,
        manifest_uri=manifest_uri,
        counts={"total": counts.total, "completed": counts.completed, "failed": counts.failed},
        usage={"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens},
        started_at=record.number("started_at") or manifest.timings.started_at.timestamp(),
        error_code=(error.code if error else "input_invalid") if failed else None,
        error_message=(error.message if error else None) if failed else None,
        dlt_reason=str(DltReason.INPUT_INVALID) if failed else None,
    )


def counter(value: str | None) -> int:
    """A progress counter read from Redis (a string, maybe missing or garbled) as an int >= 0."""
    try:
        return max(0, int(float(value or 0)))
    except ValueError:
        return 0
