"""The dispatcher end to end against real Kafka, Redis, MinIO and Ray, on the fake engine.

The dispatcher runs as a separate process (``python -m llmbatch.dispatcher``), so the crash tests can kill it
with SIGKILL exactly as an orchestrator would. Every test uses its own topics, consumer group and
Redis key prefix.

Proven elsewhere, not again here: a batch on real vLLM through Kafka and the dispatcher
(tests/e2e/test_demo.py on the shared engines; tests/integration/test_ray_job_vllm.py for a Ray job's
own engine).
"""

from __future__ import annotations

import asyncio
import struct
import sys
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, TypedDict

import orjson
import pytest
from aiokafka import AIOKafkaProducer

from llmbatch.adapters.storage import ensure_buckets, make_client
from llmbatch.adapters.topics import ensure_topics
from llmbatch.dispatcher.domain.keys import batch_key
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.errors import DispatcherError
from llmbatch.dispatcher.job_options import JobOptions
from llmbatch.dispatcher.settings import DispatcherOptions, DispatcherSettings
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.ray_job.engines.backends import FAKE_BACKEND
from llmbatch.schemas import dlt as dlt_headers
from llmbatch.schemas.batch import BatchRequest, CancelRequest
from llmbatch.schemas.cloudevents import Envelope
from llmbatch.schemas.dlt import ReplayInfo
from llmbatch.schemas.engines import EngineRegistry
from llmbatch.schemas.events import EventType
from llmbatch.schemas.job import EngineConfig
from llmbatch.settings import KafkaSettings, RaySettings, RedisSettings, S3Settings, TopicSettings
from llmbatch.stack.ports import free_port
from tests.support.dispatcher_kit import (
    DispatcherProcess,
    TopicReader,
    batch_request,
    decode_results,
    inline_lines,
    registry,
    request_message,
    terminal_events,
    terminal_ids,
    wait_for,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

FAKE = EngineConfig(backend=FAKE_BACKEND, batch_size=4, num_cpus_per_replica=0.5)


def with_engine(settings: DispatcherSettings, engine: EngineConfig) -> DispatcherSettings:
    """``settings`` whose served models run on ``engine``."""
    models = {m: e.model_copy(update={"engine": engine}) for m, e in settings.engines.models.items()}
    return settings.model_copy(update={"engines": EngineRegistry(models=models)})


class _Hook(TypedDict, total=False):
    """Another entry point for a :class:`DispatcherProcess` to run."""

    module: str
    args: Sequence[str]


class Env:
    """One test's dispatcher world: settings, processes, readers, and a view of Redis."""

    def __init__(self, settings: DispatcherSettings, run_dir: Path) -> None:
        self.settings = settings
        self.run_dir = run_dir
        self.store = StateStore.from_settings(settings.redis)
        self.procs: list[DispatcherProcess] = []
        self.batch_ids: set[str] = set()

    def spawn(
        self,
        name: str = "d1",
        settings: DispatcherSettings | None = None,
        *,
        crash_at: str | None = None,
        **env: str,
    ) -> DispatcherProcess:
        """A dispatcher process; ``crash_at``: one that SIGKILLs itself at that crash point."""
        base = settings or self.settings
        opts = base.dispatcher.model_copy(update={"instance_id": name, "metrics_port": free_port()})
        hooked: _Hook = (
            {"module": "tests.support.crashing_dispatcher", "args": [crash_at]} if crash_at else {}
        )
        proc = DispatcherProcess(
            base.model_copy(update={"dispatcher": opts}), self.run_dir / f"{name}.log", **hooked, **env
        )
        self.procs.append(proc)
        return proc.start()

    async def send(self, *messages: tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]) -> None:
        producer = AIOKafkaProducer(acks="all", **self.settings.kafka.client_kwargs())
        await producer.start()
        try:
            for key, value, headers in messages:
                if key:
                    self.batch_ids.add(key.decode(errors="replace"))
                await producer.send_and_wait(
                    self.settings.kafka.topics.requests, value=value, key=key, headers=headers
                )
        finally:
            await producer.stop()

    async def results(self) -> list[Envelope[Any]]:
        reader = TopicReader(self.settings.kafka.client_kwargs(), self.settings.kafka.topics.results)
        return decode_results(await reader.read_to_end())

    async def dead_letters(self) -> list[Any]:
        reader = TopicReader(self.settings.kafka.client_kwargs(), self.settings.kafka.topics.dead_letter)
        return await reader.read_to_end()

    async def wait_terminal(
        self, batch_ids: list[str], within: float = 240
    ) -> dict[str, list[Envelope[Any]]]:
        async def check() -> dict[str, list[Envelope[Any]]] | None:
            found = terminal_events(await self.results())
            return found if all(b in found for b in batch_ids) else None

        try:
            found: dict[str, list[Envelope[Any]]] = await wait_for(
                check, within, interval=1.0, what=f"terminal events of {batch_ids}"
            )
            return found
        except AssertionError:
            for proc in self.procs:
                print(f"--- {proc.log_path.name}\n{proc.tail(40)}")
            raise

    async def state(self, batch_id: str) -> State | None:
        record = await self.store.get(batch_key(None, batch_id))
        return record.state if record else None

    async def close(self) -> None:
        """Stops every dispatcher; fails the test when one had ended on its own (not killed)."""
        died = [proc for proc in self.procs if proc.ended_on_its_own() is not None]
        for proc in self.procs:
            proc.terminate(timeout=30)
        await self.store.close()
        stop_jobs(self.settings.ray, self.batch_ids)  # jobs outlive the dispatcher by design
        for proc in died:
            proc.stop_checked()  # raises, naming the exit code and the log's tail


def stop_jobs(ray: RaySettings, batch_ids: set[str]) -> None:
    """Stop this test's unfinished Ray jobs so they do not hold the small test cluster's CPUs."""
    from ray.job_submission import JobSubmissionClient

    try:
        client = JobSubmissionClient(ray.address)
        for job in client.list_jobs():
            sid = job.submission_id or ""
            if sid.rsplit("-a", 1)[0] in batch_ids and not job.status.is_terminal():
                client.stop_job(sid)
    except Exception as exc:  # the head may be gone (restart test)
        print(f"could not stop test jobs: {exc}")


def world(
    kafka: KafkaSettings,
    redis: RedisSettings,
    s3: S3Settings,
    ray: RaySettings,
    *,
    engine: EngineConfig = FAKE,
    model_path: str = "/models/unused",
    job: dict[str, Any] | None = None,
    **opts: Any,
) -> DispatcherSettings:
    tag = uuid.uuid4().hex[:8]
    topics = TopicSettings(
        requests=f"req-{tag}", results=f"res-{tag}", dead_letter=f"req-{tag}.dlt", partitions=2
    )
    options: dict[str, Any] = dict(
        group_id=f"g-{tag}",
        session_timeout_ms=6000,
        heartbeat_interval_ms=1000,
        poll_interval_s=0.5,
        lease_ttl_s=4,
        retry_backoff_base_s=0.5,
        retry_backoff_max_s=2,
        io_backoff_base_s=0.2,
        io_backoff_max_s=1,
        progress_interval_s=1,
        # finished jobs deleted within seconds (the happy path waits for the delete and its check)
        job_delete_settle_s=5,
        job_delete_recheck_s=10,
        log_json=True,
        # 2 test CPUs fit one Ray Data job at a time; more would starve each other
        max_in_flight=1,
        # these tests prove the Ray-job path (an engine per job); the shared engines' tests opt in
        shared_engines=False,
    )
    options.update(opts)
    return DispatcherSettings(
        kafka=kafka.model_copy(update={"topics": topics}),
        redis=redis.model_copy(update={"key_prefix": f"e{tag}"}),
        s3=s3,
        ray=ray,
        dispatcher=DispatcherOptions(**options),
        engines=registry(engine, path=model_path),
        job=JobOptions(
            python=sys.executable,
            progress_interval_s=0.5,
            ray_stop_wait_s=10,
            stop_wait_s=30,
            shard_max_seconds=2,
            shard_max_lines=5,
            **(job or {}),
        ),
    )


@pytest.fixture(scope="module")
async def buckets(s3_settings: S3Settings) -> S3Settings:
    ensure_buckets(make_client(s3_settings), s3_settings)
    return s3_settings


@pytest.fixture
async def env(
    kafka_settings: KafkaSettings,
    redis_settings: RedisSettings,
    buckets: S3Settings,
    ray_settings: RaySettings,
    tmp_path: Path,
) -> AsyncIterator[Env]:
    e = Env(world(kafka_settings, redis_settings, buckets, ray_settings), tmp_path)
    await ensure_topics(e.settings)
    try:
        yield e
    finally:
        await e.close()


def assert_one_terminal(events: list[Envelope[Any]], batch_ids: list[str]) -> None:
    ids = terminal_ids(events)
    for batch_id in batch_ids:
        assert len(ids.get(batch_id, set())) == 1, f"{batch_id}: terminal ids {ids.get(batch_id)}"


def ray_jobs(ray: RaySettings, prefix: str) -> list[str]:
    """``submission_id:STATUS`` of the Ray jobs whose submission id starts with ``prefix``."""
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(ray.address)
    return sorted(
        f"{j.submission_id}:{j.status}"
        for j in client.list_jobs()
        if (j.submission_id or "").startswith(prefix)
    )


# --- happy path, duplicates, invalid events -----------------------------------------------------------


async def test_happy_path_duplicates_and_invalid_events(env: Env, ray_settings: RaySettings) -> None:
    s3 = env.settings.s3
    a = batch_request(f"happy-{uuid.uuid4().hex[:8]}", requests=inline_lines(5), metadata={"case": "happy"})
    b = batch_request(f"other-{uuid.uuid4().hex[:8]}", requests=inline_lines(2))
    first = request_message(a, event_id="ev-a")
    key, value, headers = request_message(b)
    env.spawn()
    await env.send(
        first,
        first,
        request_message(a),  # redelivery + same batch_id, new event
        (key, b"not json", headers),  # invalid: bad JSON
        (key, value, [(k, v) for k, v in headers if k != "ce_source"]),  # invalid: no ce_source
        request_message(batch_request(f"big-{uuid.uuid4().hex[:6]}", requests=inline_lines(1001))),  # limit
        (key, value, headers),  # valid, after the invalid ones
    )
    found = await env.wait_terminal([a.batch_id, b.batch_id])
    events = await env.results()
    assert_one_terminal(events, [a.batch_id, b.batch_id])
    done = found[a.batch_id][0]
    assert done.type is EventType.COMPLETED, done.data.error
    data = done.data
    assert (data.request_counts.total, data.request_counts.completed, data.request_counts.failed) == (5, 5, 0)
    assert data.usage.completion_tokens > 0 and data.attempts == 1 and data.metadata == {"case": "happy"}
    sid = data.ray_submission_id or ""
    assert sid.startswith(f"{a.batch_id}-") and sid.endswith("-a1") and data.output_uris and data.manifest_uri
    # the output really is in MinIO and answers every request once
    client = make_client(s3)
    lines: list[dict[str, Any]] = []
    for uri in data.output_uris:
        bucket, _, obj = uri[5:].partition("/")
        lines += [orjson.loads(x) for x in client.get_object(bucket, obj).read().splitlines() if x]
    assert sorted(x["custom_id"] for x in lines) == sorted(f"req-{i}" for i in range(5))

    # one attempt for the duplicated batch, and its Ray job is deleted once the terminal event is out and
    # it settled, then asked for again (Ray's job monitor wrote it back in CI, as FAILED)
    async def deleted_and_checked() -> bool:
        pending = [e for e in await env.store.due_job_deletes(1e12, limit=10_000) if a.batch_id in e]
        return not pending and not ray_jobs(ray_settings, a.batch_id)

    try:
        await wait_for(deleted_and_checked, 240, interval=2, what="the finished job deleted and checked")
    except AssertionError:
        print("left on the head:", ray_jobs(ray_settings, a.batch_id))
        for proc in env.procs:
            print(
                f"--- {proc.log_path.name}\n"
                + "\n".join(line for line in proc.log_path.read_text().splitlines() if "Ray job" in line)
            )
        raise
    # accepted, then the terminal event; every accepted id stable
    types = [e.type for e in events if e.batch_id == a.batch_id]
    assert types[0] is EventType.ACCEPTED and types[-1] is EventType.COMPLETED
    # the second request for the same batch id (a new event id) was answered, not run
    rejected = [e for e in events if e.type is EventType.REJECTED and e.batch_id == a.batch_id]
    answers = {(e.id, e.data.error.code) for e in rejected}
    assert [code for _, code in answers] == ["duplicate_batch_id"]
    dead = await env.dead_letters()
    reasons = sorted(dict(r.headers)[dlt_headers.REASON].decode() for r in dead)
    assert reasons == ["invalid_event", "invalid_event", "limit_exceeded"]
    record = await env.store.get(batch_key(None, a.batch_id))
    assert record is not None and record.flag("published")


# --- kill -9 at several points -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "point", ["after_accept", "after_submit", "after_job_end", "after_dlt", "after_publish"]
)
async def test_kill9_then_restart_gives_exactly_one_terminal_event(env: Env, point: str) -> None:
    if point == "after_dlt":  # the dead letter of a failed batch: an input that does not exist
        request = batch_request(
            f"k-{point}-{uuid.uuid4().hex[:6]}",
            input_uri=f"s3://{env.settings.s3.input_bucket}/default/missing/{uuid.uuid4().hex}.jsonl",
        )
    else:
        request = batch_request(f"k-{point.replace('_', '-')}-{uuid.uuid4().hex[:6]}")
    proc = env.spawn("victim", crash_at=point)
    await env.send(request_message(request))
    await wait_for(lambda: not proc.alive(), 180, interval=0.5, what=f"the dispatcher to die at {point}")
    assert proc.proc is not None and proc.proc.returncode == -9, proc.tail()
    env.spawn("survivor")
    found = await env.wait_terminal([request.batch_id])
    events = await env.results()
    assert_one_terminal(events, [request.batch_id])
    expected = EventType.FAILED if point == "after_dlt" else EventType.COMPLETED
    assert found[request.batch_id][0].type is expected
    await wait_for(lambda: _published(env, request.batch_id), 60, what="published mark")
    if point == "after_publish":  # published before the crash, so published again: the SAME id
        again = terminal_events(await env.results())[request.batch_id]
        assert len(again) == 2 and again[0].id == again[1].id
        assert_one_terminal(await env.results(), [request.batch_id])
    if point == "after_dlt":
        dead = await env.dead_letters()
        assert dead and all(dict(r.headers)[dlt_headers.REASON] == b"input_not_found" for r in dead)


async def _published(env: Env, batch_id: str) -> bool:
    record = await env.store.get(batch_key(None, batch_id))
    return record is not None and record.flag("published")


# --- two replicas --------------------------------------------------------------------------------------


async def test_two_replicas_one_killed_the_other_takes_over(
    env: Env,
    kafka_settings: KafkaSettings,
    redis_settings: RedisSettings,
    buckets: S3Settings,
    ray_settings: RaySettings,
) -> None:
    slow = FAKE.model_copy(update={"backend_options": {"delay_s": 1.0}})
    settings = with_engine(env.settings, slow)
    one = env.spawn("one", settings)
    two = env.spawn("two", settings)
    # one batch at a time (max_in_flight=1): one running at the kill, one queued behind it, one sent after
    before = [batch_request(f"r2-{i}-{uuid.uuid4().hex[:6]}", requests=inline_lines(4)) for i in range(2)]
    await env.send(*(request_message(r) for r in before))
    await wait_for(lambda: _any_running(env, before), 180, what="a job running")
    leader_token = await env.store.client.get(env.store.keys.lease("tracker"))
    assert leader_token, "no tracker leader"
    victim, survivor = (one, two) if str(leader_token).startswith("one/") else (two, one)
    victim.kill9()
    after = [batch_request(f"r2b-{uuid.uuid4().hex[:6]}", requests=inline_lines(2))]
    await env.send(*(request_message(r) for r in after))
    ids = [r.batch_id for r in before + after]
    await env.wait_terminal(ids, within=480)
    events = await env.results()
    assert_one_terminal(events, ids)
    assert all(e.type is EventType.COMPLETED for e in events if e.is_terminal)
    assert survivor.alive()
    token = str(await env.store.client.get(env.store.keys.lease("tracker")))
    assert token.startswith("one/" if survivor is one else "two/")


async def _any_running(env: Env, requests: list[BatchRequest]) -> bool:
    for r in requests:
        if await env.state(r.batch_id) in {State.RUNNING, State.FINALIZING, State.COMPLETED}:
            return True
    return False


# --- cancel, deadline, retries ---------------------------------------------------------------------------


async def _progress(env: Env, batch_id: str) -> int:
    data = await env.store.read_progress(batch_key(None, batch_id))
    return int(data.get("completed", 0))


async def _progress_at_least(env: Env, batch_id: str, n: int) -> bool:
    return await _progress(env, batch_id) >= n


async def test_cancel_keeps_partial_results(env: Env) -> None:
    slow = FAKE.model_copy(
        update={"backend_options": {"delay_s": 0.5}, "batch_size": 1, "batches_in_flight": 1}
    )
    settings = with_engine(env.settings, slow)
    env.spawn("d1", settings)
    request = batch_request(f"cancel-{uuid.uuid4().hex[:6]}", requests=inline_lines(40))
    await env.send(request_message(request))
    # past the first shard (5 lines): a closed shard is durable whatever happens to the job
    await wait_for(lambda: _progress_at_least(env, request.batch_id, 8), 180, what="some requests done")
    await env.send(request_message(CancelRequest(batch_id=request.batch_id, reason="test cancel")))
    found = await env.wait_terminal([request.batch_id])
    event = found[request.batch_id][0]
    assert event.type is EventType.CANCELLED
    counts = event.data.request_counts
    assert counts.total == 40 and 0 < counts.completed < 40
    assert event.data.output_uris  # the partial results are listed
    progress = [
        e for e in await env.results() if e.type is EventType.PROGRESS and e.batch_id == request.batch_id
    ]
    assert (
        progress and max(p.data.request_counts.completed for p in progress) > 0
    )  # throttled progress events
    assert_one_terminal(await env.results(), [request.batch_id])


async def test_deadline_expires_with_partial_results(env: Env) -> None:
    slow = FAKE.model_copy(
        update={"backend_options": {"delay_s": 0.5}, "batch_size": 1, "batches_in_flight": 1}
    )
    settings = with_engine(env.settings, slow)
    env.spawn("d1", settings)
    # the deadline lands while the job runs: it takes 40 x 0.5 s at least
    deadline = time.time() + 25
    from datetime import UTC, datetime

    request = batch_request(
        f"exp-{uuid.uuid4().hex[:6]}",
        requests=inline_lines(40),
        deadline=datetime.fromtimestamp(deadline, UTC).isoformat(),
    )
    await env.send(request_message(request))
    found = await env.wait_terminal([request.batch_id])
    event = found[request.batch_id][0]
    assert event.type is EventType.EXPIRED
    assert event.data.request_counts.total == 40 and event.data.request_counts.completed < 40
    assert_one_terminal(await env.results(), [request.batch_id])


async def test_retry_exhaustion_fails_and_dead_letters(env: Env) -> None:
    # every attempt fails retriably: the job cannot reach object storage
    broken = env.settings.job.model_copy(
        update={"env_vars": {"LLMBATCH_S3__ENDPOINT": f"http://127.0.0.1:{free_port()}"}}
    )
    settings = env.settings.model_copy(
        update={"job": broken, "dispatcher": env.settings.dispatcher.model_copy(update={"max_attempts": 2})}
    )
    env.spawn("d1", settings)
    request = batch_request(f"exh-{uuid.uuid4().hex[:6]}")
    key, value, headers = request_message(request)
    await env.send((key, value, headers))
    found = await env.wait_terminal([request.batch_id], within=300)
    event = found[request.batch_id][0]
    assert event.type is EventType.FAILED
    assert event.data.error.code == "attempts_exhausted" and event.data.attempts == 2
    sid = event.data.ray_submission_id or ""
    assert sid.startswith(f"{request.batch_id}-") and sid.endswith("-a2")
    dead = await wait_for(env.dead_letters, 60, what="the dead letter")
    assert len(dead) == 1
    letter = dead[0]
    h = dict(letter.headers)
    assert (letter.key, letter.value) == (key, value)
    assert h[dlt_headers.REASON] == b"attempts_exhausted"
    assert h[dlt_headers.ORIGINAL_TOPIC] == env.settings.kafka.topics.requests.encode()
    assert struct.unpack(">q", h[dlt_headers.ORIGINAL_OFFSET])[0] == 0
    assert h["ce_id"] == dict(headers)["ce_id"]  # original headers kept
    # an operator replay of the dead letter runs the batch again, as a new lifecycle
    env.procs[-1].terminate()
    env.spawn("fixed")
    replay = ReplayInfo(replay_id="r-1", replayed_at=datetime_now(), replayed_by="test")
    replay_headers = [*dlt_headers.strip_dlt_headers(list(letter.headers)), *replay.to_headers()]
    await env.send((letter.key, letter.value, replay_headers))

    async def completed() -> bool:
        return any(
            e.type is EventType.COMPLETED for e in terminal_events(await env.results())[request.batch_id]
        )

    await wait_for(completed, 240, interval=2, what="the replayed batch to complete")
    ids = terminal_ids(await env.results())[request.batch_id]
    assert len(ids) == 2  # one per lifecycle
    record = await env.store.get(batch_key(None, request.batch_id))
    assert record is not None and record.state is State.COMPLETED and record.attempt == 3


def datetime_now() -> Any:
    from datetime import UTC, datetime

    return datetime.now(UTC)


# --- graceful shutdown ----------------------------------------------------------------------------------


async def test_sigterm_leaves_the_job_running_for_the_next_owner(env: Env) -> None:
    from ray.job_submission import JobStatus, JobSubmissionClient

    slow = FAKE.model_copy(
        update={"backend_options": {"delay_s": 0.5}, "batch_size": 1, "batches_in_flight": 1}
    )
    settings = with_engine(env.settings, slow)
    first = env.spawn("first", settings)
    request = batch_request(f"term-{uuid.uuid4().hex[:6]}", requests=inline_lines(30))
    await env.send(request_message(request))
    await wait_for(lambda: _progress(env, request.batch_id), 240, what="the job to make progress")
    assert first.terminate(timeout=60) == 0, first.tail()
    assert "dispatcher stopped" in first.tail(20)
    client = JobSubmissionClient(env.settings.ray.address)
    record = await env.store.get(batch_key(None, request.batch_id))
    assert record is not None and record.submission_id
    status = client.get_job_status(record.submission_id)
    assert status in {JobStatus.RUNNING, JobStatus.SUCCEEDED}  # not stopped by the shutdown
    env.spawn("second", settings)
    found = await env.wait_terminal([request.batch_id])
    event = found[request.batch_id][0]
    assert event.type is EventType.COMPLETED and event.data.attempts == 1
    assert event.data.request_counts.completed == 30
    assert_one_terminal(await env.results(), [request.batch_id])


# --- shared engines on Ray Serve --------------------------------------------------------------------


async def test_shared_engine_serves_every_batch_and_unknown_models_are_refused(
    env: Env, ray_settings: RaySettings
) -> None:
    """The dispatcher deploys the registry's Serve app and the batch runner on start; small batches
    run on the runner and the one warm replica (no Ray job, no engine start); a request for a model
    that is not served is dead-lettered."""
    from typer.testing import CliRunner

    from llmbatch.dispatcher.backends.engines import replica_pids
    from llmbatch.dispatcher.backends.serve_api import ServeApi
    from llmbatch.dispatcher.ops.engines_cli import app as engines_app
    from llmbatch.schemas.engines import ReplicaResources, Scaling
    from tests.support.dispatcher_kit import MODEL

    entry = env.settings.engines.get(MODEL).model_copy(
        update={
            "engine": FAKE.model_copy(update={"backend_options": {"delay_s": 0.2}}),
            "resources": ReplicaResources(num_cpus=0.25),
            "scaling": Scaling(min_replicas=1, max_replicas=1, idle_s=60),
            # room for 6 requests: the 5-line batch never runs beside another (admission, not max_in_flight)
            "admit_per_replica": 6,
        }
    )
    opts = env.settings.dispatcher.model_copy(update={"shared_engines": True})
    settings = env.settings.model_copy(
        update={
            "dispatcher": opts,
            "engines": EngineRegistry(models={MODEL: entry}),
        }
    )
    api = ServeApi(ray_settings.address, timeout_s=60)
    try:
        proc = env.spawn(settings=settings)
        batches = [
            batch_request(f"shared-{n}-{uuid.uuid4().hex[:6]}", requests=inline_lines(n)) for n in (5, 3, 2)
        ]
        unknown = batch_request(
            f"nomodel-{uuid.uuid4().hex[:6]}",
            model="no-such-model",
            requests=inline_lines(1, model="no-such-model"),
        )
        await env.send(*(request_message(b) for b in batches), request_message(unknown))
        found = await env.wait_terminal([b.batch_id for b in batches], within=600)
        pids = replica_pids(await api.status(), MODEL)
        assert len(pids) == 1, await api.status()
        for b, n in zip(batches, (5, 3, 2), strict=True):
            done = found[b.batch_id][0]
            assert done.type is EventType.COMPLETED, done.data.error
            counts = done.data.request_counts
            assert (counts.total, counts.completed, counts.failed) == (n, n, 0)
        dead = await wait_for(env.dead_letters, 60, what="the unknown model's dead letter")
        reasons = {dict(r.headers)[dlt_headers.REASON].decode() for r in dead}
        assert reasons == {"model_not_found"}
        # operators see the engine: running, one replica, still the same one
        shown = await asyncio.to_thread(  # the CLI runs its own event loop
            CliRunner().invoke, engines_app, ["list", "--json"], obj={"settings": settings}
        )
        assert shown.exit_code == 0, shown.output
        [row] = orjson.loads(shown.stdout)["engines"]
        assert (row["model"], row["status"], row["running"]) == (MODEL, "RUNNING", 1)
        assert replica_pids(await api.status(), MODEL) == pids

        # and its figures (Ray's metrics, summed by the runner): the list and the dispatcher's gauges
        async def figures() -> dict[str, Any] | None:
            shown = await asyncio.to_thread(
                CliRunner().invoke, engines_app, ["list", "--json"], obj={"settings": settings}
            )
            [row] = orjson.loads(shown.stdout)["engines"]
            f: dict[str, Any] | None = row["figures"]
            return f if f and f["requests"] >= 10 else None

        f = await wait_for(figures, 120, interval=3, what="the engine's figures in `engines list`")
        # replicas >= 1: Ray's agent keeps a gone replica's series (earlier tests' replicas) for a while
        assert f["replicas"] >= 1 and f["completion_tokens"] > 0 and f["queued"] == 0, f
        assert isinstance(proc.settings, DispatcherSettings)
        scrape = f"http://127.0.0.1:{proc.settings.dispatcher.metrics_port}/metrics"

        async def gauge() -> str | None:
            text = await asyncio.to_thread(lambda: urllib.request.urlopen(scrape, timeout=10).read().decode())
            return text if f'llmbatch_engine_completion_tokens{{model="{MODEL}"}}' in text else None

        text = await wait_for(gauge, 60, interval=3, what="llmbatch_engine_* on the dispatcher's /metrics")
        assert f'llmbatch_admission_capacity_requests{{model="{MODEL}"}} 6.0' in text
        # small batches take the short path (the warm batch runner): no Ray job per batch
        records = [await env.store.get(batch_key(None, b.batch_id)) for b in batches]
        assert {r.get("via") for r in records if r is not None} == {"batch_runner"}, records
    finally:
        await api.deploy({"applications": []})


async def test_a_ray_head_restart_loses_jobs_runs_and_engines_which_all_come_back(
    kafka_settings: KafkaSettings, redis_settings: RedisSettings, buckets: S3Settings, tmp_path: Path
) -> None:
    """A head restarted without GCS fault tolerance comes back with no jobs and no Serve applications.
    Two batches run when it goes: one as a Ray job (on the shared engine), one on the batch runner. The
    dispatcher (tracker leader) finds the job lost, deploys the engines and the runner again, and both
    batches run again and complete, each answered once with every custom_id once."""
    from llmbatch.dispatcher.backends.serve_api import ServeApi
    from llmbatch.ray_job.batch_runner.runner_http import APP_NAME
    from llmbatch.schemas.engines import ReplicaResources, Scaling
    from tests.support.dispatcher_kit import MODEL
    from tests.support.private_ray import PrivateRay

    head = PrivateRay(tmp_path / "ray", s3=buckets)
    head.start()
    # 20 lines or fewer take the runner; more run as a Ray job
    settings = world(
        kafka_settings,
        redis_settings,
        buckets,
        head.settings(),
        shared_engines=True,
        max_in_flight=None,
        short_path_max_lines=20,
    )
    slow = FAKE.model_copy(
        update={"backend_options": {"delay_s": 1.0}, "batch_size": 1, "batches_in_flight": 1}
    )
    entry = settings.engines.get(MODEL).model_copy(
        update={
            "engine": slow,
            "resources": ReplicaResources(num_cpus=0.25),
            "scaling": Scaling(min_replicas=1, max_replicas=1, idle_s=60),
            "max_active_requests": 1,  # one request at a time: both batches are mid-batch at the restart
        }
    )
    e = Env(settings.model_copy(update={"engines": EngineRegistry(models={MODEL: entry})}), tmp_path)
    await ensure_topics(e.settings)
    api = ServeApi(head.address, timeout_s=30)

    async def runner_deployed() -> bool:
        try:
            return APP_NAME in ((await api.status()).get("applications") or {})
        except DispatcherError:
            return False

    try:
        e.spawn()
        job = batch_request(f"rayjob-{uuid.uuid4().hex[:6]}", requests=inline_lines(30))
        run = batch_request(f"rayrun-{uuid.uuid4().hex[:6]}", requests=inline_lines(20))
        # the runner's batch goes once the job runs: a Ray job takes 30-60 s to start, the runner none
        await e.send(request_message(job))
        await wait_for(lambda: _progress(e, job.batch_id), 300, what="the job's progress")
        await e.send(request_message(run))
        await wait_for(lambda: _progress(e, run.batch_id), 120, what="the runner batch's progress")
        records = {b.batch_id: await e.store.get(batch_key(None, b.batch_id)) for b in (job, run)}
        vias = {b: r.get("via") if r is not None else None for b, r in records.items()}
        assert vias == {job.batch_id: "ray_job", run.batch_id: "batch_runner"}, vias
        assert {r.state for r in records.values() if r is not None} == {State.RUNNING}  # both mid-batch
        head.stop()
        head.start()  # same ports, no job records, no Serve applications
        assert not await runner_deployed()
        await wait_for(runner_deployed, 120, interval=2, what="the dispatcher to deploy the engines again")
        ids = [job.batch_id, run.batch_id]
        found = await e.wait_terminal(ids, within=400)
        assert_one_terminal(await e.results(), ids)
        for batch, n in ((job, 30), (run, 20)):
            event = found[batch.batch_id][0]
            assert event.type is EventType.COMPLETED, (batch.batch_id, event.data.error)
            assert event.data.attempts >= 2 and event.data.request_counts.completed == n
            answered = _custom_ids(buckets, event.data.output_uris)
            assert sorted(answered) == sorted(f"req-{i}" for i in range(n)), batch.batch_id
        logs = "".join(p.log_path.read_text() for p in e.procs)
        assert "job lost" in logs and "deploying them again" in logs
    finally:
        await e.close()
        head.stop()
        head.remove_temp()


def _custom_ids(s3: S3Settings, uris: list[str]) -> list[str]:
    client = make_client(s3)
    ids: list[str] = []
    for uri in uris:
        bucket, _, obj = uri[5:].partition("/")
        ids += [orjson.loads(x)["custom_id"] for x in client.get_object(bucket, obj).read().splitlines() if x]
    return ids


async def test_the_shared_path_keeps_exactly_once_resume_cancel_and_deadline(
    env: Env, ray_settings: RaySettings
) -> None:
    """What the Ray-job path proves above, on the shared engine's short path (the batch runner): a
    dispatcher killed right after submitting, the runner's replicas killed mid-batch (the attempt is lost,
    the next one resumes from the durable shards), a cancel and a deadline keeping partial results;
    every batch ends in exactly one terminal event and no custom_id is answered twice."""
    import os
    import signal

    from llmbatch.dispatcher.backends.engines import runner_pids
    from llmbatch.dispatcher.backends.serve_api import ServeApi
    from llmbatch.schemas.engines import ReplicaResources, Scaling
    from tests.support.dispatcher_kit import MODEL

    slow = FAKE.model_copy(
        update={"backend_options": {"delay_s": 0.5}, "batch_size": 1, "batches_in_flight": 1}
    )
    entry = env.settings.engines.get(MODEL).model_copy(
        update={
            "engine": slow,
            "resources": ReplicaResources(num_cpus=0.25),
            "scaling": Scaling(min_replicas=1, max_replicas=1, idle_s=60),
            "max_active_requests": 1,  # one request at a time: each batch below runs for a while
        }
    )
    opts = env.settings.dispatcher.model_copy(update={"shared_engines": True, "max_in_flight": None})
    engines = EngineRegistry(models={MODEL: entry})
    settings = env.settings.model_copy(update={"dispatcher": opts, "engines": engines})
    s3 = env.settings.s3
    api = ServeApi(ray_settings.address, timeout_s=60)
    try:
        # 1. the dispatcher dies right after the runner took the batch; the next one finishes it
        victim = env.spawn("victim", settings, crash_at="after_submit")
        killed = batch_request(f"sk-{uuid.uuid4().hex[:6]}", requests=inline_lines(3))
        await env.send(request_message(killed))
        await wait_for(lambda: not victim.alive(), 300, interval=0.5, what="the dispatcher to die")
        env.spawn("survivor", settings)
        # 2. the runner replica dies mid-batch: the attempt is lost, the next resumes
        resumed = batch_request(f"sr-{uuid.uuid4().hex[:6]}", requests=inline_lines(40))
        await env.send(request_message(resumed))
        await wait_for(lambda: _progress_at_least(env, resumed.batch_id, 7), 300, what="a durable shard")
        # every replica running now, whichever runs the batch (read now, not before the batch was sent:
        # the runner's second replica may still have been starting then, and the batch went to it)
        for runner in runner_pids(await api.status()):
            os.kill(runner, signal.SIGKILL)
        assert await env.state(resumed.batch_id) is State.RUNNING  # killed mid-batch
        # 3. a cancel and a deadline, both while their batches run (80 and 200 x 0.5 s of work)
        cancel = batch_request(f"sc-{uuid.uuid4().hex[:6]}", requests=inline_lines(80))
        from datetime import UTC, datetime

        deadline = datetime.fromtimestamp(time.time() + 60, UTC).isoformat()
        expire = batch_request(f"se-{uuid.uuid4().hex[:6]}", requests=inline_lines(200), deadline=deadline)
        await env.send(request_message(cancel), request_message(expire))
        await wait_for(lambda: _progress_at_least(env, cancel.batch_id, 8), 300, what="cancel's progress")
        await env.send(request_message(CancelRequest(batch_id=cancel.batch_id, reason="test cancel")))
        ids = [killed.batch_id, resumed.batch_id, cancel.batch_id, expire.batch_id]
        found = await env.wait_terminal(ids, within=600)
        assert_one_terminal(await env.results(), ids)
        done = {b: found[b][0] for b in ids}
        assert [done[b].type for b in ids] == [
            EventType.COMPLETED,
            EventType.COMPLETED,
            EventType.CANCELLED,
            EventType.EXPIRED,
        ], {b: (e.type, e.data.error) for b, e in done.items()}
        assert done[resumed.batch_id].data.attempts >= 2  # the lost attempt was run again
        for batch, n in ((killed, 3), (resumed, 40)):
            answered = _custom_ids(s3, done[batch.batch_id].data.output_uris)
            assert sorted(answered) == sorted(f"req-{i}" for i in range(n)), batch.batch_id  # once each
        for batch, n in ((cancel, 80), (expire, 200)):
            answered = _custom_ids(s3, done[batch.batch_id].data.output_uris)
            assert 0 < len(answered) < n and len(set(answered)) == len(answered), batch.batch_id
        # no batch of this test ran as a Ray job
        assert not [j for b in ids for j in ray_jobs(ray_settings, b)]
    finally:
        await api.deploy({"applications": []})
