"""A stopped attempt of the batch runner gives up its calls at the engine and ends for the stop's own
reason. Real MinIO; the runner's attempt in this process on an engine whose calls only end when the
attempt's stop gives them up (as the shared engine does: Serve cancels the call, the replica drops it)."""

from __future__ import annotations

import io
import json
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from minio import Minio

from llmbatch.ray_job.batch_runner.runner_attempt import RunnerAttempt
from llmbatch.ray_job.engines.backend_fake import WhitespaceTokenizer
from llmbatch.ray_job.engines.backends import FAKE_BACKEND
from llmbatch.ray_job.errors import CallAbandonedError, ExitCode
from llmbatch.ray_job.lines.records import Generation, GenRequest
from llmbatch.schemas.batch import DEFAULT_PRIORITY
from llmbatch.schemas.job import EngineConfig, JobSpec, output_prefix
from llmbatch.settings import S3Settings

pytestmark = pytest.mark.integration


class HeldEngine:
    """Holds every call until the caller's stop is set, then gives it up (no answers)."""

    max_model_len = 4096
    default_max_tokens: int | None = None
    engine_start_s = 0.0
    ready_at = 0.0

    def __init__(self) -> None:
        self.given_up = 0
        self.stops: list[threading.Event | None] = []
        self._lock = threading.Lock()

    def generate(
        self,
        requests: list[GenRequest],
        *,
        group: str = "",
        priority: int = DEFAULT_PRIORITY,
        due: float | None = None,
        stop: threading.Event | None = None,
    ) -> list[Generation]:
        with self._lock:
            self.stops.append(stop)
        assert stop is not None and stop.wait(120), "the attempt gave its call no stop, or never stopped"
        with self._lock:
            self.given_up += 1
        raise CallAbandonedError("given up by its caller")


def _spec(s3_settings: S3Settings, node_minio: Minio, deadline: datetime) -> JobSpec:
    batch_id = f"s-{uuid.uuid4().hex[:8]}"
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": f"say {i}"}], "max_tokens": 4},
        }
        for i in range(40)
    ]
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    key = f"acme/{batch_id}/in.jsonl"
    node_minio.put_object(s3_settings.input_bucket, key, io.BytesIO(data), len(data))
    return JobSpec(
        batch_id=batch_id,
        attempt=1,
        endpoint="/v1/chat/completions",
        model="m",
        tenant="acme",
        output_prefix=output_prefix(s3_settings.results_bucket, "acme", batch_id),
        engine_app="llmbatch-engine-fake",
        input_uri=f"s3://{s3_settings.input_bucket}/{key}",
        engine=EngineConfig(backend=FAKE_BACKEND, batch_size=4, batches_in_flight=2),
        deadline=deadline,
    )


def test_a_deadline_gives_up_the_calls_at_the_engine_and_the_attempt_says_deadline(
    s3_settings: S3Settings, node_minio: Minio
) -> None:
    spec = _spec(s3_settings, node_minio, datetime.now(UTC) + timedelta(seconds=1))
    engine = HeldEngine()
    attempt = RunnerAttempt(spec, tokenizer=WhitespaceTokenizer, keep_text=True, engine=lambda: engine)
    code = attempt.run()
    assert code == ExitCode.RETRIABLE
    error = (attempt.result or {}).get("error") or {}
    # the deadline, not the calls it gave up, is why the attempt ended
    assert error.get("code") == "deadline_exceeded", attempt.result
    assert engine.stops and all(stop is not None for stop in engine.stops)
    # every call was given up (the pool's threads end on their own, after the attempt)
    deadline = time.monotonic() + 30
    while engine.given_up < len(engine.stops):
        assert time.monotonic() < deadline, (engine.given_up, len(engine.stops))
        time.sleep(0.01)
