"""The model registry (``LLMBATCH_ENGINES__MODELS``): settings from the environment, clear errors for a
bad entry, a dispatcher without a model refusing to start, and a batch whose model left the registry
after acceptance failing with ``model_not_found`` instead of running on another model."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
from pydantic import SecretStr
from typer.testing import CliRunner

from llmbatch.dispatcher.backends.backend import EXIT_ENGINE_UNAVAILABLE, SubmitResult
from llmbatch.dispatcher.cli import app
from llmbatch.dispatcher.domain.batch_record import BatchRecord, TransitionResult
from llmbatch.dispatcher.domain.dlt import OriginalRecord
from llmbatch.dispatcher.domain.events import Outcome
from llmbatch.dispatcher.domain.keys import Keys, batch_key
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.errors import InvalidSettings
from llmbatch.dispatcher.kafka.request_body import RequestBodies
from llmbatch.dispatcher.metrics import Metrics
from llmbatch.dispatcher.runs.context import RunContext
from llmbatch.dispatcher.runs.results import Shards
from llmbatch.dispatcher.runs.tracker import Tracker
from llmbatch.dispatcher.service import Dispatcher
from llmbatch.dispatcher.settings import DispatcherOptions, DispatcherSettings
from llmbatch.dispatcher.settings_loader import SettingsInvalid, describe_settings_error, load_settings
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.ray_job.engines.backends import FAKE_BACKEND
from llmbatch.schemas.engines import EngineModel, EngineRegistry
from llmbatch.schemas.events import RecordRef
from llmbatch.schemas.job import JobSpec
from llmbatch.settings import RedisSettings
from tests.support.dispatcher_kit import MODEL, batch_request, inline_lines, registry, request_message

pytestmark = pytest.mark.unit

ENV = "LLMBATCH_ENGINES__MODELS"


# --- settings ---------------------------------------------------------------------------------------


def test_registry_from_environment_json(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(
        ENV,
        '{"SmolLM2-135M-Instruct": {"path": "/models/smollm2", "engine": {"enforce_eager": true}},'
        ' "Qwen/Qwen2.5-0.5B-Instruct": {"path": "/models/qwen", "resources": {"num_gpus": 1},'
        ' "scaling": {"min_replicas": 1, "max_replicas": 4}}}',
    )
    settings = load_settings()
    assert settings.served_models == {"SmolLM2-135M-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"}
    smol = settings.engines.get("SmolLM2-135M-Instruct")
    assert smol.path == "/models/smollm2" and smol.engine.enforce_eager is True
    qwen = settings.engines.get("Qwen/Qwen2.5-0.5B-Instruct")
    assert qwen.resources.num_gpus == 1 and (qwen.scaling.min_replicas, qwen.scaling.max_replicas) == (1, 4)
    assert settings.serving_problem() is None
    # the registry is part of the effective settings the CLI prints
    shown: Any = settings.redacted()["engines"]
    assert shown["models"]["SmolLM2-135M-Instruct"]["path"] == "/models/smollm2"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ('{"m": {"path": ""}}', ["model 'm', field path", "at least 1 character"]),
        ('{"m": {}}', ["model 'm', field path", "Field required"]),
        (
            '{"m": {"path": "/x", "scaling": {"min_replicas": 3, "max_replicas": 1}}}',
            ["model 'm', field scaling", "min_replicas must be <= max_replicas"],
        ),
        ('{"m": {"path": "/x", "engine": {"dtyp": "auto"}}}', ["field engine.dtyp", "unknown field"]),
        ('{"m": {"path": "/x", "engine": {"batch_size": 0}}}', ["field engine.batch_size", "(got 0)"]),
        ('{"bad name": {"path": "/x"}}', ["model name 'bad name'", "not a valid model name"]),
    ],
    ids=["empty path", "no path", "min > max replicas", "typo", "out of range", "bad name"],
)
def test_a_bad_registry_entry_names_the_variable_the_model_and_the_field(
    clean_env: pytest.MonkeyPatch, value: str, expected: list[str]
) -> None:
    clean_env.setenv(ENV, value)
    with pytest.raises(SettingsInvalid) as info:
        load_settings()
    message = str(info.value)
    assert message.startswith(f"invalid setting {ENV}, ") and "\n" not in message
    for part in expected:
        assert part in message
    assert f"fix it in {ENV}" in message


def test_registry_that_is_not_json_says_so(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(ENV, '{"m": {"path": "/x"}')
    with pytest.raises(SettingsInvalid, match=r"engines.*JSON") as info:
        load_settings()
    assert "\n" not in str(info.value)


def test_other_settings_errors_name_their_variable(clean_env: pytest.MonkeyPatch) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as info:
        DispatcherSettings.model_validate({"dispatcher": {"max_in_flight": 0}})
    line = describe_settings_error(info.value)
    assert line.startswith("invalid setting LLMBATCH_DISPATCHER__MAX_IN_FLIGHT: ")


# --- a dispatcher without a model refuses to start ------------------------------------------------------


def test_no_model_configured_is_a_serving_problem_naming_the_fix() -> None:
    problem = DispatcherSettings(_env_file=None).serving_problem()
    assert problem is not None and "no model is configured" in problem
    assert ENV in problem and "\n" not in problem


async def test_dispatcher_without_a_model_refuses_to_start() -> None:
    settings = DispatcherSettings(
        _env_file=None,
        dispatcher=DispatcherOptions(metrics_port=None, shared_engines=False),
        redis=RedisSettings(url="redis://127.0.0.1:1/0"),  # never reached: start refuses first
    )
    backend: Any = FakeBackend()
    dispatcher = Dispatcher(settings, backend=backend)
    with pytest.raises(InvalidSettings, match="no model is configured"):
        await dispatcher.start()
    assert not dispatcher._tasks
    await dispatcher.stop()


async def test_a_dispatcher_with_the_short_path_refuses_to_start_without_the_runners_credential() -> None:
    registry = EngineRegistry(models={"m": EngineModel(path="/models/m")})
    settings = DispatcherSettings(
        _env_file=None,
        engines=registry,
        dispatcher=DispatcherOptions(metrics_port=None, shared_engines=True, short_path_max_lines=8),
        redis=RedisSettings(url="redis://127.0.0.1:1/0"),  # never reached: start refuses first
    )
    dispatcher = Dispatcher(settings)  # the real backends: the runner's client among them
    with pytest.raises(InvalidSettings, match="LLMBATCH_RAY__RUNNER_TOKEN is not set"):
        await dispatcher.start()
    assert not dispatcher._tasks
    await dispatcher.stop()
    off = settings.model_copy(
        update={"dispatcher": DispatcherOptions(metrics_port=None, short_path_max_lines=0)}
    )
    assert Dispatcher(off).runner is None  # no short path: no runner to authenticate to


async def test_a_start_step_logs_a_dependency_not_ready_once_per_change_of_state(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before, every retry of a start step (Kafka topics, the consumer) logged a warning."""
    from llmbatch.dispatcher.errors import KafkaUnavailable

    settings = DispatcherSettings(
        _env_file=None,
        dispatcher=DispatcherOptions(
            metrics_port=None, shared_engines=False, io_backoff_base_s=0.001, io_backoff_max_s=0.001
        ),
        redis=RedisSettings(url="redis://127.0.0.1:1/0"),  # never reached
        engines=registry(),
    )
    backend: Any = FakeBackend()
    dispatcher = Dispatcher(settings, backend=backend)
    left = 50

    def step() -> None:
        nonlocal left
        if left:
            left -= 1
            raise KafkaUnavailable("Kafka at 127.0.0.1:1 is unreachable")

    with caplog.at_level(logging.INFO, logger="llmbatch.dispatcher.service"):
        await dispatcher._until_ok("kafka topics", step)
    said = [r.getMessage() for r in caplog.records if r.name == "llmbatch.dispatcher.service"]
    assert said == ["kafka topics not ready, retrying (repeats are not logged)", "kafka topics ready"]
    await dispatcher.stop()


def test_dispatcher_run_refuses_to_start_with_one_line(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("LLMBATCH_JOB__MODEL_PATH", "/models/old")  # an old setting: ignored, and said so
    result = CliRunner().invoke(app, ["run"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("warning: LLMBATCH_JOB__MODEL_PATH no longer read")
    assert lines[1].startswith("error: no model is configured") and ENV in lines[1]
    assert len(lines) == 2


def test_dispatcher_run_with_a_bad_entry_says_which_in_one_line(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(ENV, '{"m": {"path": "/x", "scaling": {"min_replicas": 2, "max_replicas": 1}}}')
    result = CliRunner().invoke(app, ["run"])
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: invalid setting {ENV}, model 'm', field scaling: min_replicas")


# --- a model removed from the registry after acceptance -----------------------------------------------


@dataclass
class FakeStore:
    keys: Keys = field(default_factory=lambda: Keys("p"))
    transitions: list[tuple[str, State, dict[str, Any]]] = field(default_factory=list)
    fresh: BatchRecord | None = None

    async def transition(self, batch_id: str, to: State, **kwargs: Any) -> TransitionResult:
        self.transitions.append((batch_id, to, dict(kwargs.get("fields") or {})))
        return TransitionResult(True, "ok", to, 99)

    async def get(self, batch_id: str) -> BatchRecord | None:
        return self.fresh

    async def read_progress(self, batch_id: str) -> dict[str, str]:
        return {"completed": "3", "total": "5"}

    deferred: list[tuple[list[str], float]] = field(default_factory=list)

    async def defer_job_deletes(self, submission_ids: list[str], due: float) -> None:
        self.deferred.append((list(submission_ids), due))


@dataclass
class FakeBackend:
    submitted: list[JobSpec] = field(default_factory=list)

    async def submit(self, spec: JobSpec) -> SubmitResult:
        self.submitted.append(spec)
        return SubmitResult(spec.submission_id, False)

    async def close(self) -> None:
        return None


class FakeResults:
    async def read_manifest(self, output_prefix: str) -> None:
        return None

    async def list_shards(self, output_prefix: str) -> Shards:
        return Shards([output_prefix + "output-a1-00000.jsonl"], [])


def tracker(
    engines: EngineRegistry, options: DispatcherOptions | None = None
) -> tuple[Tracker, FakeStore, FakeBackend]:
    settings = DispatcherSettings(
        _env_file=None,
        redis=RedisSettings(url="redis://redis:6379/0", password=SecretStr("pw"), key_prefix="p"),
        engines=engines,
        dispatcher=options or DispatcherOptions(),
    )
    store, backend = FakeStore(), FakeBackend()
    results: Any = FakeResults()
    producer: Any = object()
    jobs: Any = backend
    context = RunContext(
        settings,
        cast(StateStore, store),  # the stand-in has the calls a tracker makes here
        jobs,
        results,
        producer,
        Metrics(),
        clock=lambda: 1_790_000_000.0,
    )
    t = Tracker(context)
    return t, store, backend


async def test_finished_jobs_are_deleted_after_the_settle_time_of_the_settings() -> None:
    t, store, _ = tracker(registry(), DispatcherOptions(job_delete_settle_s=7, job_delete_recheck_s=9))
    await t.job_cleanup.forget(stored(State.COMPLETED.value, 2))
    assert store.deferred == [(["b-gone-a1", "b-gone-a2"], 1_790_000_007.0)]
    assert t.job_cleanup.retry_after_s == 9


def stored(state: str, attempt: int, **extra: str) -> BatchRecord:
    request = batch_request("b-gone", requests=inline_lines(5))
    _, value, _ = request_message(request)
    fields = {"state": state, "version": "3", "request": value.decode(), "attempt": str(attempt)}
    fields["total"] = "5"
    fields.update(extra)
    return BatchRecord.from_hash(batch_key(None, "b-gone"), fields)


def _failed(store: FakeStore) -> tuple[dict[str, Any], Outcome]:
    [(batch_id, to, fields)] = store.transitions
    assert (batch_id, to) == ("b-gone", State.FAILED)
    return fields, Outcome.from_json(fields["outcome"])


async def test_queued_batch_whose_model_was_removed_fails_with_model_not_found() -> None:
    t, store, backend = tracker(registry(models=("other/model",)))
    assert await t.launcher.start_attempt(stored("queued", 0)) is False
    assert backend.submitted == []  # never runs on another model
    fields, outcome = _failed(store)
    assert fields["error_code"] == "model_not_found" and outcome.dlt_reason == "model_not_found"
    assert fields["dlt_pending"] == "1"  # a dead letter, to replay once the model is served again
    assert MODEL in fields["error_message"] and "'other/model'" in fields["error_message"]
    assert "LLMBATCH_ENGINES__MODELS" in fields["error_message"]
    assert outcome.counts["total"] == 5


async def test_retry_of_a_batch_whose_model_was_removed_fails_keeping_earlier_results() -> None:
    t, store, backend = tracker(registry(models=("other/model",)))
    assert await t.launcher.start_attempt(stored("queued", 1, started_at="1789999000.0")) is False
    assert backend.submitted == []
    fields, outcome = _failed(store)
    assert fields["error_code"] == "model_not_found"
    assert outcome.output_uris == ["s3://llmbatch-results/default/b-gone/output-a1-00000.jsonl"]
    assert outcome.counts["completed"] == 3


async def test_resubmission_after_the_model_was_removed_fails_instead_of_submitting() -> None:
    t, store, backend = tracker(registry(models=("other/model",)))
    await t.launcher.submit(stored("submitted", 1, submission_id="b-gone-a1"))
    assert backend.submitted == []
    fields, _ = _failed(store)
    assert fields["error_code"] == "model_not_found"


async def test_served_model_is_submitted_with_its_registry_entry() -> None:
    t, store, backend = tracker(registry(path="/models/smollm2"))
    store.fresh = stored("submitted", 1, submission_id="b-gone-a1")
    assert await t.launcher.start_attempt(stored("queued", 0)) is True
    [spec] = backend.submitted
    assert (
        spec.model == MODEL and spec.model_path == "/models/smollm2" and spec.engine.backend == FAKE_BACKEND
    )
    assert [to for _, to, _ in store.transitions] == [State.SUBMITTED, State.SUBMITTED]


class CountingReader:
    """A RecordReader over one in-memory record, counting the reads (each is a Kafka fetch)."""

    def __init__(self, record: OriginalRecord) -> None:
        self.record = record
        self.reads = 0

    async def read(self, ref: RecordRef) -> OriginalRecord | None:
        self.reads += 1
        return (
            self.record
            if (ref.topic, ref.partition, ref.offset)
            == (self.record.topic, self.record.partition, self.record.offset)
            else None
        )


async def test_a_launch_reads_an_offloaded_body_from_kafka_once() -> None:
    t, store, backend = tracker(registry(path="/models/smollm2"))
    _, value, _ = request_message(batch_request("b-gone", requests=inline_lines(5)))
    origin = OriginalRecord("requests", 2, 41, b"b-gone", value)
    reader = CountingReader(origin)
    t.launcher.bodies = RequestBodies(reader)  # type: ignore[arg-type]
    offloaded = {"request_sha256": hashlib.sha256(value).hexdigest(), "origin": origin.to_json()}
    queued = stored("queued", 0, **offloaded)
    queued = BatchRecord.from_hash(
        batch_key(None, "b-gone"), {k: v for k, v in queued.fields.items() if k != "request"}
    )
    store.fresh = BatchRecord.from_hash(
        batch_key(None, "b-gone"),
        {**queued.fields, "state": "submitted", "attempt": "1", "submission_id": "b-gone-a1"},
    )
    assert await t.launcher.start_attempt(queued) is True
    [spec] = backend.submitted
    assert [r.custom_id for r in spec.requests or []] == [f"req-{i}" for i in range(5)]
    assert reader.reads == 1
    await t.launcher.submit(store.fresh)  # a resubmission (after a restart) builds its spec again
    assert reader.reads == 2 and len(backend.submitted) == 2


async def test_shared_engines_put_the_models_serve_app_in_the_spec() -> None:
    from llmbatch.schemas.engines import app_name

    t, store, backend = tracker(registry(path="/models/smollm2"))
    store.fresh = stored("submitted", 1, submission_id="b-gone-a1")
    t.settings.dispatcher.engine_wait_s = 42.0
    await t.launcher.start_attempt(stored("queued", 0))
    spec = backend.submitted[-1]  # the default: the model's shared engine
    assert spec.engine_app == app_name(MODEL) and spec.engine_wait_s == 42.0
    t.settings.dispatcher.shared_engines = False
    await t.launcher.start_attempt(stored("queued", 0))
    assert backend.submitted[-1].engine_app is None  # an engine per job


async def test_no_engine_in_time_fails_the_batch_once_without_retrying() -> None:
    from llmbatch.dispatcher.backends.backend import JobInfo, JobState

    t, store, _ = tracker(registry(path="/models/smollm2"))
    message = "no engine of llmbatch-engine-x answered"
    info = JobInfo(JobState.FAILED, exit_code=EXIT_ENGINE_UNAVAILABLE, message=message)
    await t.checks.job_failed(stored("running", 1, submission_id="b-gone-a1"), info)
    fields, _ = _failed(store)  # straight to failed: attempt 1 of 3 is not retried
    assert fields["error_code"] == "engine_unavailable"
    assert "no engine" in fields["error_message"]


async def test_a_failed_jobs_public_message_carries_no_driver_log() -> None:
    """Ray appends up to 20 kB of the driver's output to a failed job's message; what the job printed
    (prompts, paths, tokens) must not reach the failed event, the dead letter or Redis."""
    from llmbatch.dispatcher.backends.backend import JobInfo, JobState

    t, store, _ = tracker(registry(path="/models/smollm2"))
    once = t.ctx.opts.model_copy(update={"max_attempts": 1})
    t.checks.ctx = dataclasses.replace(t.ctx, settings=t.ctx.settings.model_copy(update={"dispatcher": once}))
    ray_message = (
        "Job entrypoint command failed with exit code 1, last available logs (truncated to "
        "20,000 chars):\nTraceback ...\nprompt: my secret prompt\nKeyError: 'x'\n"
    )
    info = JobInfo(JobState.FAILED, exit_code=1, message=ray_message)
    await t.checks.job_failed(stored("running", 1, submission_id="b-gone-a1"), info)
    fields, _ = _failed(store)
    assert "secret prompt" not in str(fields) and "Traceback" not in str(fields)
    assert "Job entrypoint command failed with exit code 1" in fields["error_message"]
    assert "dispatcher's log" in fields["error_message"]


def test_ray_message_summary() -> None:
    from llmbatch.dispatcher.runs.outcomes import RAY_SUMMARY_CHARS, ray_message_summary

    assert ray_message_summary(None) == "" and ray_message_summary("") == ""
    assert ray_message_summary("Job was intentionally stopped.") == "Job was intentionally stopped."
    long = ray_message_summary("x" * 1000)
    assert long.endswith("...") and len(long) == RAY_SUMMARY_CHARS
    assert ray_message_summary("Unexpected error\nsecret log") == "Unexpected error"
