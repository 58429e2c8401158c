"""What a small batch costs the batch runner's process (issue 53 item 2): a run in the runner reads no
memory figure of its own (the replica's ``smaps`` is every run's; reading it cost more than a 4-line
batch's whole run) and writes its progress on the runner's Redis client (no connection per batch).
Real MinIO and Redis, the runner's attempt in this process on the fake engine."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis
from minio import Minio

from llmbatch.ray_job.batch_runner.runner_attempt import RunnerAttempt
from llmbatch.ray_job.engines.backend_fake import WhitespaceTokenizer
from llmbatch.ray_job.engines.backends import FAKE_BACKEND
from llmbatch.ray_job.job.engine import LocalEngine
from llmbatch.ray_job.storage import job_redis
from llmbatch.schemas.job import EngineConfig, JobSpec, output_prefix
from llmbatch.schemas.openai import BatchInputLine
from llmbatch.settings import RedisSettings, S3Settings

pytestmark = pytest.mark.integration

CONFIG = EngineConfig(backend=FAKE_BACKEND, batch_size=4, batches_in_flight=2)


def _spec(s3_settings: S3Settings, redis_url: str | None = None) -> JobSpec:
    batch_id = f"c-{uuid.uuid4().hex[:8]}"
    lines = [
        BatchInputLine.model_validate(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "m", "messages": [{"role": "user", "content": f"say {i}"}]},
            }
        )
        for i in range(4)
    ]
    return JobSpec(
        batch_id=batch_id,
        attempt=1,
        endpoint="/v1/chat/completions",
        model="m",
        tenant="acme",
        output_prefix=output_prefix(s3_settings.results_bucket, "acme", batch_id),
        engine=CONFIG,
        engine_app="llmbatch-engine-fake",
        requests=lines,
        redis_url=redis_url,
        progress_key=f"test-cost:progress:{batch_id}" if redis_url else None,
    )


def _run(spec: JobSpec, shared: Any = None) -> RunnerAttempt:
    engine = LocalEngine("fake", CONFIG)
    lent = {} if shared is None else {"redis": shared}
    attempt = RunnerAttempt(
        spec, tokenizer=WhitespaceTokenizer, keep_text=True, engine=lambda: engine, **lent
    )
    assert attempt.run() == 0
    return attempt


def test_a_run_in_the_runner_reports_no_memory_of_its_own(s3_settings: S3Settings, node_minio: Minio) -> None:
    attempt = _run(_spec(s3_settings))
    assert attempt.result is not None
    assert attempt.result["request_counts"]["completed"] == 4, attempt.result
    # the runner's process is every run's: a figure of it would be no batch's (and reading it is costly)
    assert attempt.result["driver_uss_mb"] is None, attempt.result
    assert attempt.result["driver_uss_peak_mb"] is None, attempt.result


def test_runs_in_the_runner_write_progress_on_its_client_and_open_no_connection(
    s3_settings: S3Settings, redis_settings: RedisSettings, node_minio: Minio
) -> None:
    url = redis_settings.url
    shared = job_redis.connect(url, timeout_s=5)
    observer = redis.Redis.from_url(url, decode_responses=True)
    try:
        _run(_spec(s3_settings, url), shared)  # the client's pool has its connections now
        before = int(observer.info("stats")["total_connections_received"])
        specs = [_spec(s3_settings, url) for _ in range(3)]
        for spec in specs:
            _run(spec, shared)
        after = int(observer.info("stats")["total_connections_received"])
        assert after == before, f"{after - before} connections for 3 runs"
        for spec in specs:  # each run's progress was written, through the lent client
            assert spec.progress_key is not None
            assert observer.hget(spec.progress_key, "completed") == "4"
        assert shared.ping()  # and the runs left the runner's client open
    finally:
        shared.close()
        observer.close()
