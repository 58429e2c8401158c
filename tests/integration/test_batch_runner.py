"""The short path on a real Ray head: the batch runner (a Serve application behind Serve's HTTP proxy)
runs small batches on the shared engine with MinIO and Redis, as the dispatcher drives it (through
:class:`~llmbatch.dispatcher.backends.runner_backend.RunnerClient`). The engine replica runs the fake
engine."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import redis
from pydantic import SecretStr

from llmbatch.dispatcher.backends.backend import JobInfo, JobState
from llmbatch.dispatcher.backends.engines import cluster_serve_config, replica_pids, runner_pids, summarize
from llmbatch.dispatcher.backends.runner_backend import RunnerClient
from llmbatch.dispatcher.backends.s3_sessions import SessionMinter
from llmbatch.dispatcher.backends.serve_api import ServeApi
from llmbatch.dispatcher.errors import JobRejected, RayUnavailable
from llmbatch.dispatcher.settings import DispatcherOptions, DispatcherSettings
from llmbatch.ray_job.batch_runner.runner_config import DEFAULT_REPLICAS
from llmbatch.ray_job.engines.backends import FAKE_BACKEND
from llmbatch.ray_job.errors import ExitCode
from llmbatch.ray_job.storage import job_keys, node_secrets
from llmbatch.schemas.common import BatchStatus, utcnow
from llmbatch.schemas.engines import EngineModel, EngineRegistry, ReplicaResources, Scaling, app_name
from llmbatch.schemas.job import EngineConfig, JobSpec
from llmbatch.settings import RaySettings, RedisSettings, S3Settings
from tests.integration.ray_job_harness import Harness, chat_line
from tests.support.proc_env import environ, parent_pid, raw_environ

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
REGISTRY = EngineRegistry(
    models={
        MODEL: EngineModel(
            path="fake",
            engine=EngineConfig(
                backend=FAKE_BACKEND, backend_options={"delay_s": 0.2, "fail_custom_ids": ["boom"]}
            ),
            resources=ReplicaResources(num_cpus=0.25),
            scaling=Scaling(min_replicas=1, max_replicas=1, idle_s=60),
            # 8 requests at once (0.2 s each): a batch alone fills these 8 slots, so 400 requests take
            # at least 10 s whatever its calls carry
            max_active_requests=8,
        )
    }
)
CLIENT = EngineConfig(backend=FAKE_BACKEND, batch_size=4, batches_in_flight=2)


@pytest.fixture(scope="module")
def h(s3_settings: S3Settings, ray_settings: RaySettings, redis_settings: RedisSettings) -> Harness:
    return Harness(s3_settings, ray_settings, redis_settings)


@pytest.fixture(scope="module")
def runner(
    h: Harness, s3_settings: S3Settings, ray_settings: RaySettings, redis_settings: RedisSettings
) -> Iterator[tuple[RunnerClient, ServeApi]]:
    settings = DispatcherSettings(
        _env_file=None,
        engines=REGISTRY,
        # the runner takes a batch's results only under its identity's prefix in this bucket
        s3=s3_settings.model_copy(update={"results_bucket": h.results_bucket}),
        ray=ray_settings,
        redis=redis_settings,
        dispatcher=DispatcherOptions(shared_engines=True),
    )
    api = ServeApi(ray_settings.address, timeout_s=60)
    asyncio.run(api.deploy(cluster_serve_config(settings)))
    deadline = time.monotonic() + 240
    details: dict[str, Any] = {}
    while time.monotonic() < deadline:
        details = asyncio.run(api.status())
        engine = summarize(REGISTRY, details)[0]
        if engine.running == 1 and len(runner_pids(details)) == DEFAULT_REPLICAS:
            break
        time.sleep(1)
    else:
        raise AssertionError(f"apps not running: {details.get('applications')}")
    # as the dispatcher runs it: each batch brings S3 keys of its own, the runner's replica has none
    yield RunnerClient.of(ray_settings, timeout_s=30, sessions=SessionMinter(s3_settings)), api
    asyncio.run(api.deploy({"applications": []}))


def _progress_key(h: Harness, spec: JobSpec) -> str:
    """Where the runner writes ``spec``'s progress: derived from its identity, whatever the spec says."""
    return job_keys.progress_key(h.redis.key_prefix, spec.tenant, spec.batch_id)


def _wait_progress(h: Harness, spec: JobSpec, lines: int, timeout: float = 60) -> None:
    """Until the runner's progress counters in Redis show ``lines`` of ``spec`` done."""
    progress = redis.Redis.from_url(h.redis.url)
    deadline = time.monotonic() + timeout
    while int(progress.hget(_progress_key(h, spec), "completed") or 0) < lines:
        assert time.monotonic() < deadline, f"no progress within {timeout:.0f} s"
        time.sleep(0.05)


def _wait(client: RunnerClient, sid: str, timeout: float = 120) -> JobInfo:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = asyncio.run(client.status(sid))
        assert info is not None, f"the runner forgot {sid}"
        if info.state.is_terminal:
            return info
        time.sleep(0.2)
    raise AssertionError(f"{sid} not finished after {timeout} s")


def _spec(h: Harness, name: str, n: int, *, inline: bool, **kw: Any) -> JobSpec:
    lines: list[dict[str, Any] | bytes] = [chat_line(f"{name}-{i}", f"question {i}") for i in range(n)]
    lines.append(chat_line("boom", "the engine fails this one"))
    lines.append(b"{not json")
    source: dict[str, Any] = (
        {"requests": [line for line in lines if isinstance(line, dict)]}
        if inline
        else {"input_uri": h.put_input(f"{name}.jsonl", lines)}
    )
    return h.spec(
        name,
        engine=CLIENT,
        engine_app=app_name(MODEL),
        engine_wait_s=60,
        **{
            "redis_url": h.redis.url,
            "progress_key": f"llmbatch:test:progress:{name}-{h.tag}",  # the runner derives its own
            **source,
            **kw,
        },
    )


def test_small_batches_run_on_the_warm_runner_with_the_job_contract(
    h: Harness, runner: tuple[RunnerClient, ServeApi]
) -> None:
    client, api = runner
    [replica] = replica_pids(asyncio.run(api.status()), MODEL)
    specs = [_spec(h, "runner-file", 9, inline=False), _spec(h, "runner-inline", 5, inline=True)]
    started = time.monotonic()
    for spec in specs:
        assert not asyncio.run(client.submit(spec)).already_existed
    assert asyncio.run(client.submit(specs[0])).already_existed  # the same attempt again: no second run
    for spec in specs:
        info = _wait(client, spec.submission_id)
        assert info.state is JobState.SUCCEEDED and info.exit_code == 0, info
    elapsed = time.monotonic() - started
    # the states of many runs in one request, through Serve's proxy (the tracker's tick)
    ids = [s.submission_id for s in specs]
    states = asyncio.run(client.statuses([*ids, "never-submitted-a1"]))
    assert [i.state if i is not None else None for i in states.values()] == [JobState.SUCCEEDED] * 2 + [None]
    for spec, n, bad in zip(specs, (9, 5), (1, 0), strict=True):
        manifest = h.manifest(spec)
        assert manifest.status == BatchStatus.COMPLETED and manifest.attempt == 1
        counts = manifest.request_counts.model_dump()
        assert counts == {"total": n + 1 + bad, "completed": n, "failed": 1 + bad}
        outputs = h.lines(manifest.output_uris)
        name = spec.batch_id.rsplit("-", 1)[0]
        assert sorted(o["custom_id"] for o in outputs) == sorted(f"{name}-{i}" for i in range(n))
        assert all(o["response"]["body"]["model"] == MODEL for o in outputs)
        errors = h.lines(manifest.error_uris)
        assert "boom" in {e["custom_id"] for e in errors}
    # the replicas that were there ran everything: no engine and no job started for these batches
    assert replica_pids(asyncio.run(api.status()), MODEL) == [replica]
    print(f"two small batches on the runner: {elapsed:.2f} s")
    # the runner reports the engines' figures from Ray's metrics (exported about every 10 s)
    deadline = time.monotonic() + 90

    def settled(f: dict[str, Any]) -> bool:  # an export taken after both batches ended
        return bool(f.get("requests", 0) >= 14 and f.get("queued") == 0 and f.get("active") == 0)

    while not settled(figures := asyncio.run(client.engines()).get(MODEL, {})):
        assert time.monotonic() < deadline, figures
        time.sleep(2)
    assert figures["replicas"] >= 1 and figures["cold_starts"] >= 1 and figures["completion_tokens"] > 0


def test_the_replicas_run_without_the_node_secrets_they_do_not_need(
    runner: tuple[RunnerClient, ServeApi], s3_settings: S3Settings
) -> None:
    """The Ray head has the S3 keys in its environment (as Ray pods have them from a Secret); code in the
    engine replica finds none of the node's secrets in its own, and code in the runner's replica no S3
    key (its batches bring their own): read from the processes, where such code would look."""
    _, api = runner
    details = asyncio.run(api.status())
    [engine] = replica_pids(details, MODEL)
    runners = runner_pids(details)
    assert len(runners) == DEFAULT_REPLICAS
    key, secret = s3_settings.access_key.get_secret_value(), s3_settings.secret_key.get_secret_value()
    # (failures name variables, never print their values)
    for pid in (engine, *runners):
        node = environ(parent_pid(pid))  # the raylet that started the replica
        node_has_keys = (
            node.get(node_secrets.S3_ACCESS_KEY) == key and node.get(node_secrets.S3_SECRET_KEY) == secret
        )
        assert node_has_keys, "the Ray node should hold the S3 keys"
    engine_env = environ(engine)
    assert [name for name in node_secrets.ALL if engine_env.get(name)] == []  # the engine replica has them
    for runner_pid in runners:  # the runner's have no S3 key, only the credential they check
        runner_env = environ(runner_pid)
        assert [name for name in node_secrets.S3_KEYS if runner_env.get(name)] == []
        assert runner_env.get(node_secrets.RUNNER_TOKEN)
    for pid in (engine, *runners):  # nor under any other name
        raw = raw_environ(pid)
        assert key.encode() not in raw and secret.encode() not in raw


def test_stop_keeps_what_finished_and_the_next_attempt_completes_the_rest(
    h: Harness, runner: tuple[RunnerClient, ServeApi]
) -> None:
    client, _ = runner
    first = _spec(h, "runner-stop", 400, inline=False, progress_interval_s=0.2)
    asyncio.run(client.submit(first))
    # stop once the progress counters in Redis show some lines done (blocks of 4, 0.2 s each)
    _wait_progress(h, first, 8)
    assert asyncio.run(client.stop(first.submission_id)) is True
    info = _wait(client, first.submission_id)
    assert info.state is JobState.FAILED and info.exit_code == 1 and "stopped" in (info.message or "")
    partial = h.manifest(first)
    assert partial.status == "partial" and partial.error is not None and partial.error.code == "stopped"
    done_first = partial.request_counts.completed + partial.request_counts.failed
    assert 8 <= done_first < 402
    second = first.model_copy(update={"attempt": 2})
    asyncio.run(client.submit(second))
    assert _wait(client, second.submission_id).state is JobState.SUCCEEDED
    manifest = h.manifest(second)
    assert manifest.status == BatchStatus.COMPLETED
    outputs = [o["custom_id"] for o in h.lines(manifest.output_uris)]
    # every line answered exactly once across the two attempts
    assert sorted(outputs) == sorted(f"runner-stop-{i}" for i in range(400))
    assert asyncio.run(client.stop(second.submission_id)) is False  # already over


def test_deadline_and_missing_engine_end_the_run_clearly(
    h: Harness, runner: tuple[RunnerClient, ServeApi]
) -> None:
    client, _ = runner
    # 400 requests, 8 at a time (the engine's slots), 0.2 s each: at least 10 s of work, so the 2 s
    # deadline always falls inside the run (60 requests finished in 2.0 s on a CI machine with 16 at
    # a time, and the run succeeded)
    late = _spec(h, "runner-deadline", 400, inline=False, deadline=utcnow() + timedelta(seconds=2))
    no_engine = _spec(h, "runner-noengine", 2, inline=True).model_copy(
        update={"engine_app": app_name("not-deployed"), "engine_wait_s": 3.0}
    )
    for spec in (late, no_engine):
        asyncio.run(client.submit(spec))
    info = _wait(client, late.submission_id)
    assert info.state is JobState.FAILED and info.exit_code == 1
    manifest = h.manifest(late)
    assert manifest.status == "partial" and manifest.error is not None
    assert manifest.error.code == "deadline_exceeded"
    info = _wait(client, no_engine.submission_id)
    assert info.state is JobState.FAILED and info.exit_code == ExitCode.ENGINE_UNAVAILABLE
    assert "engine_unavailable" in (info.message or "")
    assert asyncio.run(client.status("never-submitted-a1")) is None


def test_the_runner_answers_no_one_without_its_credential(
    h: Harness, runner: tuple[RunnerClient, ServeApi], ray_settings: RaySettings
) -> None:
    """Through Serve's proxy, as anyone on the network would call it: no credential, or a wrong one, is
    refused (a set-up fault for the dispatcher: retriable, never the batch's), and nothing starts."""
    client, _ = runner
    spec = _spec(h, "runner-nocred", 2, inline=True)
    for token in (None, SecretStr("not-the-runner-token-" + "x" * 20)):
        stranger = RunnerClient(ray_settings.serve_address, timeout_s=30, token=token)
        with pytest.raises(RayUnavailable, match="LLMBATCH_RAY__RUNNER_TOKEN"):
            asyncio.run(stranger.submit(spec))
        with pytest.raises(RayUnavailable, match="LLMBATCH_RAY__RUNNER_TOKEN"):
            asyncio.run(stranger.statuses([spec.submission_id]))
    raw = urllib.request.Request(ray_settings.serve_address + "/llmbatch-runner/engines")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(raw, timeout=30)
    assert refused.value.code == 401
    assert asyncio.run(client.status(spec.submission_id)) is None  # never started


def test_keys_and_prefix_come_from_the_batch_identity_not_the_caller(
    h: Harness, runner: tuple[RunnerClient, ServeApi]
) -> None:
    """A spec naming another Redis key gets its progress written where its identity says; one naming
    another bucket for its results is refused."""
    client, _ = runner
    foreign = f"{h.redis.key_prefix}:progress:someone-else-{h.tag}"
    spec = _spec(h, "runner-derived", 3, inline=True, progress_key=foreign)
    asyncio.run(client.submit(spec))
    assert _wait(client, spec.submission_id).state is JobState.SUCCEEDED
    r = redis.Redis.from_url(h.redis.url)
    assert r.exists(foreign) == 0
    assert int(r.hget(_progress_key(h, spec), "completed") or 0) == 3
    elsewhere = _spec(h, "runner-elsewhere", 1, inline=True)
    elsewhere = elsewhere.model_copy(
        update={"output_prefix": f"s3://another-bucket-{h.tag}/default/{elsewhere.batch_id}/"}
    )
    with pytest.raises(JobRejected, match="output_prefix"):
        asyncio.run(client.submit(elsewhere))


def test_runs_outlive_the_replicas_and_a_lost_replica_loses_only_its_running_batches(
    h: Harness, runner: tuple[RunnerClient, ServeApi]
) -> None:
    """Every runner replica killed (SIGKILL): a finished run is still answered (from Redis, by the new
    replicas), and a run that was going is reported unknown (the dispatcher retries it as lost)."""
    client, api = runner
    done = _spec(h, "runner-durable", 2, inline=True)
    asyncio.run(client.submit(done))
    assert _wait(client, done.submission_id).state is JobState.SUCCEEDED
    going = _spec(h, "runner-orphan", 400, inline=False, progress_interval_s=0.2)
    asyncio.run(client.submit(going))
    _wait_progress(h, going, 4)
    old = runner_pids(asyncio.run(api.status()))
    assert len(old) == DEFAULT_REPLICAS
    for pid in old:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 180
    while len(new := runner_pids(asyncio.run(api.status()))) != len(old) or set(new) & set(old):
        assert time.monotonic() < deadline, f"the runner's replicas did not come back: {new}"
        time.sleep(1)
    info = asyncio.run(client.status(done.submission_id))
    assert info is not None and info.state is JobState.SUCCEEDED and info.exit_code == 0
    deadline = time.monotonic() + 120  # the killed owner stops beating: its run turns unknown
    while (left := asyncio.run(client.status(going.submission_id))) is not None:
        assert not left.state.is_terminal, left  # nothing ended it: its replica died
        assert time.monotonic() < deadline, "a run of a killed replica still reported going"
        time.sleep(1)
