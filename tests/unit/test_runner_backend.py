"""The short path's routing and its HTTP client (a real local HTTP server stands in for Serve)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from pydantic import SecretStr

from llmbatch.dispatcher.backends.backend import JobInfo, JobState, SubmitResult
from llmbatch.dispatcher.backends.engines import cluster_serve_config
from llmbatch.dispatcher.backends.runner_backend import (
    RoutedBackend,
    RunnerClient,
    job_info,
    takes_short_path,
)
from llmbatch.dispatcher.errors import JobRejected, RayUnavailable
from llmbatch.dispatcher.settings import DispatcherOptions, DispatcherSettings
from llmbatch.ray_job.batch_runner.runner import BatchRunner
from llmbatch.ray_job.batch_runner.runner_http import APP_NAME, MAX_STATUS_IDS, ROUTE_PREFIX, parse_submission
from llmbatch.ray_job.engines.backends import FAKE_BACKEND
from llmbatch.ray_job.storage import node_secrets
from llmbatch.schemas.engines import EngineModel, EngineRegistry
from llmbatch.schemas.job import JobSpec
from llmbatch.settings import RaySettings, RedisSettings, S3Settings
from tests.support.clock import Clock
from tests.support.scripted_http import ScriptedHttpServer

pytestmark = pytest.mark.unit


def _line(i: int) -> dict[str, Any]:
    return {
        "custom_id": f"c{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    }


def _spec(*, lines: int | None = None, app: str | None = "llmbatch-engine-m", attempt: int = 1) -> JobSpec:
    data: dict[str, Any] = {
        "batch_id": "b-1",
        "attempt": attempt,
        "endpoint": "/v1/chat/completions",
        "model": "m",
        "output_prefix": "s3://results/default/b-1/",
        "engine": {"backend": FAKE_BACKEND},
        "engine_app": app,
    }
    if lines is None:
        data["input_uri"] = "s3://inputs/k.jsonl"
    else:
        data["requests"] = [_line(i) for i in range(lines)]
    return JobSpec.model_validate(data)


@pytest.mark.parametrize(
    ("spec", "size", "expected"),
    [
        (_spec(lines=8), None, True),
        (_spec(lines=9), None, False),  # more inline lines than the limit
        (_spec(lines=8, app=None), None, False),  # no shared engine: the job starts its own
        (_spec(), 1000, True),
        (_spec(), 1001, False),  # a file above the byte limit
        (_spec(), None, False),  # a file whose size is unknown
    ],
)
def test_short_path_takes_small_batches_on_a_shared_engine(
    spec: JobSpec, size: int | None, expected: bool
) -> None:
    assert takes_short_path(spec, max_lines=8, max_bytes=1000, input_size=size) is expected


def test_short_path_off_when_max_lines_is_zero() -> None:
    assert not takes_short_path(_spec(lines=1), max_lines=0, max_bytes=10**9, input_size=None)
    assert not takes_short_path(_spec(), max_lines=0, max_bytes=10**9, input_size=1)


def test_runner_refuses_bad_specs_and_too_many_runs_without_starting_anything() -> None:
    runner = BatchRunner(max_runs=0)
    code, body = runner.submit(b"{not json")
    assert code == 400 and "invalid job spec" in body["error"]
    code, body = runner.submit(_spec(lines=1, app=None).model_dump_json().encode())
    assert code == 400 and body["error"].startswith("engine_app")
    code, body = runner.submit(_spec(lines=1).model_dump_json().encode())
    assert code == 429 and "max_runs" in body["error"]
    assert runner.status("b-1-a1")[0] == 404 and runner.stop("b-1-a1")[0] == 404


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b"{not json", "must be JSON"),
        (b'["b-1-a1"]', "submission_ids: give a list"),
        (b'{"submission_ids": "b-1-a1"}', "submission_ids: give a list"),
        (b'{"submission_ids": [1]}', "submission_ids: give a list"),
        (b'{"submission_ids": [""]}', "submission_ids: give a list"),
        (orjson.dumps({"submission_ids": ["x"] * (MAX_STATUS_IDS + 1)}), "at most"),
    ],
)
def test_runner_refuses_bad_status_requests_naming_the_field(body: bytes, error: str) -> None:
    code, answer = BatchRunner().statuses(body)
    assert code == 400 and error in answer["error"]


def test_runner_answers_the_states_of_many_runs_at_once() -> None:
    runner = BatchRunner()
    code, body = runner.statuses(orjson.dumps({"submission_ids": ["b-1-a1", "b-2-a1"]}))
    assert (code, body) == (200, {"runs": {"b-1-a1": None, "b-2-a1": None}})


def test_job_info_maps_the_runner_view() -> None:
    info = job_info(
        {
            "status": "FAILED",
            "driver_exit_code": 4,
            "message": "engine_unavailable: x",
            "start_time": 10.5,
            "end_time": 12.0,
        }
    )
    assert info == JobInfo(
        JobState.FAILED, exit_code=4, message="engine_unavailable: x", start_time=10.5, end_time=12.0
    )
    assert job_info({"status": "RUNNING"}).state is JobState.RUNNING
    assert job_info({"status": "weird"}).state is JobState.PENDING


# --- the HTTP client against a real server --------------------------------------------------------


@pytest.fixture
def server() -> Iterator[ScriptedHttpServer]:
    """Answers like the runner: a scripted (status, body) per method+path, else 404; records requests."""
    srv = ScriptedHttpServer()
    yield srv
    srv.close()


RUNS = ROUTE_PREFIX + "/runs"
STATUSES = ROUTE_PREFIX + "/statuses"


def test_client_speaks_the_runner_api(server: ScriptedHttpServer) -> None:
    client = RunnerClient(server.address, timeout_s=5)
    spec = _spec(lines=2)
    server.answers[("POST", RUNS)] = (202, b'{"submission_id": "b-1-a1", "already_existed": false}')
    done = orjson.dumps({"status": "SUCCEEDED", "driver_exit_code": 0})
    server.answers[("POST", STATUSES)] = (200, b'{"runs": {"b-1-a1": ' + done + b', "b-1-a2": null}}')
    server.answers[("POST", RUNS + "/b-1-a1/stop")] = (200, b'{"stopped": false}')
    expected = SubmitResult("b-1-a1", already_existed=False, via="batch_runner")
    assert asyncio.run(client.submit(spec)) == expected
    sent = parse_submission(server.seen[0][2])
    assert sent.spec == spec and sent.s3_session is None  # the whole spec travels; no minter, no keys
    info = asyncio.run(client.status("b-1-a1"))
    assert info is not None and info.state is JobState.SUCCEEDED and info.exit_code == 0
    assert asyncio.run(client.stop("b-1-a1")) is False
    assert asyncio.run(client.status("b-1-a2")) is None  # the runner does not know it


def test_the_checks_of_one_tick_ask_the_runner_once(server: ScriptedHttpServer) -> None:
    # before: a GET /runs/<id> through Serve's proxy per batch in flight and tick
    client = RunnerClient(server.address, timeout_s=5)
    running = orjson.dumps({"status": "RUNNING"})
    server.answers[("POST", STATUSES)] = (200, b'{"runs": {"b-1-a1": ' + running + b', "b-2-a1": null}}')

    async def tick() -> list[JobInfo | None]:
        return await asyncio.gather(*(client.status(s) for s in ["b-1-a1", "b-2-a1", "b-3-a1"]))

    one, two, three = asyncio.run(tick())
    assert one is not None and one.state is JobState.RUNNING and two is None and three is None
    assert [(s.method, s.path) for s in server.seen] == [("POST", STATUSES)]
    assert orjson.loads(server.seen[0].body) == {"submission_ids": ["b-1-a1", "b-2-a1", "b-3-a1"]}


def test_a_runner_without_the_many_states_route_is_asked_run_by_run(server: ScriptedHttpServer) -> None:
    client = RunnerClient(server.address, timeout_s=5)
    server.answers[("POST", STATUSES)] = (404, b'{"error": "no route POST /llmbatch-runner/statuses"}')
    server.answers[("GET", RUNS + "/b-1-a1")] = (200, b'{"status": "SUCCEEDED", "driver_exit_code": 0}')
    server.answers[("GET", RUNS + "/b-2-a1")] = (404, b'{"error": "unknown submission b-2-a1"}')

    async def tick() -> tuple[JobInfo | None, JobInfo | None]:
        return await asyncio.gather(client.status("b-1-a1"), client.status("b-2-a1"))

    done, unknown = asyncio.run(tick())
    assert done is not None and done.state is JobState.SUCCEEDED and unknown is None
    assert sorted(s.path for s in server.seen) == sorted([STATUSES, RUNS + "/b-1-a1", RUNS + "/b-2-a1"])


def test_a_states_answer_without_runs_is_an_outage(server: ScriptedHttpServer) -> None:
    server.answers[("POST", STATUSES)] = (200, b'{"error": "what"}')
    with pytest.raises(RayUnavailable, match="without 'runs'"):
        asyncio.run(RunnerClient(server.address, timeout_s=5).status("b-1-a1"))


@pytest.mark.parametrize(
    ("code", "body", "error"),
    [
        (429, b'{"error": "the runner runs 64 batches already"}', RayUnavailable),
        (503, b"no replica", RayUnavailable),
        (404, b"Path '/llmbatch-runner/runs' not found.", RayUnavailable),  # the proxy: no runner app yet
        (400, b'{"error": "invalid job spec"}', JobRejected),
    ],
)
def test_client_classifies_refusals(
    server: ScriptedHttpServer, code: int, body: bytes, error: type[Exception]
) -> None:
    server.answers[("POST", RUNS)] = (code, body)
    with pytest.raises(error):
        asyncio.run(RunnerClient(server.address, timeout_s=5).submit(_spec(lines=1)))


@pytest.mark.parametrize("body", [b"<html>502 Bad Gateway</html>", b"[]", b""])
def test_a_success_that_is_not_a_json_object_is_an_outage_not_a_crash(
    server: ScriptedHttpServer, body: bytes
) -> None:
    # a proxy's page before the runner, or a body cut short: before, JSONDecodeError or AttributeError
    server.answers[("POST", RUNS)] = server.answers[("POST", STATUSES)] = (200, body)
    client = RunnerClient(server.address, timeout_s=5)
    with pytest.raises(RayUnavailable, match="not a JSON object") as caught:
        asyncio.run(client.submit(_spec(lines=1)))
    assert caught.value.retriable
    with pytest.raises(RayUnavailable, match="not a JSON object"):
        asyncio.run(client.status("b-1-a1"))


def test_client_reports_a_dead_address_as_unavailable() -> None:
    with pytest.raises(RayUnavailable, match="did not answer"):
        asyncio.run(RunnerClient("http://127.0.0.1:1", timeout_s=2).status("x"))


# --- routing --------------------------------------------------------------------------------------


class _Jobs:
    def __init__(self, known: dict[str, JobInfo] | None = None) -> None:
        self.submitted: list[str] = []
        self.known = known or {}

    async def submit(self, spec: JobSpec) -> SubmitResult:
        self.submitted.append(spec.submission_id)
        return SubmitResult(spec.submission_id, already_existed=False)

    async def status(self, submission_id: str) -> JobInfo:
        return self.known.get(submission_id, JobInfo(JobState.NOT_FOUND))

    async def stop(self, submission_id: str) -> bool:
        return submission_id in self.known

    async def delete(self, submission_id: str) -> bool:
        return self.known.pop(submission_id, None) is not None

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        pass


def _routed(server_address: str, jobs: _Jobs, sizes: dict[str, int]) -> RoutedBackend:
    async def size_of(uri: str) -> int | None:
        return sizes.get(uri)

    return RoutedBackend(
        jobs, RunnerClient(server_address, timeout_s=5), max_lines=4, max_bytes=100, size_of=size_of
    )


def test_small_batches_go_to_the_runner_the_rest_to_ray_jobs(server: ScriptedHttpServer) -> None:
    jobs = _Jobs()
    server.answers[("POST", RUNS)] = (202, b'{"already_existed": false}')
    backend = _routed(server.address, jobs, {"s3://inputs/k.jsonl": 100})
    assert asyncio.run(backend.submit(_spec(lines=4))).via == "batch_runner"
    asyncio.run(backend.submit(_spec(attempt=2)))  # a 100-byte file
    assert [s[0:2] for s in server.seen] == [("POST", RUNS), ("POST", RUNS)] and jobs.submitted == []
    assert asyncio.run(backend.submit(_spec(lines=5, attempt=3))).via == "ray_job"
    asyncio.run(_routed(server.address, jobs, {"s3://inputs/k.jsonl": 101}).submit(_spec(attempt=4)))
    asyncio.run(backend.submit(_spec(lines=1, app=None, attempt=5)))
    assert jobs.submitted == ["b-1-a3", "b-1-a4", "b-1-a5"] and len(server.seen) == 2


def test_status_asks_the_runner_then_the_jobs_api(server: ScriptedHttpServer) -> None:
    jobs = _Jobs({"b-1-a2": JobInfo(JobState.RUNNING)})
    server.answers[("POST", STATUSES)] = (
        200,
        b'{"runs": {"b-1-a1": {"status": "SUCCEEDED", "driver_exit_code": 0}}}',
    )
    server.answers[("POST", RUNS + "/b-1-a2/stop")] = (404, b'{"error": "unknown"}')
    backend = _routed(server.address, jobs, {})
    assert asyncio.run(backend.status("b-1-a1")).state is JobState.SUCCEEDED
    assert asyncio.run(backend.status("b-1-a2")).state is JobState.RUNNING
    assert asyncio.run(backend.stop("b-1-a2")) is True  # the Jobs API stopped it
    # a finished Ray job is deleted through the Jobs API (runs of the runner forget themselves)
    assert asyncio.run(backend.delete("b-1-a2")) is True and "b-1-a2" not in jobs.known
    assert asyncio.run(backend.delete("b-1-a2")) is False


def test_a_silent_runner_never_makes_a_run_look_lost() -> None:
    jobs = _Jobs({"b-1-a2": JobInfo(JobState.RUNNING)})
    backend = _routed("http://127.0.0.1:1", jobs, {})
    # a Ray job still answers while the runner is away
    assert asyncio.run(backend.status("b-1-a2")).state is JobState.RUNNING
    # a submission nobody knows may be a run of the absent runner: unknown, not NOT_FOUND
    with pytest.raises(RayUnavailable):
        asyncio.run(backend.status("b-1-a1"))


def test_cluster_config_adds_the_runner_with_the_short_path_only() -> None:
    registry = EngineRegistry(models={"m": EngineModel(path="/models/m")})
    s3 = S3Settings(access_key="ak", secret_key="sk")
    ray = RaySettings(serve_address="http://ray-head:8000", runner_token=SecretStr("t" * 40))
    settings = DispatcherSettings(
        _env_file=None,
        engines=registry,
        s3=s3,
        ray=ray,
        redis=RedisSettings(url="redis://:pw-of-redis@redis:6379/0", key_prefix="lb"),
        dispatcher=DispatcherOptions(shared_engines=True, short_path_max_runs=7, short_path_replicas=3),
    )
    config = cluster_serve_config(settings)
    names = [a["name"] for a in config["applications"]]
    assert len(names) == 2 and names[-1] == APP_NAME
    runner = config["applications"][-1]
    # where the runner derives a batch's keys and prefix from: the settings, never a caller's spec
    assert runner["route_prefix"] == ROUTE_PREFIX and runner["args"] == {
        "max_runs": 7,
        "key_prefix": "lb",
        "redis_url": settings.redis.url_without_password(settings.job.redis_username),
        "results_bucket": s3.results_bucket,
    }
    assert runner["deployments"][0]["num_replicas"] == 3
    text = orjson.dumps(config).decode()
    assert "pw-of-redis" not in text and "t" * 40 not in text  # no secret in a Serve config
    # where S3 is, never its keys (the replicas have them from the Ray workers' environment)
    # (LLMBATCH_S3__ENDPOINT too: ray_job.storage.s3 reads it first, and a Ray node may have inherited
    # another) (each batch brings S3 keys of its own: the node's are blanked in its process)
    assert runner["runtime_env"]["env_vars"] == {
        "LLMBATCH_S3__ENDPOINT": s3.endpoint,
        "AWS_ENDPOINT_URL_S3": s3.endpoint,
        "AWS_REGION": s3.region,
        "RAY_worker_niceness": "0",  # on every short-path batch's way: the engine's priority, not Ray's 15
        **node_secrets.withheld(node_secrets.S3_KEYS),
    }
    no_sessions = settings.model_copy(
        update={"dispatcher": DispatcherOptions(shared_engines=True, runner_s3_sessions=False)}
    )
    assert all(cluster_serve_config(no_sessions)["applications"][-1]["runtime_env"]["env_vars"].values())
    assert config["http_options"] == {"host": "0.0.0.0", "port": 8000}
    off_opts = DispatcherOptions(shared_engines=True, short_path_max_lines=0)
    off = settings.model_copy(update={"dispatcher": off_opts})
    assert [a["name"] for a in cluster_serve_config(off)["applications"]] == names[:1]


def test_every_batch_reports_its_own_wait_for_an_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner caches one engine handle per model; a batch that meets a cold start later (the model
    scaled to zero, or was redeployed) must report that wait as its engine start, not as generation."""
    import time
    import types

    from llmbatch.ray_job.batch_runner import runner as runner_module
    from llmbatch.ray_job.engines import serve_client

    clock = Clock()  # the test's own: only waiting for a replica moves it
    monkeypatch.setattr(runner_module, "time", types.SimpleNamespace(perf_counter=clock, time=time.time))
    waits = [0.0, 0.3]  # the handle's first batch finds a warm replica; a later one a cold start

    class Handle:
        max_model_len, default_max_tokens = 2048, None

        def __init__(self, app: str, *, wait_s: float) -> None:
            self.app = app

        def wait_ready(self) -> None:
            clock.now += waits.pop(0)

        def slots(self) -> int:
            return 0

    monkeypatch.setattr(serve_client, "ServeEngine", Handle)
    runner = BatchRunner()
    spec = _spec(lines=1)
    first = runner._engine(spec)
    later = runner._engine(spec)
    assert first.engine_start_s == 0.0 and later.engine_start_s == pytest.approx(0.3)
