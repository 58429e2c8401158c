"""dispatcher.in_flight: what one check of an in-flight batch does, for each answer of its job's backend.

The store, backend, results and producer are small in-memory stand-ins that record what was asked of
them; the decisions (retry or fail, stop then wait, finalize, progress) are the real code's. The same
paths run against real Redis in tests/integration/test_dispatcher_tracker.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypedDict, cast

import pytest
from pydantic import SecretStr

from llmbatch.dispatcher.backends.backend import (
    EXIT_ENGINE_UNAVAILABLE,
    EXIT_INPUT_NOT_FOUND,
    JobInfo,
    JobState,
    SubmitResult,
)
from llmbatch.dispatcher.domain.batch_record import BatchRecord, TransitionResult
from llmbatch.dispatcher.domain.events import Outcome
from llmbatch.dispatcher.domain.keys import Keys, batch_key
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.errors import RayUnavailable, StorageUnavailable
from llmbatch.dispatcher.kafka.record_reader import RecordReader
from llmbatch.dispatcher.kafka.request_body import RequestBodies
from llmbatch.dispatcher.metrics import Metrics
from llmbatch.dispatcher.runs.context import RunContext
from llmbatch.dispatcher.runs.endings import HEARTBEAT
from llmbatch.dispatcher.runs.finisher import Finisher
from llmbatch.dispatcher.runs.in_flight import InFlight
from llmbatch.dispatcher.runs.launcher import UNSENT, Launcher
from llmbatch.dispatcher.runs.outcomes import OutcomeReader
from llmbatch.dispatcher.runs.results import Shards
from llmbatch.dispatcher.settings import DispatcherOptions, DispatcherSettings
from llmbatch.schemas.deadlines import DEADLINE_EXCEEDED
from llmbatch.schemas.job import JobSpec, Manifest, Timings
from llmbatch.schemas.openai import ErrorObject
from llmbatch.settings import RedisSettings
from tests.support.dispatcher_kit import MODEL, batch_request, inline_lines, registry, request_message

pytestmark = pytest.mark.unit

NOW = 1_790_000_000.0
SID = "b-1-a1"


@dataclass
class Store:
    keys: Keys = field(default_factory=lambda: Keys("p"))
    transitions: list[tuple[State, dict[str, Any]]] = field(default_factory=list)
    progress: dict[str, str] = field(default_factory=dict)
    refuse: bool = False  # every compare-and-set loses (another replica moved the batch)

    async def transition(self, batch_id: str, to: State, **kwargs: Any) -> TransitionResult:
        if self.refuse:
            return TransitionResult(False, "conflict", None, 4)
        fields = dict(kwargs.get("fields") or {})
        if "not_before" in kwargs:
            fields["not_before"] = kwargs["not_before"]
        self.transitions.append((to, fields))
        return TransitionResult(True, "ok", to, 4)

    async def get(self, batch_id: str) -> BatchRecord | None:
        return None

    async def read_progress(self, batch_id: str) -> dict[str, str]:
        return dict(self.progress)

    @property
    def states(self) -> list[State]:
        return [to for to, _ in self.transitions]


@dataclass
class Backend:
    info: JobInfo = field(default_factory=lambda: JobInfo(JobState.RUNNING))
    stopped: list[str] = field(default_factory=list)
    submitted: list[str] = field(default_factory=list)
    down: bool = False  # the Ray head or the batch runner does not answer
    stop_fails: bool = False  # a stop call times out (the status still answers)

    async def submit(self, spec: JobSpec) -> SubmitResult:
        self.submitted.append(spec.submission_id)
        return SubmitResult(spec.submission_id, already_existed=True, via="ray_job")

    async def status(self, submission_id: str) -> JobInfo:
        if self.down:
            raise RayUnavailable("the batch runner did not answer")
        return self.info

    async def stop(self, submission_id: str) -> bool:
        if self.down:
            raise RayUnavailable("the batch runner did not answer")
        self.stopped.append(submission_id)
        if self.stop_fails:
            raise RayUnavailable("the stop call timed out")
        return True


class NoKafka:
    async def read(self, ref: Any) -> None:
        raise AssertionError("the request is kept in Redis: Kafka is not read")


@dataclass
class Results:
    down: bool = False  # MinIO/S3 does not answer
    manifest: Manifest | None = None  # what the attempts left

    async def read_manifest(self, output_prefix: str) -> Manifest | None:
        if self.down:
            raise StorageUnavailable("S3 did not answer")
        return self.manifest

    async def list_shards(self, output_prefix: str) -> Shards:
        return Shards([], [])


@dataclass
class Producer:
    published: list[tuple[str, Any]] = field(default_factory=list)

    async def publish(self, topic: str, envelope: Any) -> None:
        self.published.append((topic, envelope))


@dataclass
class Kit:
    checks: InFlight
    store: Store
    backend: Backend
    producer: Producer
    clock: list[float]
    results: Results


def kit(**options: Any) -> Kit:
    settings = DispatcherSettings(
        _env_file=None,
        redis=RedisSettings(url="redis://redis:6379/0", password=SecretStr("pw"), key_prefix="p"),
        engines=registry(),
        dispatcher=DispatcherOptions(**options),
    )
    store, backend, producer, clock = Store(), Backend(), Producer(), [NOW]
    results = Results()

    def now() -> float:
        return clock[0]

    ctx = RunContext(settings, store, backend, results, producer, Metrics(), clock=now)  # type: ignore[arg-type]
    outcomes, finisher = OutcomeReader(ctx), Finisher(ctx)
    launcher = Launcher(
        ctx, outcomes, finisher, bodies=RequestBodies(cast(RecordReader, NoKafka())), size_of=_no_size
    )
    checks = InFlight(ctx, outcomes, finisher, launcher)
    return Kit(checks, store, backend, producer, clock, results)


async def _no_size(uri: str) -> int | None:
    return None


def record(state: State, attempt: int = 1, **extra: str) -> BatchRecord:
    _, value, _ = request_message(batch_request("b-1", requests=inline_lines(5)))
    fields = {
        "state": state.value,
        "version": "3",
        "request": value.decode(),
        "attempt": str(attempt),
        "total": "5",
        "submission_id": SID,
        "confirmed": "1",
        "submitted_at": repr(NOW - 5),
    }
    fields.update(extra)
    return BatchRecord.from_hash(batch_key(None, "b-1"), fields)


class CancelFields(TypedDict):
    cancel_requested: str
    cancel_requested_at: str


def terminal(store: Store) -> tuple[State, Outcome]:
    [(to, fields)] = store.transitions
    return to, Outcome.from_json(fields["outcome"])


# --- what the job's backend says ------------------------------------------------------------------


async def test_a_submission_ray_never_confirmed_is_submitted_again() -> None:
    k = kit()
    k.backend.info = JobInfo(JobState.NOT_FOUND)
    await k.checks.check(record(State.SUBMITTED, confirmed="0"))
    assert k.backend.submitted == [SID]  # the same attempt again, by its submission id
    [(to, fields)] = k.store.transitions
    assert to is State.SUBMITTED and fields["confirmed"] == "1"


async def test_an_attempt_the_leader_left_unsent_is_submitted_without_asking_the_backend() -> None:
    """Another replica launched it and left the submit to this one (the batch's shard holder)."""
    k = kit()
    k.backend.down = True  # a status asked would raise: the attempt was never sent, nothing to ask
    await k.checks.check(record(State.SUBMITTED, confirmed=UNSENT))
    assert k.backend.submitted == [SID]
    [(to, fields)] = k.store.transitions
    assert to is State.SUBMITTED and fields["confirmed"] == "1"


async def test_an_unsent_attempt_whose_request_no_longer_validates_ends_the_batch_invalid() -> None:
    k = kit()
    await k.checks.check(record(State.SUBMITTED, confirmed=UNSENT, request='{"batch_id": "b-1"}'))
    assert k.backend.submitted == []
    to, outcome = terminal(k.store)
    assert to is State.FAILED and outcome.error_code == "input_invalid"


async def test_an_unsent_attempt_cancelled_before_its_submit_is_never_submitted() -> None:
    k = kit()
    k.backend.info = JobInfo(JobState.NOT_FOUND)
    await k.checks.check(record(State.SUBMITTED, confirmed=UNSENT, cancel_requested="1"))
    assert k.backend.submitted == []
    assert State.CANCELLED in k.store.states


async def test_a_confirmed_job_ray_forgot_is_lost_and_retried_after_the_backoff() -> None:
    k = kit()
    k.backend.info = JobInfo(JobState.NOT_FOUND)
    await k.checks.check(record(State.RUNNING))
    [(to, fields)] = k.store.transitions
    assert to is State.QUEUED and fields["last_error_code"] == "job_lost"
    assert fields["not_before"] > NOW and k.backend.submitted == []


async def test_a_submitted_attempt_ray_confirmed_then_forgot_is_lost_not_submitted_twice() -> None:
    k = kit()
    k.backend.info = JobInfo(JobState.NOT_FOUND)
    await k.checks.check(record(State.SUBMITTED))  # confirmed: Ray knew it once (a restarted head)
    assert k.backend.submitted == [] and k.store.states == [State.QUEUED]


async def test_a_job_pending_too_long_is_stopped_and_retried() -> None:
    k = kit(submitted_timeout_s=60)
    k.backend.info = JobInfo(JobState.PENDING)
    await k.checks.check(record(State.SUBMITTED, submitted_at=repr(NOW - 61)))
    assert k.backend.stopped == [SID]
    assert k.store.states == [State.QUEUED]
    assert k.store.transitions[0][1]["last_error_code"] == "job_stuck_pending"


async def test_a_pending_job_is_confirmed_once_and_left_to_start() -> None:
    k = kit(submitted_timeout_s=60)
    k.backend.info = JobInfo(JobState.PENDING)
    await k.checks.check(record(State.SUBMITTED, confirmed="0"))
    assert k.store.transitions == [(State.SUBMITTED, {"confirmed": "1"})]
    await k.checks.check(record(State.SUBMITTED))  # already confirmed: nothing to write
    assert len(k.store.transitions) == 1 and k.backend.stopped == []


async def test_a_started_job_marks_the_batch_running_keeping_its_first_start() -> None:
    k = kit()
    k.backend.info = JobInfo(JobState.RUNNING, start_time=NOW - 2)
    await k.checks.check(record(State.SUBMITTED, attempt=2, started_at=repr(NOW - 900)))
    [(to, fields)] = k.store.transitions
    assert to is State.RUNNING
    assert float(fields["started_at"]) == NOW - 900  # the batch's, not this attempt's
    assert float(fields["attempt_started_at"]) == NOW - 2


async def test_a_job_stopped_outside_the_dispatcher_is_retried() -> None:
    k = kit()
    k.backend.info = JobInfo(JobState.STOPPED)
    await k.checks.check(record(State.RUNNING))
    assert k.store.states == [State.QUEUED]
    assert k.store.transitions[0][1]["last_error_code"] == "job_stopped"


async def test_a_record_in_flight_without_a_submission_id_is_retried_not_polled() -> None:
    k = kit()
    k.backend.info = JobInfo(JobState.SUCCEEDED)  # must not be asked
    await k.checks.check(record(State.RUNNING, submission_id=""))
    assert k.store.transitions[0][1]["last_error_code"] == "internal_error"


# --- failures ---------------------------------------------------------------------------------------


async def test_a_missing_input_fails_at_once_with_its_own_reason() -> None:
    k = kit()
    k.backend.info = JobInfo(JobState.FAILED, exit_code=EXIT_INPUT_NOT_FOUND)
    await k.checks.check(record(State.RUNNING, attempt=1))
    to, outcome = terminal(k.store)
    assert to is State.FAILED and outcome.error_code == "input_not_found"
    assert outcome.dlt_reason == "input_not_found"


async def test_an_engine_that_never_answered_fails_the_batch_without_retries() -> None:
    k = kit()
    k.backend.info = JobInfo(JobState.FAILED, exit_code=EXIT_ENGINE_UNAVAILABLE, message="no engine")
    await k.checks.check(record(State.RUNNING, attempt=1))
    to, outcome = terminal(k.store)
    assert to is State.FAILED and outcome.error_code == "engine_unavailable"
    assert outcome.dlt_reason == "attempts_exhausted"


async def test_a_retriable_failure_retries_until_the_attempts_run_out() -> None:
    k = kit(max_attempts=3)
    k.backend.info = JobInfo(JobState.FAILED, exit_code=1, error_type="DriverCrashed")
    await k.checks.check(record(State.RUNNING, attempt=2))
    assert k.store.states == [State.QUEUED]
    assert k.store.transitions[0][1]["last_error_code"] == "DriverCrashed"
    k.store.transitions.clear()
    await k.checks.check(record(State.RUNNING, attempt=3))
    to, outcome = terminal(k.store)
    assert to is State.FAILED and outcome.error_code == "attempts_exhausted"
    assert "3 attempt(s) failed; last: DriverCrashed" in (outcome.error_message or "")


def stopped_for_deadline(attempt: int) -> Manifest:
    """The partial manifest an attempt writes when its node's clock says its deadline passed."""
    at = datetime.fromtimestamp(NOW, UTC)
    return Manifest(
        batch_id="b-1",
        attempt=attempt,
        status="partial",
        timings=Timings(started_at=at, finished_at=at),
        error=ErrorObject(code=DEADLINE_EXCEEDED, message="the attempt was stopped early (deadline)"),
    )


async def test_an_attempt_stopped_by_a_clock_ahead_waits_for_the_deadline_instead_of_failing() -> None:
    """The chaos run's job clock +120 s stopped every attempt of a batch with a 3 s deadline at once:
    counted as failures, its last attempt failed it 0.16 s before it would have expired."""
    k = kit(max_attempts=3)
    k.backend.info = JobInfo(JobState.FAILED, exit_code=1)
    k.results.manifest = stopped_for_deadline(3)
    deadline = NOW + 2
    await k.checks.check(record(State.RUNNING, attempt=3, deadline=repr(deadline)))
    [(to, fields)] = k.store.transitions
    assert to is State.QUEUED and fields["not_before"] == deadline  # not run again before it
    assert fields["last_error_code"] == DEADLINE_EXCEEDED and fields["infra_retries"] == "1"
    # past the deadline on this dispatcher's clock: it expires at once, keeping what it has
    k.store.transitions.clear()
    k.clock[0] = deadline + 1
    await k.checks.job_failed(record(State.RUNNING, attempt=3, deadline=repr(deadline)), k.backend.info)
    to, outcome = terminal(k.store)
    assert to is State.EXPIRED and outcome.error_code == DEADLINE_EXCEEDED


async def test_an_earlier_attempts_deadline_stop_does_not_excuse_this_attempts_failure() -> None:
    k = kit(max_attempts=3)
    k.backend.info = JobInfo(JobState.FAILED, exit_code=1)
    k.results.manifest = stopped_for_deadline(2)
    await k.checks.check(record(State.RUNNING, attempt=3, deadline=repr(NOW + 2)))
    to, outcome = terminal(k.store)
    assert to is State.FAILED and outcome.error_code == "attempts_exhausted"


async def test_a_lost_compare_and_set_counts_no_retry() -> None:
    k = kit()
    k.store.refuse = True
    k.backend.info = JobInfo(JobState.STOPPED)
    metrics = k.checks.ctx.metrics.attempts.labels(event="retried")
    before = metrics._value.get()
    await k.checks.check(record(State.RUNNING))
    assert metrics._value.get() == before


# --- stops: cancel, deadline, heartbeat ---------------------------------------------------------------


def test_stop_reasons_in_order_cancel_then_deadline_then_heartbeat() -> None:
    k = kit()
    past = repr(NOW - 1)
    assert k.checks.stop_reason(record(State.RUNNING), NOW) is None
    assert k.checks.stop_reason(record(State.RUNNING, stop_reason=HEARTBEAT), NOW) == HEARTBEAT
    late = record(State.RUNNING, stop_reason=HEARTBEAT, deadline=past)
    assert k.checks.stop_reason(late, NOW) == "deadline"
    assert k.checks.stop_reason(record(State.RUNNING, deadline=past, cancel_requested="1"), NOW) == "cancel"
    assert k.checks.stop_reason(record(State.RUNNING, deadline=repr(NOW + 1)), NOW) is None


async def test_a_cancel_stops_the_job_once_then_waits_for_it_then_gives_up_waiting() -> None:
    k = kit()
    running = record(State.RUNNING, cancel_requested="1", cancel_reason="not needed")
    await k.checks.check(running)
    assert k.backend.stopped == [SID]
    assert k.store.transitions == [(State.RUNNING, {"stop_reason": "cancel", "stop_requested_at": repr(NOW)})]
    asked = record(State.RUNNING, cancel_requested="1", stop_requested_at=repr(NOW))
    k.store.transitions.clear()
    k.clock[0] = NOW + 1
    await k.checks.check(asked)  # still running, within job.stop_wait_s: wait, do not stop again
    assert k.backend.stopped == [SID] and k.store.transitions == []
    k.clock[0] = NOW + k.checks.ctx.settings.job.stop_wait_s + 1
    await k.checks.check(asked)
    to, outcome = terminal(k.store)
    assert to is State.CANCELLED and outcome.error_code is None


async def test_a_job_that_ended_after_a_cancel_finishes_the_batch_cancelled_at_once() -> None:
    k = kit()
    k.backend.info = JobInfo(JobState.STOPPED)
    await k.checks.check(record(State.RUNNING, cancel_requested="1", stop_requested_at=repr(NOW)))
    assert terminal(k.store)[0] is State.CANCELLED and k.backend.stopped == []


async def test_a_passed_deadline_expires_the_batch_with_its_code() -> None:
    k = kit()
    k.backend.info = JobInfo(JobState.FAILED, exit_code=1)  # ended by itself: no stop to wait for
    await k.checks.check(record(State.RUNNING, deadline=repr(NOW - 1)))
    to, outcome = terminal(k.store)
    assert to is State.EXPIRED and outcome.error_code == "deadline_exceeded"


async def test_a_succeeded_job_wins_over_a_late_cancel() -> None:
    k = kit()
    k.backend.info = JobInfo(JobState.SUCCEEDED)
    await k.checks.check(record(State.RUNNING, cancel_requested="1"))
    assert k.store.states[0] is State.FINALIZING and k.backend.stopped == []


async def test_a_silent_job_is_stopped_and_its_successor_waits_for_the_stop() -> None:
    k = kit(heartbeat_timeout_s=60)
    k.store.progress = {"attempt": "1", "heartbeat_at": repr(NOW - 5)}
    running = record(State.RUNNING, running_at=repr(NOW - 300))
    await k.checks.check(running)  # the heartbeat is seen
    k.clock[0] = NOW + 61  # and has not changed since, by this dispatcher's clock
    await k.checks.check(running)
    assert k.backend.stopped == [SID]
    asked = {"stop_reason": HEARTBEAT, "stop_requested_at": repr(NOW + 61)}
    assert k.store.transitions == [(State.RUNNING, asked)]
    k.store.transitions.clear()
    k.backend.info = JobInfo(JobState.STOPPED)
    await k.checks.check(record(State.RUNNING, stop_reason=HEARTBEAT, stop_requested_at=repr(NOW + 61)))
    assert k.store.states == [State.QUEUED]
    assert k.store.transitions[0][1]["last_error_code"] == "heartbeat_expired"


async def test_a_heartbeat_of_an_earlier_attempt_does_not_keep_this_one_alive() -> None:
    k = kit(heartbeat_timeout_s=60)
    k.store.progress = {"attempt": "1", "heartbeat_at": repr(NOW)}
    await k.checks.check(record(State.RUNNING, attempt=2, running_at=repr(NOW - 300)))
    assert k.backend.stopped == [SID]
    k2 = kit(heartbeat_timeout_s=60)
    k2.store.progress = {"attempt": "2", "heartbeat_at": repr(NOW - 5)}
    await k2.checks.check(record(State.RUNNING, attempt=2, running_at=repr(NOW - 300)))
    assert k2.backend.stopped == []


async def test_heartbeats_are_judged_on_the_dispatchers_clock_not_the_jobs() -> None:
    """The job node's clock two minutes behind: before, its every heartbeat looked 120 s old and a
    healthy job was stopped as hung at the first check."""
    k = kit(heartbeat_timeout_s=60)
    running = record(State.RUNNING, running_at=repr(NOW - 300))
    for tick in range(6):  # a beat every 30 s, stamped with a clock 120 s behind
        k.clock[0] = NOW + 30 * tick
        k.store.progress = {"attempt": "1", "heartbeat_at": repr(NOW + 30 * tick - 120)}
        await k.checks.check(running)
    assert k.backend.stopped == [] and k.store.transitions == []


async def test_a_job_clock_ahead_does_not_hide_a_hang() -> None:
    k = kit(heartbeat_timeout_s=60)
    k.store.progress = {"attempt": "1", "heartbeat_at": repr(NOW + 120)}  # stamped 2 min ahead, then silent
    running = record(State.RUNNING, running_at=repr(NOW - 300))
    await k.checks.check(running)
    assert k.backend.stopped == []
    k.clock[0] = NOW + 61
    await k.checks.check(running)
    assert k.backend.stopped == [SID]


def test_the_heartbeat_memory_keeps_only_the_batches_in_flight() -> None:
    k = kit()
    for i in range(10_000):
        k.checks._beats[batch_key(None, f"b-{i}")] = ((1, "x"), NOW)
        k.checks.progress._progress_at[batch_key(None, f"b-{i}")] = NOW
    k.checks.keep_only({batch_key(None, "b-7")})
    assert list(k.checks._beats) == ["b-7"] and list(k.checks.progress._progress_at) == ["b-7"]


# --- success and progress -----------------------------------------------------------------------------


async def test_a_succeeded_job_without_its_manifest_is_retried_after_finalizing() -> None:
    k = kit()
    k.backend.info = JobInfo(JobState.SUCCEEDED)
    await k.checks.check(record(State.RUNNING))
    assert k.store.states == [State.FINALIZING, State.QUEUED]
    assert k.store.transitions[1][1]["last_error_code"] == "manifest_missing"


async def test_progress_is_published_when_the_counts_move_and_not_more_often_than_the_interval() -> None:
    k = kit(progress_interval_s=10)
    running = record(State.RUNNING)
    k.store.progress = {"total": "5", "completed": "1", "failed": "0"}
    await k.checks.progress.maybe_publish(running, NOW)
    await k.checks.progress.maybe_publish(running, NOW + 5)  # within the interval
    await k.checks.progress.maybe_publish(running, NOW + 11)  # same counts
    assert len(k.producer.published) == 1
    k.store.progress["completed"] = "3"
    await k.checks.progress.maybe_publish(running, NOW + 22)
    assert len(k.producer.published) == 2
    assert k.producer.published[1][1].data.request_counts.completed == 3


async def test_a_running_batch_behind_its_deadline_is_counted_by_model_and_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """25 of 100 answered in the 100 s since it started: 300 s more at that rate, 200 s left: at risk.
    Then 99 of 100: back on time. The gauge follows; one log line each way."""
    k = kit(progress_interval_s=1)
    running = record(
        State.RUNNING, total="100", model=MODEL, started_at=repr(NOW - 100), deadline=repr(NOW + 200)
    )
    registry = k.checks.ctx.metrics.registry

    def gauge() -> float | None:
        return registry.get_sample_value("llmbatch_batches_at_risk", {"model": MODEL})

    k.store.progress = {"total": "100", "completed": "20", "failed": "5"}
    with caplog.at_level(logging.INFO, logger="llmbatch.dispatcher.runs.progress_events"):
        await k.checks.progress.maybe_publish(running, NOW)
        assert gauge() == 1
        await k.checks.progress.maybe_publish(running, NOW + 2)  # still behind: said once only
        k.store.progress["completed"] = "94"
        await k.checks.progress.maybe_publish(running, NOW + 4)
        assert gauge() == 0
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "batch at risk of missing its deadline at its rate so far",
        "batch back on time for its deadline",
    ], said
    k.store.progress["completed"] = "20"  # behind again, then the batch ends: it counts no more
    await k.checks.progress.maybe_publish(running, NOW + 6)
    assert gauge() == 1
    k.checks.keep_only(set())
    assert gauge() == 0


# --- every batch ends: deadline and cancel on the dispatcher's clock, whatever the others answer ------


async def test_a_deadline_ends_a_running_batch_while_its_runner_does_not_answer() -> None:
    k = kit()
    k.backend.down = True
    k.store.progress = {"total": "5", "completed": "2", "attempt": "1"}
    deadline = NOW - 1
    late = record(State.RUNNING, deadline=repr(deadline))
    await k.checks.check(late)  # the stop is asked (it fails too) and its time remembered
    assert k.store.transitions == [
        (State.RUNNING, {"stop_reason": "deadline", "stop_requested_at": repr(NOW)})
    ]
    asked = record(
        State.RUNNING, deadline=repr(deadline), stop_reason="deadline", stop_requested_at=repr(NOW)
    )
    k.store.transitions.clear()
    await k.checks.check(asked)  # within the stop wait: nothing yet
    assert k.store.transitions == []
    k.clock[0] = deadline + k.checks.ctx.settings.job.stop_wait_s
    await k.checks.check(asked)
    to, outcome = terminal(k.store)
    assert to is State.EXPIRED and outcome.error_code == "deadline_exceeded"
    assert outcome.counts["completed"] == 2


async def test_a_cancel_ends_a_submitted_batch_while_ray_does_not_answer() -> None:
    k = kit()
    k.backend.down = True
    cancelled: CancelFields = {"cancel_requested": "1", "cancel_requested_at": repr(NOW)}
    await k.checks.check(record(State.SUBMITTED, **cancelled))
    assert k.store.states == [State.SUBMITTED]
    k.store.transitions.clear()
    k.clock[0] = NOW + k.checks.ctx.settings.job.stop_wait_s
    await k.checks.check(record(State.SUBMITTED, **cancelled, stop_requested_at=repr(NOW)))
    assert terminal(k.store)[0] is State.CANCELLED


async def test_without_a_stop_reason_an_unanswering_runner_only_postpones_the_check() -> None:
    k = kit()
    k.backend.down = True
    with pytest.raises(RayUnavailable):
        await k.checks.check(record(State.RUNNING))
    assert k.store.transitions == []


async def test_a_finalizing_batch_past_its_deadline_ends_while_storage_does_not_answer() -> None:
    k = kit()
    k.results.down = True
    k.store.progress = {"total": "5", "completed": "5", "attempt": "1"}
    deadline = NOW - 1
    finalizing = record(State.FINALIZING, deadline=repr(deadline))
    with pytest.raises(StorageUnavailable):  # within the stop wait the read is tried again later
        await k.checks.check(finalizing)
    assert k.store.transitions == []
    k.clock[0] = deadline + k.checks.ctx.settings.job.stop_wait_s
    await k.checks.check(finalizing)
    to, outcome = terminal(k.store)
    assert to is State.EXPIRED and outcome.counts["completed"] == 5 and outcome.output_uris == []


async def test_a_cancel_ends_the_batch_when_the_stop_fails_though_the_status_answers() -> None:
    k = kit()
    k.backend.stop_fails = True
    cancelled: CancelFields = {"cancel_requested": "1", "cancel_requested_at": repr(NOW)}
    await k.checks.check(record(State.RUNNING, **cancelled))
    assert k.backend.stopped == [SID] and k.store.states == [State.RUNNING]  # the request is remembered
    k.store.transitions.clear()
    k.clock[0] = NOW + k.checks.ctx.settings.job.stop_wait_s + 1
    await k.checks.check(record(State.RUNNING, **cancelled, stop_requested_at=repr(NOW)))
    assert terminal(k.store)[0] is State.CANCELLED


# --- outages do not spend attempts ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "info",
    [
        JobInfo(JobState.FAILED, exit_code=75, message="S3 did not serve it"),  # the job's EX_TEMPFAIL
        JobInfo(JobState.NOT_FOUND),  # a restarted Ray head lost it
    ],
)
async def test_an_attempt_the_infrastructure_failed_is_retried_without_spending_one(info: JobInfo) -> None:
    k = kit(max_attempts=3)
    k.backend.info = info
    for attempt in range(1, 8):  # far past max_attempts
        k.store.transitions.clear()
        await k.checks.check(record(State.RUNNING, attempt=attempt, infra_retries=str(attempt - 1)))
        [(to, fields)] = k.store.transitions
        assert to is State.QUEUED and fields["infra_retries"] == str(attempt), fields
        assert fields["not_before"] > k.clock[0]


async def test_a_batch_fault_after_outages_counts_only_its_own_attempts() -> None:
    k = kit(max_attempts=3)
    k.backend.info = JobInfo(JobState.FAILED, exit_code=1)
    await k.checks.check(record(State.RUNNING, attempt=4, infra_retries="2"))  # 2 of its own so far
    assert k.store.states == [State.QUEUED]
    k.store.transitions.clear()
    await k.checks.check(record(State.RUNNING, attempt=5, infra_retries="2"))  # its 3rd: exhausted
    to, outcome = terminal(k.store)
    assert to is State.FAILED and outcome.error_code == "attempts_exhausted"


@pytest.mark.parametrize("garbled", ["x", "-1", "²", "9" * 40])
async def test_an_unreadable_outage_count_counts_as_none(garbled: str) -> None:
    k = kit(max_attempts=3)
    k.backend.info = JobInfo(JobState.FAILED, exit_code=1)
    await k.checks.check(record(State.RUNNING, attempt=3, infra_retries=garbled))
    assert terminal(k.store)[0] is State.FAILED
