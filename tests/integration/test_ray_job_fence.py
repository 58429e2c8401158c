"""Attempts are fenced by the progress hash (ray_job.job.progress + write_progress.lua, real Redis; results
on a local filesystem): once a later attempt of a batch has started, an earlier one still running (its
stop did not take) writes no progress, no shards and no manifest."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from pyarrow import fs as pafs

from llmbatch.dispatcher.domain.batch_record import IntakeItem
from llmbatch.dispatcher.domain.keys import batch_key
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.ray_job.errors import ExitCode
from llmbatch.ray_job.job import main as job_main
from llmbatch.ray_job.job.progress import Counters, Progress
from llmbatch.ray_job.lines import rows
from llmbatch.ray_job.storage import s3 as job_s3
from llmbatch.schemas.common import utcnow
from llmbatch.schemas.job import JobSpec
from llmbatch.settings import RedisSettings
from tests.support.scratch_store import scratch_store

pytestmark = pytest.mark.integration


@pytest.fixture
def key(redis_settings: RedisSettings) -> Iterator[tuple[redis.Redis, str]]:
    client = redis.Redis.from_url(redis_settings.url, decode_responses=True)
    name = f"test:progress:{uuid.uuid4().hex[:8]}"
    try:
        yield client, name
    finally:
        client.delete(name)
        client.close()


def test_an_earlier_attempt_cannot_write_over_a_later_ones_progress(
    redis_settings: RedisSettings, key: tuple[redis.Redis, str]
) -> None:
    client, name = key
    old = Progress(redis_settings.url, name, attempt=1, interval_s=60, base=Counters(completed=5))
    new = Progress(redis_settings.url, name, attempt=2, interval_s=60, base=Counters(completed=7))
    try:
        old.publish()
        assert client.hget(name, "completed") == "5" and old.still_current()
        assert 0 < client.ttl(name) <= 7 * 86400  # a zombie writing after the end leaves no key for ever
        new.publish()
        old.add(completed=100)
        old.publish()
        assert client.hgetall(name)["completed"] == "7" and client.hget(name, "attempt") == "2"
        assert old.superseded and not old.still_current() and new.still_current()
    finally:
        old.close()
        new.close()


def test_a_stale_attempt_writes_no_shards_and_no_manifest(
    redis_settings: RedisSettings,
    key: tuple[redis.Redis, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client, name = key
    spec = JobSpec.model_validate(
        {
            "batch_id": "b1",
            "attempt": 1,
            "endpoint": "/v1/chat/completions",
            "model": "m",
            "requests": [
                {
                    "custom_id": f"r{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {"messages": [{"role": "user", "content": "hi"}]},
                }
                for i in range(3)
            ],
            "output_prefix": "s3://results/default/b1/",
            "redis_url": redis_settings.url,
            "progress_key": name,
            "progress_interval_s": 60,
        }
    )
    (tmp_path / "results" / "default" / "b1").mkdir(parents=True)
    local = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    monkeypatch.setattr(job_s3, "filesystem", lambda session=None: local)
    later = orjson.dumps({"batch_id": "b1", "attempt": 2, "note": "the later attempt's manifest"})

    def pipeline(att: job_main.Attempt) -> None:
        att.consume([rows.Row(1, rows.OUTPUT, "r0", b'{"custom_id": "r0"}\n')])
        # meanwhile the dispatcher gave up on this attempt and attempt 2 started and finished
        client.hset(name, mapping={"attempt": "2", "completed": "3"})
        with local.open_output_stream("results/default/b1/manifest.json") as f:
            f.write(later)
        att.consume([rows.Row(2, rows.OUTPUT, "r1", b'{"custom_id": "r1"}\n')])

    attempt = job_main.Attempt(spec, utcnow())
    monkeypatch.setattr(attempt, "_install_stop", lambda: None)
    monkeypatch.setattr(attempt, "_run_pipeline", lambda _input: pipeline(attempt))
    code = attempt.run()
    assert code == ExitCode.RETRIABLE
    result: dict[str, Any] = attempt.result or {}
    assert result["status"] == "partial" and result["error"]["code"] == "superseded"
    names = sorted(p.name for p in (tmp_path / "results" / "default" / "b1").iterdir())
    assert names == ["manifest.json"]  # no shard of the stale attempt
    assert (tmp_path / "results" / "default" / "b1" / "manifest.json").read_bytes() == later
    assert client.hgetall(name)["completed"] == "3"  # its progress did not count


@pytest.fixture
async def store(redis_settings: RedisSettings) -> AsyncIterator[StateStore]:
    async with scratch_store(redis_settings.url) as s:
        yield s


async def test_once_the_terminal_event_is_out_the_last_attempt_writes_nothing(
    redis_settings: RedisSettings, store: StateStore
) -> None:
    """A cancel or deadline finishes a batch after ``stop_wait_s`` even if Ray never stopped the job:
    publishing the terminal event closes the progress hash, so that attempt adds nothing after."""
    b1 = batch_key(None, "b1")
    fields = {"model": "m", "attempt": "1", "request": "{}", "source": "s", "event_id": "e1"}
    job = Progress(
        redis_settings.url, store.keys.progress(b1), attempt=1, interval_s=60, base=Counters(completed=2)
    )
    try:
        await store.intake(IntakeItem(b1, fields, ("s", "e1")))
        job.publish()
        assert job.still_current()
        assert (await store.transition(b1, State.CANCELLED, fields={"terminal_event_id": "ev"})).ok
        assert await store.mark_published(b1, "ev")
        job.add(completed=5)
        job.publish()
        assert (await store.read_progress(b1))["completed"] == "2"
        assert job.superseded and not job.still_current()
    finally:
        job.close()


async def test_a_new_lifecycle_is_not_fenced_out_by_an_old_progress_hash(
    redis_settings: RedisSettings, store: StateStore
) -> None:
    """The batch id used again after its record is gone starts at attempt 1: a progress hash the old
    lifecycle left (attempt 3, closed) must not make that attempt stale."""
    b1 = batch_key(None, "b1")
    name = store.keys.progress(b1)
    fields = {"model": "m", "attempt": "0", "request": "{}", "source": "s", "event_id": "e2"}
    job = Progress(redis_settings.url, name, attempt=1, interval_s=60, base=Counters(completed=1))
    try:
        await store.client.hset(name, mapping={"attempt": "3", "closed": "1", "completed": "9"})
        await store.intake(IntakeItem(b1, fields, ("s", "e2")))
        job.publish()
        assert job.still_current() and (await store.read_progress(b1))["completed"] == "1"
    finally:
        job.close()


def heartbeating_spec(
    batch_id: str, redis_url: str, key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> JobSpec:
    """Attempt 1 of a one-line batch whose progress (every 0.2 s) goes to ``key``; results go to
    ``tmp_path`` (the job's S3 filesystem is patched to it)."""
    (tmp_path / "results" / "default" / batch_id).mkdir(parents=True)
    local = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    monkeypatch.setattr(job_s3, "filesystem", lambda session=None: local)
    return JobSpec.model_validate(
        {
            "batch_id": batch_id,
            "attempt": 1,
            "endpoint": "/v1/chat/completions",
            "model": "m",
            "requests": [
                {
                    "custom_id": "r0",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {"messages": [{"role": "user", "content": "hi"}]},
                }
            ],
            "output_prefix": f"s3://results/default/{batch_id}/",
            "redis_url": redis_url,
            "progress_key": key,
            "progress_interval_s": 0.2,
        }
    )


def test_a_stale_attempt_that_never_writes_stops_at_its_next_heartbeat(
    redis_settings: RedisSettings,
    key: tuple[redis.Redis, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stale attempt stuck before its first write (a hung engine) used to run until its deadline:
    only a write asked the fence. Now the heartbeat that finds a later attempt stops it."""
    import signal
    import time

    client, name = key
    spec = heartbeating_spec("b2", redis_settings.url, name, tmp_path, monkeypatch)
    ran_to_the_end = False

    def hung_pipeline() -> None:
        nonlocal ran_to_the_end
        client.hset(name, mapping={"attempt": "2"})  # the dispatcher gave up on it; attempt 2 runs
        end = time.monotonic() + 60
        while time.monotonic() < end:  # never writes: only the heartbeat can notice
            time.sleep(0.05)
        ran_to_the_end = True

    attempt = job_main.Attempt(spec, utcnow())
    monkeypatch.setattr(attempt, "_run_pipeline", lambda _input: hung_pipeline())
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = attempt.run()
    finally:
        for sig, handler in handlers.items():  # the attempt installs its own, then ignores both
            signal.signal(sig, handler)
    assert not ran_to_the_end
    result: dict[str, Any] = attempt.result or {}
    assert code == ExitCode.RETRIABLE and result["status"] == "partial"
    assert result["error"]["code"] == "superseded"
    assert client.hget(name, "attempt") == "2"
    assert list((tmp_path / "results" / "default" / "b2").iterdir()) == []  # no shard, no manifest


def test_a_stale_run_on_the_warm_runner_stops_at_its_next_heartbeat(
    redis_settings: RedisSettings,
    key: tuple[redis.Redis, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same on the batch runner, where a run is a thread: the heartbeat sets the run's stop flag,
    which its pipeline checks while it waits for the engine (no signal)."""
    import time

    from llmbatch.ray_job.batch_runner.runner_attempt import RunnerAttempt

    client, name = key
    spec = heartbeating_spec("b3", redis_settings.url, name, tmp_path, monkeypatch)
    attempt = RunnerAttempt(spec, tokenizer=lambda: None, keep_text=False, engine=lambda: None)  # type: ignore[arg-type,return-value]
    waited = 0.0

    def engine_never_answers() -> None:  # what RunnerAttempt._take does while a block is out
        nonlocal waited
        client.hset(name, mapping={"attempt": "2"})
        began = time.monotonic()
        try:
            while time.monotonic() - began < 60:
                attempt._check_stop()
                time.sleep(0.05)
        finally:
            waited = time.monotonic() - began

    monkeypatch.setattr(attempt, "_run_pipeline", lambda _input: engine_never_answers())
    code = attempt.run()
    result: dict[str, Any] = attempt.result or {}
    assert waited < 60 and code == ExitCode.RETRIABLE
    assert result["status"] == "partial" and result["error"]["code"] == "superseded"
