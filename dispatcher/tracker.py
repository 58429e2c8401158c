"""The tracking loop: launch queued batches, watch their Ray jobs, finish them, publish outcomes.

Any replica may run it; a Redis lease elects one at a time (a stale leader is harmless: every state
change is a compare-and-set and submission ids are idempotent). Each tick:

1. promote queued batches whose retry backoff elapsed;
2. expire queued batches past their deadline;
3. poll the Ray job of every in-flight batch:
   - cancel requested / deadline passed -> stop the job, wait for it, report partial results;
   - unknown to Ray -> resubmit if the submission was never confirmed, else *lost* -> retry;
   - running but silent past the heartbeat timeout -> stop it, wait until Ray says it ended (a
     stop that fails is tried again), then retry: two attempts never run at once;
   - succeeded -> ``finalizing`` -> read the manifest -> ``completed`` (or what the manifest says);
   - failed -> non-retriable exit codes fail at once (+ dead letter), others retry with backoff up
     to ``max_attempts``, then ``failed`` + dead letter ``attempts_exhausted``;
4. launch ready batches while fewer than ``max_in_flight`` hold a job (priority, then age); with
   shared engines only while the model's replicas have room (:class:`~dispatcher.scheduler.Admission`);
5. publish pending terminal events (and dead letters) idempotently;
6. publish throttled progress events, refresh gauges.

Starting an attempt (its spec, the engines' room, the submission) is :mod:`dispatcher.launcher`'s;
what a batch's outcome is when it did not end with its own manifest, :mod:`dispatcher.outcomes`'.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

from dispatcher import logs, states
from dispatcher.backend import (
    EXIT_ENGINE_UNAVAILABLE,
    EXIT_INPUT_NOT_FOUND,
    NON_RETRIABLE_EXITS,
    JobBackend,
    JobInfo,
    JobState,
)
from dispatcher.errors import DispatcherError, ManifestInvalid
from dispatcher.events import Outcome, build_progress, safe_counts, terminal_fields
from dispatcher.input_sizes import InputSizes, SizeOf
from dispatcher.job_cleanup import JobCleanup
from dispatcher.jobspec import results_prefix
from dispatcher.keys import BatchKey, Keys
from dispatcher.launcher import STOP_FIELDS, Launcher
from dispatcher.metrics import Metrics
from dispatcher.outcomes import OutcomeReader, counter, outcome_from_manifest, ray_message_summary
from dispatcher.publisher import EventProducer, TerminalPublisher
from dispatcher.record_reader import RecordReader
from dispatcher.request_body import RequestBodies
from dispatcher.results import ResultStore
from dispatcher.scheduler import launch_slots
from dispatcher.settings import DispatcherSettings
from dispatcher.states import State
from dispatcher.store import BatchRecord, StateStore
from schemas.dlt import DltReason
from schemas.job import MANIFEST_NAME, JobSpec
from schemas.openai import Usage

log = logging.getLogger(__name__)
T = TypeVar("T")

LEASE = "tracker"
WARN_EVERY_S = 30.0  # the same dependency outage is logged at most this often
FAST_POLL_S = 0.2
MIN_TICK_GAP_S = 0.05  # poll interval while a submitted job has not started yet (event -> RUNNING latency)
HEARTBEAT = "heartbeat"  # stop reason of a hung attempt


class Tracker:
    def __init__(
        self,
        settings: DispatcherSettings,
        store: StateStore,
        backend: JobBackend,
        results: ResultStore,
        producer: EventProducer,
        metrics: Metrics,
        *,
        crash: Callable[[str], None] = lambda point: None,
        clock: Callable[[], float] = time.time,
        bodies: RequestBodies | None = None,
        input_sizes: SizeOf | None = None,
    ) -> None:
        self.settings = settings
        self.opts = settings.dispatcher
        self.store = store
        self.keys: Keys = store.keys
        self.backend = backend
        self.results = results
        self.producer = producer
        self.metrics = metrics
        self.crash = crash
        self.clock = clock
        self.policy = self.opts.attempt_policy
        topics = settings.kafka.topics
        self.job_cleanup = JobCleanup(
            store,
            backend,
            retry_after_s=self.opts.job_delete_recheck_s,
            settle_s=self.opts.job_delete_settle_s,
            clock=clock,
        )
        bodies = bodies or RequestBodies(RecordReader(settings.kafka))
        self.publisher = TerminalPublisher(
            store,
            producer,
            results_topic=topics.results,
            dlt_topic=topics.dead_letter,
            group_id=self.opts.group_id,
            source=self.opts.source,
            metrics=metrics,
            crash=crash,
            after_publish=self.forget_jobs,
            bodies=bodies,
        )
        self.token = f"{self.opts.instance_id}/{uuid.uuid4().hex[:8]}"
        self.is_leader = False
        self.last_tick = time.monotonic()
        self._progress_at: dict[BatchKey, float] = {}
        self._progress_sig: dict[BatchKey, tuple[int, ...]] = {}
        self._sweep_at = 0.0
        self._cleanup_at = time.monotonic()
        self._stopping = asyncio.Event()
        self._wake = asyncio.Event()
        self._warned: dict[str, float] = {}
        self._sem = asyncio.Semaphore(16)
        self.outcomes = OutcomeReader(settings, store, results, clock=clock)
        if input_sizes is None:
            input_sizes = InputSizes(self._object_size)
        self.launcher = Launcher(settings, store, backend, bodies, metrics, self.outcomes,
                                 finish=self.finish, clock=clock, crash=crash, size_of=input_sizes)

    async def _object_size(self, uri: str) -> int | None:
        return await self.results.object_size(uri)

    # -- loop ----------------------------------------------------------------------------------------
    def request_stop(self) -> None:
        self._stopping.set()
        self._wake.set()

    def wake(self) -> None:
        """Run the next tick now (new batches were queued by this replica's consumer)."""
        self._wake.set()

    async def run(self) -> None:
        keeper = asyncio.create_task(self._keep_lease(), name="tracker-lease")
        try:
            while not self._stopping.is_set():
                self.last_tick = time.monotonic()
                if self.is_leader:
                    try:
                        await self.tick()
                    except DispatcherError as exc:
                        log.warning("tracker tick incomplete", extra={"error": str(exc)})
                    except Exception:
                        log.exception("tracker tick failed")
                interval = self.opts.poll_interval_s
                if self.launcher.awaiting_start:
                    interval = min(interval, FAST_POLL_S)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), interval)
                self._wake.clear()
                # a burst of wake-ups (intake at full speed) still ticks at most every MIN_TICK_GAP_S
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), MIN_TICK_GAP_S)
        finally:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await keeper
            if self.is_leader:
                with contextlib.suppress(Exception):
                    await self.store.release_lease(LEASE, self.token)
                self._set_leader(False)

    async def _keep_lease(self) -> None:
        """Acquire or renew the lease every third of its TTL, independently of how long a tick takes."""
        while not self._stopping.is_set():
            try:
                leader = await self.store.acquire_lease(LEASE, self.token, self.opts.lease_ttl_s)
            except DispatcherError as exc:
                self.metrics.transient_errors.labels(component="redis").inc()
                log.warning("lease check failed", extra={"error": str(exc)})
                leader = False
            self._set_leader(leader)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.opts.lease_ttl_s / 3)

    def _postponed(self, what: str, exc: DispatcherError) -> None:
        """A step that met an outage: counted each time, logged once per component every
        ``WARN_EVERY_S`` (an outage meets every launch and every batch's step, tick after tick)."""
        component = _component(exc)
        self.metrics.transient_errors.labels(component=component).inc()
        now = time.monotonic()
        if now - self._warned.get(component, -1e9) > WARN_EVERY_S:
            self._warned[component] = now
            log.warning(f"{what} postponed (repeats are not logged for a while)",
                        extra={"error": str(exc), "component": component})

    def _set_leader(self, leader: bool) -> None:
        if leader != self.is_leader:
            log.info("tracker leadership " + ("acquired" if leader else "lost"))
        self.is_leader = leader
        self.metrics.leader.set(1 if leader else 0)

    async def forget_jobs(self, record: BatchRecord) -> None:
        """Delete the Ray jobs of a batch whose terminal event is out (see :mod:`dispatcher.job_cleanup`)."""
        await self.job_cleanup.forget(record)

    async def tick(self) -> None:
        await self.store.promote_due()
        await self.expire_queued()
        await self.poll_in_flight()
        await self.launch()
        await self.publisher.publish_pending()
        await self.refresh_gauges()
        now = time.monotonic()
        if now - self._sweep_at > 300:
            self._sweep_at = now
            await self.store.sweep_finished()
        if now - self._cleanup_at > 10:
            self._cleanup_at = now
            await self.job_cleanup.retry_due()

    async def _each(self, records: list[BatchRecord], fn: Callable[[BatchRecord], Awaitable[None]]) -> None:
        async def guarded(record: BatchRecord) -> None:
            async with self._sem:
                with logs.bind(
                    batch_id=record.batch_id,
                    tenant=record.tenant,
                    attempt=record.attempt,
                    trace_id=logs.trace_id_of(record.get("traceparent")),
                ):
                    try:
                        await fn(record)
                    except DispatcherError as exc:
                        if exc.retriable:
                            self._postponed("batch step", exc)
                        else:
                            log.error("batch step failed", extra={"error": str(exc)})
                    except Exception:
                        log.exception("batch step crashed")
                    finally:
                        self.last_tick = time.monotonic()  # a long tick that moves is not a stall

        await asyncio.gather(*(guarded(r) for r in records))

    # -- 2. deadlines of queued batches --------------------------------------------------------------
    async def expire_queued(self) -> None:
        """Finish queued batches past their deadline, and queued retries a cancel asked to stop
        (:meth:`StateStore.due_now` puts them in the deadline index)."""
        now = self.clock()
        ids = await self.store.due_deadlines(now, limit=500)
        records = [
            r
            for r in await self.store.get_many(ids)
            if r is not None and r.state in {State.ACCEPTED, State.QUEUED}
        ]
        stops = [(r, self._stop_reason(r, now)) for r in records]
        due = {r.key: reason for r, reason in stops if reason in {"cancel", "deadline"}}
        await self._each([r for r in records if r.key in due],
                         lambda r: self.finish_stopped(r, due[r.key]))

    # -- 3. in-flight --------------------------------------------------------------------------------
    async def poll_in_flight(self) -> None:
        ids: list[BatchKey] = []
        for state in (State.SUBMITTED, State.RUNNING, State.FINALIZING):
            found = await self.store.ids_in_state(state, limit=10_000)
            if state is State.SUBMITTED:
                self.launcher.awaiting_start = bool(found)
            ids += found
        records = [r for r in await self.store.get_many(ids) if r is not None and r.state in states.IN_FLIGHT]
        await self._each(records, self.check)

    def _stop_reason(self, record: BatchRecord, now: float) -> str | None:
        if record.flag("cancel_requested"):
            return "cancel"
        deadline = record.deadline
        if deadline is not None and now >= deadline:
            return "deadline"
        if record.get("stop_reason") == HEARTBEAT:
            return HEARTBEAT
        return None

    async def check(self, record: BatchRecord) -> None:
        sid = record.submission_id
        if not sid:  # cannot happen: launch records it with the transition
            await self.retry_or_fail(record, "internal_error", "in flight without a submission id")
            return
        now = self.clock()
        if record.state is State.FINALIZING:
            await self.finish_succeeded(record)
            return
        info = await self.backend.status(sid)
        reason = self._stop_reason(record, now)
        if reason is not None and info.state is not JobState.SUCCEEDED:
            await self.stop_then_finish(record, info, reason, now)
            return
        if info.state is JobState.NOT_FOUND:
            if record.state is State.SUBMITTED and not record.flag("confirmed"):
                await self.submit(record)
            else:
                self.metrics.attempts.labels(event="lost").inc()
                log.warning("job lost: Ray does not know it", extra={"submission_id": sid})
                await self.retry_or_fail(
                    record, "job_lost",
                    f"Ray no longer knows attempt {sid} (a restarted Ray head, or a replaced batch-runner "
                    "replica on the short path)",
                )
        elif info.state is JobState.PENDING:
            await self._confirm(record)
            submitted_at = record.number("submitted_at") or now
            if now - submitted_at > self.opts.submitted_timeout_s:
                await self.backend.stop(sid)
                self.metrics.attempts.labels(event="stuck").inc()
                await self.retry_or_fail(
                    record, "job_stuck_pending", f"job {sid} stayed PENDING for {now - submitted_at:.0f}s"
                )
        elif info.state is JobState.RUNNING:
            if record.state is State.SUBMITTED:
                await self.mark_running(record, info)
            else:
                await self.check_heartbeat(record, info, now)
                await self.maybe_progress(record, now)
        elif info.state is JobState.SUCCEEDED:
            await self.finish_succeeded(record)
        elif info.state is JobState.FAILED:
            await self.job_failed(record, info)
        elif info.state is JobState.STOPPED:
            self.metrics.attempts.labels(event="stopped").inc()
            await self.retry_or_fail(record, "job_stopped", f"job {sid} was stopped outside the dispatcher")

    async def _confirm(self, record: BatchRecord) -> None:
        if not record.flag("confirmed"):
            await self.store.transition(
                record.key,
                record.state,
                from_states=[record.state],
                expected_version=record.version,
                fields={"confirmed": "1"},
            )

    async def mark_running(self, record: BatchRecord, info: JobInfo) -> None:
        now = self.clock()
        first_start = record.number("started_at")
        result = await self.store.transition(
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
        """A job Ray calls RUNNING that sent no heartbeat for ``heartbeat_timeout_s`` is hung: it is
        stopped, and the next attempt starts only once Ray says this one ended (or after
        ``job.stop_wait_s``), never beside it; a stop that fails (Ray unreachable) is tried again at
        the next check instead of being taken as done."""
        if not self.settings.job.pass_redis_url:  # the job has nowhere to send heartbeats
            return
        progress = await self.store.read_progress(record.key)
        beat = 0.0
        if progress.get("attempt") == str(record.attempt):
            with contextlib.suppress(ValueError):
                beat = float(progress.get("heartbeat_at") or 0)
        last = max(beat, record.number("running_at") or 0.0, record.number("attempt_started_at") or 0.0)
        if last and now - last > self.opts.heartbeat_timeout_s:
            self.metrics.attempts.labels(event="heartbeat_expired").inc()
            log.warning("job heartbeat expired; stopping it", extra={"silent_s": round(now - last, 1)})
            await self.stop_then_finish(record, info, HEARTBEAT, now)

    async def job_failed(self, record: BatchRecord, info: JobInfo) -> None:
        code = info.exit_code
        message = f"job {record.submission_id} failed"
        if code is not None:
            message += f" with exit code {code}"
        summary = ray_message_summary(info.message)
        if summary:
            message += f": {summary}"
        message += " (the end of the driver's log is in the dispatcher's log)"
        if info.message:
            log.warning("job failed", extra={"submission_id": record.submission_id, "exit_code": code,
                                             "ray_message": info.message[-2000:]})
        self.metrics.attempts.labels(event="failed").inc()
        if code == EXIT_ENGINE_UNAVAILABLE:  # waiting again on every retry would not help
            await self.retry_or_fail(record, "engine_unavailable", message, retriable=False,
                                     dlt_reason=DltReason.ATTEMPTS_EXHAUSTED)
        elif code in NON_RETRIABLE_EXITS:
            reason = DltReason.INPUT_NOT_FOUND if code == EXIT_INPUT_NOT_FOUND else DltReason.INPUT_INVALID
            await self.retry_or_fail(record, str(reason), message, retriable=False, dlt_reason=reason)
        else:
            await self.retry_or_fail(record, info.error_type or "job_failed", message)

    async def retry_or_fail(
        self,
        record: BatchRecord,
        code: str,
        message: str,
        *,
        retriable: bool = True,
        dlt_reason: DltReason | None = None,
    ) -> None:
        decision = self.policy.after_failure(max(1, record.attempts_made), retriable=retriable)
        now = self.clock()
        if decision.retry:
            result = await self.store.transition(
                record.key,
                State.QUEUED,
                expected_version=record.version,
                from_states=[State.SUBMITTED, State.RUNNING, State.FINALIZING],
                fields={"last_error_code": code, "last_error_message": message[:2000]},
                delete=[*STOP_FIELDS, "confirmed"],
                not_before=now + decision.delay_s,
            )
            if result.ok:
                self.metrics.attempts.labels(event="retried").inc()
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
            await self.backend.stop(sid)
            self.metrics.attempts.labels(event="stop_requested").inc()
            log.info("stopping job", extra={"reason": reason, "submission_id": sid})
            await self.store.transition(
                record.key,
                record.state,
                from_states=[record.state],
                expected_version=record.version,
                fields={"stop_reason": reason, "stop_requested_at": repr(now)},
            )
        elif now - requested > self.settings.job.stop_wait_s:
            log.warning("job did not stop in time; finishing without it", extra={"submission_id": sid})
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
            error_code=None if state is State.CANCELLED else "deadline_exceeded",
            error_message=None if state is State.CANCELLED else message,
        )
        await self.finish(record, outcome)

    async def finish_succeeded(self, record: BatchRecord) -> None:
        if record.state is not State.FINALIZING:
            result = await self.store.transition(
                record.key,
                State.FINALIZING,
                expected_version=record.version,
                fields={"confirmed": "1", "job_ended_at": repr(self.clock())},
            )
            if not result.ok:
                return
            self.crash("after_job_end")
            record = await self.store.get(record.key) or record
        prefix = results_prefix(self.settings, record)
        try:
            manifest = await self.results.read_manifest(prefix)
        except ManifestInvalid as exc:
            manifest, problem = None, str(exc)
        else:
            problem = f"no manifest at {prefix}manifest.json"
        if manifest is None or manifest.attempt != record.attempt:
            if manifest is not None:
                problem = f"manifest of attempt {manifest.attempt}, expected {record.attempt}"
            await self.retry_or_fail(record, "manifest_missing", problem)
            return
        if manifest.status == "partial":  # exit 0 but not everything written: run the rest again
            detail = manifest.error.message if manifest.error else "the job stopped early"
            await self.retry_or_fail(record, "job_partial", detail)
            return
        outcome = outcome_from_manifest(manifest, record, self.clock(), prefix + MANIFEST_NAME)
        await self.finish(record, outcome)

    async def finish(self, record: BatchRecord, outcome: Outcome) -> None:
        result = await self.store.transition(
            record.key,
            outcome.state,
            expected_version=record.version,
            fields=terminal_fields(record, outcome),
            delete=STOP_FIELDS,
        )
        if result.ok:
            self._progress_at.pop(record.key, None)
            self._progress_sig.pop(record.key, None)
            self.metrics.attempts.labels(event=outcome.state.value).inc()
            log.info(
                "batch finished", extra={"status": outcome.state.value, "error_code": outcome.error_code}
            )

    # -- 4. launch -----------------------------------------------------------------------------------
    async def launch(self) -> None:
        in_flight = await self.store.in_flight_count()
        slots = launch_slots(in_flight, self.opts.launch_limit)
        admission = await self.launcher.admission() if self.opts.shared_engines and slots else None
        # a few extra: cancelled or expired entries at the head are finished, not launched (and with
        # shared engines a model without room must not hold back the other models' batches)
        extra = 64 if admission is not None else 8
        ids = await self.store.ready_ids(slots + extra if slots else 8)
        if not ids:
            return
        launched = 0
        for record in await self.store.get_many(ids):
            if record is None or record.state is not State.QUEUED:
                continue
            with logs.bind(batch_id=record.batch_id, tenant=record.tenant,
                           trace_id=logs.trace_id_of(record.get("traceparent"))):
                reason = self._stop_reason(record, self.clock())
                try:
                    if reason is not None:
                        await self.finish_stopped(record, reason)
                    elif (
                        launched < slots
                        and await self.launcher.admits(admission, record)
                        and await self.launcher.start_attempt(record)
                    ):
                        launched += 1
                except DispatcherError as exc:
                    if not exc.retriable:
                        log.warning("launch postponed", extra={"error": str(exc)})
                        continue
                    self._postponed("launch", exc)
                    return
        if admission is not None:
            for model in self.settings.engines.models:
                self.metrics.admitted.labels(model=model).set(admission.requests(model))
                self.metrics.admission_waiting.labels(model=model).set(1 if model in admission.blocked else 0)

    async def job_spec(self, record: BatchRecord, attempt: int) -> JobSpec:
        """The spec of an attempt (see :meth:`Launcher.job_spec`)."""
        return await self.launcher.job_spec(record, attempt)

    async def start_attempt(self, record: BatchRecord) -> bool:
        """Start the next attempt of a queued batch (see :meth:`Launcher.start_attempt`)."""
        return await self.launcher.start_attempt(record)

    async def submit(self, record: BatchRecord, spec: JobSpec | None = None) -> None:
        """Submit (or resubmit) the record's current attempt (see :meth:`Launcher.submit`)."""
        await self.launcher.submit(record, spec)

    @property
    def bodies(self) -> RequestBodies:
        """Where the request bodies Redis does not keep are read back from (the topic)."""
        return self.launcher.bodies

    @bodies.setter
    def bodies(self, value: RequestBodies) -> None:
        self.launcher.bodies = value

    @property
    def engine_replicas(self) -> dict[str, int]:
        """Live replicas per model (set by the service from the engines' figures): admission capacity."""
        return self.launcher.engine_replicas

    @engine_replicas.setter
    def engine_replicas(self, value: dict[str, int]) -> None:
        self.launcher.engine_replicas = value

    # -- 5/6. progress and gauges ----------------------------------------------------------------------
    async def maybe_progress(self, record: BatchRecord, now: float) -> None:
        last = self._progress_at.get(record.key, 0.0)
        if now - last < self.opts.progress_interval_s:
            return
        progress = await self.store.read_progress(record.key)
        if not progress:
            return
        counts = safe_counts(
            {k: counter(progress.get(k)) for k in ("total", "completed", "failed")},
            int(record.get("total") or 0) or None,
        )
        usage = Usage(
            prompt_tokens=counter(progress.get("prompt_tokens")),
            completion_tokens=counter(progress.get("completion_tokens")),
        )
        sig = (record.attempt, counts.total, counts.completed, counts.failed)
        self._progress_at[record.key] = now
        if self._progress_sig.get(record.key) == sig:
            return
        self._progress_sig[record.key] = sig
        envelope = build_progress(record, counts, usage, source=self.opts.source, now=now)
        await self.producer.publish(self.settings.kafka.topics.results, envelope)

    async def refresh_gauges(self) -> None:
        counts = await self.store.counts()
        for state, n in counts.items():
            self.metrics.batches.labels(state=state.value).set(n)
        self.metrics.in_flight.set(sum(counts[s] for s in states.IN_FLIGHT))


def _component(exc: DispatcherError) -> str:
    return {
        "redis_unavailable": "redis",
        "kafka_unavailable": "kafka",
        "ray_unavailable": "ray",
        "storage_unavailable": "s3",
    }.get(exc.code, "other")
