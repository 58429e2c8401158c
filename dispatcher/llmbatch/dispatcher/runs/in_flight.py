"""The checks of in-flight batches: what the tracker does with each batch that holds a job.

For each batch in ``submitted``, ``running`` or ``finalizing`` (:meth:`InFlight.check`), from what the
backend says of its job:

- cancel requested / deadline passed -> stop the job, wait for it, report partial results;
- left unsent by the launching leader (another replica's launch) -> submit it;
- unknown to Ray -> resubmit if the submission was never confirmed, else *lost* -> retry;
- running but silent past the heartbeat timeout -> stop it, wait until Ray says it ended (a stop that
  fails is tried again), then retry: two attempts never run at once;
- succeeded -> ``finalizing`` -> read the manifest -> ``completed`` (or what the manifest says);
- failed -> non-retriable exit codes fail at once (+ dead letter), others retry with backoff up to
  ``max_attempts``, then ``failed`` + dead letter ``attempts_exhausted``.

Every change is a compare-and-set on the batch's record (a stale leader is harmless). The tracker
(:mod:`llmbatch.dispatcher.runs.tracker`) runs the loop and elects the leader; starting or resubmitting
an attempt is the :class:`~llmbatch.dispatcher.runs.launcher.Launcher`'s, stopping a job and ending an
attempt (retry, or finish) :class:`~llmbatch.dispatcher.runs.endings.AttemptEndings`', ending a batch the
:class:`~llmbatch.dispatcher.runs.finisher.Finisher`'s.
"""

from __future__ import annotations

import logging

from llmbatch.dispatcher.backends.backend import (
    EXIT_ENGINE_UNAVAILABLE,
    EXIT_INFRA_UNAVAILABLE,
    EXIT_INPUT_NOT_FOUND,
    NON_RETRIABLE_EXITS,
    JobInfo,
    JobState,
)
from llmbatch.dispatcher.domain.batch_record import BatchRecord
from llmbatch.dispatcher.domain.keys import BatchKey
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.errors import DispatcherError, ManifestInvalid
from llmbatch.dispatcher.runs.context import RunContext
from llmbatch.dispatcher.runs.endings import HEARTBEAT, AttemptEndings
from llmbatch.dispatcher.runs.finisher import Finisher
from llmbatch.dispatcher.runs.jobspec import results_prefix
from llmbatch.dispatcher.runs.launcher import UNSENT, Launcher
from llmbatch.dispatcher.runs.outcomes import (
    OutcomeReader,
    outcome_from_manifest,
    ray_message_summary,
)
from llmbatch.dispatcher.runs.progress_events import ProgressEvents
from llmbatch.schemas.deadlines import DEADLINE_EXCEEDED
from llmbatch.schemas.dlt import DltReason
from llmbatch.schemas.job import MANIFEST_NAME, Manifest

log = logging.getLogger(__name__)


def stopped_for_deadline(manifest: Manifest) -> bool:
    """Whether the attempt that wrote ``manifest`` stopped early because its deadline passed (on its
    node's clock): its error is ``deadline_exceeded``."""
    return manifest.error is not None and manifest.error.code == DEADLINE_EXCEEDED


class InFlight(AttemptEndings):
    """Checks each in-flight batch's job and ends the batch (retry, stop, finish) when it must."""

    def __init__(
        self, ctx: RunContext, outcomes: OutcomeReader, finisher: Finisher, launcher: Launcher
    ) -> None:
        self.ctx = ctx
        self.outcomes = outcomes
        self.finisher = finisher
        self.launcher = launcher
        self.progress = ProgressEvents(ctx)
        #: per batch: (attempt, its last heartbeat value) and when this dispatcher saw it change
        self._beats: dict[BatchKey, tuple[tuple[int, str], float]] = {}

    def remembered(self) -> set[BatchKey]:
        """The batches this replica keeps something of in memory (heartbeats, progress events)."""
        return set(self._beats) | self.progress.remembered()

    def keep_only(self, keys: set[BatchKey]) -> None:
        """Forget what is kept in memory of every batch but ``keys`` (the batches in flight now)."""
        self.progress.keep_only(keys)
        for gone in [k for k in self._beats if k not in keys]:
            del self._beats[gone]

    async def check(self, record: BatchRecord) -> None:
        """Move one in-flight batch on from what its job's backend says of it; a deadline or a
        cancel ends it in time also while the backend or the storage cannot answer."""
        sid = record.submission_id
        if not sid:  # cannot happen: launch records it with the transition
            await self.retry_or_fail(record, "internal_error", "in flight without a submission id")
            return
        now = self.ctx.clock()
        reason = self.stop_reason(record, now)
        if record.state is State.FINALIZING:
            try:
                await self.finish_succeeded(record)
            except DispatcherError as exc:
                if not (exc.retriable and reason is not None and self.must_end(record, reason, now)):
                    raise
                log.warning(
                    "results unreadable past the stop bound; ending the batch", extra={"error": str(exc)}
                )
                await self.finish_stopped(record, reason)
            return
        if reason is None and record.state is State.SUBMITTED and record.get("confirmed") == UNSENT:
            # the launching leader left this attempt to this replica (its shard's): never sent, so
            # there is nothing to ask the backend
            await self.launcher.submit(record)
            return
        try:
            info = await self.ctx.backend.status(sid)
        except DispatcherError as exc:
            if not exc.retriable or reason is None or reason == HEARTBEAT:
                raise
            await self.stop_unseen(record, reason, now, exc)
            return
        if reason is not None and info.state is not JobState.SUCCEEDED:
            await self.stop_then_finish(record, info, reason, now)
            return
        if info.state is JobState.NOT_FOUND:
            if record.state is State.SUBMITTED and not record.flag("confirmed"):
                await self.launcher.submit(record)
            else:
                self.ctx.metrics.attempts.labels(event="lost").inc()
                log.warning("job lost: Ray does not know it", extra={"submission_id": sid})
                await self.retry_or_fail(
                    record,
                    "job_lost",
                    f"Ray no longer knows attempt {sid} (a restarted Ray head, or a replaced batch-runner "
                    "replica on the short path)",
                    infrastructure=True,
                )
        elif info.state is JobState.PENDING:
            await self._confirm(record)
            submitted_at = record.number("submitted_at") or now
            if now - submitted_at > self.ctx.opts.submitted_timeout_s:
                await self.ctx.backend.stop(sid)
                self.ctx.metrics.attempts.labels(event="stuck").inc()
                await self.retry_or_fail(
                    record,
                    "job_stuck_pending",
                    f"job {sid} stayed PENDING for {now - submitted_at:.0f}s",
                    infrastructure=True,
                )
        elif info.state is JobState.RUNNING:
            if record.state is State.SUBMITTED:
                await self.mark_running(record, info)
            else:
                await self.check_heartbeat(record, info, now)
                await self.progress.maybe_publish(record, now)
        elif info.state is JobState.SUCCEEDED:
            await self.finish_succeeded(record)
        elif info.state is JobState.FAILED:
            await self.job_failed(record, info)
        elif info.state is JobState.STOPPED:
            self.ctx.metrics.attempts.labels(event="stopped").inc()
            await self.retry_or_fail(record, "job_stopped", f"job {sid} was stopped outside the dispatcher")

    async def _confirm(self, record: BatchRecord) -> None:
        if not record.flag("confirmed"):
            await self.ctx.store.transition(
                record.key,
                record.state,
                from_states=[record.state],
                expected_version=record.version,
                fields={"confirmed": "1"},
            )

    async def mark_running(self, record: BatchRecord, info: JobInfo) -> None:
        now = self.ctx.clock()
        first_start = record.number("started_at")
        result = await self.ctx.store.transition(
            record.key,
            State.RUNNING,
            expected_version=record.version,
            fields={
                "confirmed": "1",
                "attempt_started_at": repr(info.start_time or now),
                "running_at": repr(now),
                "started_at": repr(first_start or info.start_time or now),
            },
        )
        if result.ok:
            log.info("job running", extra={"submission_id": record.submission_id})

    async def check_heartbeat(self, record: BatchRecord, info: JobInfo, now: float) -> None:
        """A job Ray calls RUNNING whose heartbeat did not change for ``heartbeat_timeout_s`` of this
        dispatcher's clock (the time a job writes in it is its node's, which may be off) is hung: it is
        stopped, and the next attempt starts only once Ray says this one ended (or after
        ``job.stop_wait_s``), never beside it; a stop that fails (Ray unreachable) is tried again at
        the next check instead of being taken as done."""
        if not self.ctx.settings.job.pass_redis_url:  # the job has nowhere to send heartbeats
            return
        progress = await self.ctx.store.read_progress(record.key)
        beat = progress.get("heartbeat_at") if progress.get("attempt") == str(record.attempt) else None
        seen = 0.0
        if beat:  # judged on this clock: when the value last changed, never the job node's time in it
            mark = (record.attempt, beat[:64])
            before = self._beats.get(record.key)
            if before is None or before[0] != mark:
                self._beats[record.key] = (mark, now)
                seen = now
            else:
                seen = before[1]
        last = max(seen, record.number("running_at") or 0.0, record.number("attempt_started_at") or 0.0)
        if last and now - last > self.ctx.opts.heartbeat_timeout_s:
            self.ctx.metrics.attempts.labels(event="heartbeat_expired").inc()
            log.warning("job heartbeat expired; stopping it", extra={"silent_s": round(now - last, 1)})
            await self.stop_then_finish(record, info, HEARTBEAT, now)

    async def job_failed(self, record: BatchRecord, info: JobInfo) -> None:
        if await self._stopped_for_its_deadline(record):
            await self.wait_for_deadline(record)
            return
        code = info.exit_code
        message = f"job {record.submission_id} failed"
        if code is not None:
            message += f" with exit code {code}"
        summary = ray_message_summary(info.message)
        if summary:
            message += f": {summary}"
        message += " (the end of the driver's log is in the dispatcher's log)"
        if info.message:
            log.warning(
                "job failed",
                extra={
                    "submission_id": record.submission_id,
                    "exit_code": code,
                    "ray_message": info.message[-2000:],
                },
            )
        self.ctx.metrics.attempts.labels(event="failed").inc()
        if code == EXIT_INFRA_UNAVAILABLE:  # S3 was down: not the batch's fault
            await self.retry_or_fail(record, "infrastructure_unavailable", message, infrastructure=True)
        elif code == EXIT_ENGINE_UNAVAILABLE:  # waiting again on every retry would not help
            await self.retry_or_fail(
                record,
                "engine_unavailable",
                message,
                retriable=False,
                dlt_reason=DltReason.ATTEMPTS_EXHAUSTED,
            )
        elif code in NON_RETRIABLE_EXITS:
            reason = DltReason.INPUT_NOT_FOUND if code == EXIT_INPUT_NOT_FOUND else DltReason.INPUT_INVALID
            await self.retry_or_fail(record, str(reason), message, retriable=False, dlt_reason=reason)
        else:
            await self.retry_or_fail(record, info.error_type or "job_failed", message)

    async def _stopped_for_its_deadline(self, record: BatchRecord) -> bool:
        """Whether this attempt stopped early because its deadline passed on its node's clock (its
        manifest says so: its error is ``deadline_exceeded``)."""
        if record.deadline is None:
            return False
        try:
            manifest = await self.ctx.results.read_manifest(results_prefix(self.ctx.settings, record))
        except ManifestInvalid:
            return False
        return manifest is not None and manifest.attempt == record.attempt and stopped_for_deadline(manifest)

    async def finish_succeeded(self, record: BatchRecord) -> None:
        if record.state is not State.FINALIZING:
            result = await self.ctx.store.transition(
                record.key,
                State.FINALIZING,
                expected_version=record.version,
                fields={"confirmed": "1", "job_ended_at": repr(self.ctx.clock())},
            )
            if not result.ok:
                return
            self.ctx.crash("after_job_end")
            record = await self.ctx.store.get(record.key) or record
        prefix = results_prefix(self.ctx.settings, record)
        try:
            manifest = await self.ctx.results.read_manifest(prefix)
        except ManifestInvalid as exc:
            manifest, problem = None, str(exc)
        else:
            problem = f"no manifest at {prefix}manifest.json"
        if manifest is None or manifest.attempt != record.attempt:
            if manifest is not None:
                problem = f"manifest of attempt {manifest.attempt}, expected {record.attempt}"
            await self.retry_or_fail(record, "manifest_missing", problem)
            return
        if manifest.status == "partial" and stopped_for_deadline(manifest):
            await self.wait_for_deadline(record)  # stopped by its node's clock, ahead of this one
            return
        if manifest.status == "partial":  # exit 0 but not everything written: run the rest again
            detail = manifest.error.message if manifest.error else "the job stopped early"
            await self.retry_or_fail(record, "job_partial", detail)
            return
        outcome = outcome_from_manifest(manifest, record, self.ctx.clock(), prefix + MANIFEST_NAME)
        await self.finish(record, outcome)
