"""How an in-flight batch's attempt ends: its job stopped (a cancel, its deadline, a hung attempt), then
the next attempt queued after a backoff, or the batch failed, cancelled or expired and finished.

A batch that must stop asks the backend to stop its job and records when; it ends with what it has
once the backend says the job ended, or on the dispatcher's own clock at its stop bound
(:meth:`AttemptEndings.end_by`) whatever the backend and the storage answer; a hung attempt must be
seen to end before the next one starts. An attempt that failed because of the infrastructure does not
count against ``max_attempts``. Mixed into :class:`~llmbatch.dispatcher.runs.in_flight.InFlight`,
whose checks decide when; ending a batch is the :class:`~llmbatch.dispatcher.runs.finisher.Finisher`'s.
"""

from __future__ import annotations

import logging

from llmbatch.dispatcher.backends.backend import JobInfo, JobState
from llmbatch.dispatcher.domain.batch_record import BatchRecord
from llmbatch.dispatcher.domain.events import Outcome
from llmbatch.dispatcher.domain.retry import AttemptDecision
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.errors import DispatcherError
from llmbatch.dispatcher.runs.context import RunContext
from llmbatch.dispatcher.runs.finisher import STOP_FIELDS, Finisher
from llmbatch.dispatcher.runs.outcomes import OutcomeReader
from llmbatch.dispatcher.runs.progress_events import ProgressEvents
from llmbatch.schemas.deadlines import DEADLINE_EXCEEDED
from llmbatch.schemas.dlt import DltReason

log = logging.getLogger(__name__)

HEARTBEAT = "heartbeat"  # stop reason of a hung attempt
INFRA_RETRIES = "infra_retries"  # attempts of this lifecycle the infrastructure failed (not counted)


def infra_retries(record: BatchRecord) -> int:
    """How many of the batch's attempts failed because of the infrastructure (0 when unreadable)."""
    value = record.get(INFRA_RETRIES) or "0"
    return int(value) if value.isascii() and value.isdigit() and len(value) < 10 else 0


class AttemptEndings:
    """Stops in-flight batches' jobs and ends their attempts: retry, or finish the batch (see the
    module docstring)."""

    ctx: RunContext
    outcomes: OutcomeReader
    finisher: Finisher
    progress: ProgressEvents

    def stop_reason(self, record: BatchRecord, now: float) -> str | None:
        """Why ``record`` must stop now (``cancel``, ``deadline``, ``heartbeat``), or None."""
        if record.flag("cancel_requested"):
            return "cancel"
        deadline = record.deadline
        if deadline is not None and now >= deadline:
            return "deadline"
        if record.get("stop_reason") == HEARTBEAT:
            return HEARTBEAT
        return None

    def end_by(self, record: BatchRecord, reason: str) -> float | None:
        """When a batch that must stop for ``reason`` ends on the dispatcher's own clock, whatever
        the backend and the storage answer: its deadline, or its cancel, plus ``job.stop_wait_s``
        (None for a hung attempt, which must be seen to end before the next one starts)."""
        wait = self.ctx.settings.job.stop_wait_s
        if reason == "deadline" and record.deadline is not None:
            return record.deadline + wait
        if reason == "cancel":
            asked = record.number("cancel_requested_at") or record.number("stop_requested_at")
            return None if asked is None else asked + wait
        return None

    def must_end(self, record: BatchRecord, reason: str | None, now: float) -> bool:
        """Whether ``record`` must end now with what it has (see :meth:`end_by`)."""
        end = None if reason is None else self.end_by(record, reason)
        return end is not None and now >= end

    async def wait_for_deadline(self, record: BatchRecord) -> None:
        """An attempt stopped for its deadline is no failure of the batch: it expires at its deadline on
        this dispatcher's clock (at once if that passed; a node's clock ahead of this one stops every
        attempt early, and counting those as failures would fail the batch before it expires). Until
        then it waits queued, not counted, and is not run again before its deadline."""
        deadline = record.deadline or 0.0
        if self.ctx.clock() >= deadline:
            await self.finish_stopped(record, "deadline")
            return
        message = (
            "the attempt stopped for its deadline on its node's clock, ahead of the dispatcher's: the batch "
            "expires at its deadline"
        )
        # not one of its max_attempts: counted as the infrastructure's
        if await self._requeue(record, DEADLINE_EXCEEDED, message, infra_retries(record) + 1, deadline):
            log.warning("attempt stopped for its deadline by a clock ahead of this one; expiring at it")

    async def _requeue(
        self, record: BatchRecord, code: str, message: str, outages: int, not_before: float
    ) -> bool:
        """Queue the batch's next attempt, not before ``not_before``, with why this one ended and how
        many of its attempts the infrastructure failed; False when another replica moved it first."""
        result = await self.ctx.store.transition(
            record.key,
            State.QUEUED,
            expected_version=record.version,
            from_states=[State.SUBMITTED, State.RUNNING, State.FINALIZING],
            fields={
                "last_error_code": code,
                "last_error_message": message[:2000],
                INFRA_RETRIES: str(outages),
            },
            delete=[*STOP_FIELDS, "confirmed"],
            not_before=not_before,
        )
        return result.ok

    async def retry_or_fail(
        self,
        record: BatchRecord,
        code: str,
        message: str,
        *,
        retriable: bool = True,
        dlt_reason: DltReason | None = None,
        infrastructure: bool = False,
    ) -> None:
        """Queue the next attempt after a backoff, or fail the batch when it may have none. An
        attempt that failed because of the infrastructure (``infrastructure``: Ray lost it, the
        cluster could not place it, S3 was down) does not count against ``max_attempts``: the batch
        waits, with backoff, until its deadline ends it."""
        outages = infra_retries(record)
        policy = self.ctx.opts.attempt_policy
        if infrastructure:
            outages += 1
            decision = AttemptDecision(True, policy.backoff.delay(outages), "infrastructure")
        else:
            decision = policy.after_failure(max(1, record.attempts_made - outages), retriable=retriable)
        now = self.ctx.clock()
        if decision.retry:
            if await self._requeue(record, code, message, outages, now + decision.delay_s):
                self.ctx.metrics.attempts.labels(event="retried").inc()
                log.warning(
                    "attempt failed; retrying",
                    extra={"code": code, "error": message[:500], "retry_in_s": round(decision.delay_s, 1)},
                )
            return
        error_code = code if not retriable else str(DltReason.ATTEMPTS_EXHAUSTED)
        error_message = (
            message if not retriable else f"{record.attempts_made} attempt(s) failed; last: {code}: {message}"
        )
        outcome = await self.outcomes.partial(
            record,
            State.FAILED,
            error_code=error_code,
            error_message=error_message,
            dlt_reason=str(dlt_reason or DltReason.ATTEMPTS_EXHAUSTED),
        )
        await self.finish(record, outcome)

    async def stop_then_finish(self, record: BatchRecord, info: JobInfo, reason: str, now: float) -> None:
        sid = record.submission_id or ""
        if info.state.is_terminal or info.state is JobState.NOT_FOUND:
            await self.finish_stopped(record, reason)
            return
        requested = record.number("stop_requested_at")
        if requested is None:
            failed = await self._ask_stop(record, reason, now)
            if failed is not None:
                log.warning("stop failed; the batch ends at its bound", extra={"error": str(failed)})
            self.ctx.metrics.attempts.labels(event="stop_requested").inc()
            log.info("stopping job", extra={"reason": reason, "submission_id": sid})
        elif now - requested > self.ctx.settings.job.stop_wait_s:
            log.warning("job did not stop in time; finishing without it", extra={"submission_id": sid})
            await self.finish_stopped(record, reason)

    async def _ask_stop(self, record: BatchRecord, reason: str, now: float) -> DispatcherError | None:
        """Ask the backend to stop the record's job and record the request (reason, when); return
        the retriable error the stop call met, if any. A hung attempt's stop must work (its successor
        waits for it): its errors raise; a cancel or a deadline ends the batch at :meth:`end_by`
        whether the stop worked or not."""
        failed = None
        try:
            await self.ctx.backend.stop(record.submission_id or "")
        except DispatcherError as exc:
            if not exc.retriable or reason == HEARTBEAT:
                raise
            failed = exc
        await self.ctx.store.transition(
            record.key,
            record.state,
            from_states=[record.state],
            expected_version=record.version,
            fields={"stop_reason": reason, "stop_requested_at": repr(now)},
        )
        return failed

    async def stop_unseen(self, record: BatchRecord, reason: str, now: float, exc: DispatcherError) -> None:
        """The backend cannot say what the job does (the Ray head or the batch runner is
        unreachable) and the batch must stop: ask for the stop (which may fail as well), remember
        when, and end the batch at :meth:`end_by` with what it has."""
        sid = record.submission_id or ""
        if record.number("stop_requested_at") is None:
            await self._ask_stop(record, reason, now)
            log.warning(
                "job status unknown; stopping it",
                extra={"reason": reason, "submission_id": sid, "error": str(exc)},
            )
            return
        if self.must_end(record, reason, now):
            log.warning(
                "job status unknown past the stop bound; ending the batch", extra={"submission_id": sid}
            )
            await self.finish_stopped(record, reason)

    async def finish_stopped(self, record: BatchRecord, reason: str) -> None:
        if reason == HEARTBEAT:  # the hung attempt ended: the next one may start
            sid = record.submission_id or ""
            await self.retry_or_fail(record, "heartbeat_expired", f"job {sid} stopped sending heartbeats")
            return
        state = State.CANCELLED if reason == "cancel" else State.EXPIRED
        message = record.get("cancel_reason") if reason == "cancel" else "the batch passed its deadline"
        outcome = await self.outcomes.partial(
            record,
            state,
            error_code=None if state is State.CANCELLED else DEADLINE_EXCEEDED,
            error_message=None if state is State.CANCELLED else message,
            best_effort=self.must_end(record, reason, self.ctx.clock()),
        )
        await self.finish(record, outcome)

    async def finish(self, record: BatchRecord, outcome: Outcome) -> None:
        if await self.finisher.finish(record, outcome):
            self.progress.forget(record.key)
