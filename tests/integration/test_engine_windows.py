"""A batch alone fills the shared engine (issue 53 item 1): on the batch runner, each of its
``batches_in_flight`` calls carries enough lines for all of them together to cover twice the request
slots the engine reports (running, and waiting their turn), whatever the model's ``batch_size``; a small
batch keeps small calls. Real MinIO, the runner's attempt in this process on the fake engine plug-in
behind an engine that reports slots."""

from __future__ import annotations

import io
import json
import threading
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from minio import Minio

from llmbatch.ray_job.batch_runner.runner_attempt import RunnerAttempt
from llmbatch.ray_job.engines.backend_fake import WhitespaceTokenizer
from llmbatch.ray_job.engines.backends import FAKE_BACKEND
from llmbatch.ray_job.job.engine import LocalEngine
from llmbatch.ray_job.lines.records import Generation, GenRequest
from llmbatch.schemas.batch import DEFAULT_PRIORITY
from llmbatch.schemas.job import EngineConfig, JobSpec, output_prefix
from llmbatch.schemas.openai import BatchInputLine
from llmbatch.settings import S3Settings

pytestmark = pytest.mark.integration

SLOTS = 128  # what the shared engine says its live replicas run at once
CONFIG = EngineConfig(backend=FAKE_BACKEND, batch_size=2, batches_in_flight=4)


class SlottedEngine:
    """A shared engine as the runner sees one (:class:`~llmbatch.ray_job.job.engine.SharedEngine`): the
    fake engine, the slots it reports, and the size of every call it got."""

    def __init__(self, slots: int) -> None:
        self._inner = LocalEngine("fake", CONFIG)
        self.max_model_len = self._inner.max_model_len
        self.default_max_tokens = self._inner.default_max_tokens
        self.engine_start_s = 0.0
        self.ready_at = self._inner.ready_at
        self._slots = slots
        self._lock = threading.Lock()
        self.calls: list[int] = []

    def slots(self) -> int:
        return self._slots

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
            self.calls.append(len(requests))
        return self._inner.generate(requests, group=group, priority=priority, due=due, stop=stop)


def _line(i: int) -> dict[str, object]:
    return {
        "custom_id": f"r{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": f"say {i}"}], "max_tokens": 4},
    }


def _run(s3_settings: S3Settings, node_minio: Minio, spec: JobSpec) -> SlottedEngine:
    engine = SlottedEngine(SLOTS)
    attempt = RunnerAttempt(spec, tokenizer=WhitespaceTokenizer, keep_text=True, engine=lambda: engine)
    assert attempt.run() == 0
    return engine


def _spec(s3_settings: S3Settings, batch_id: str, **fields: object) -> JobSpec:
    fields.setdefault("engine", CONFIG)
    return JobSpec(
        batch_id=batch_id,
        attempt=1,
        endpoint="/v1/chat/completions",
        model="m",
        tenant="acme",
        output_prefix=output_prefix(s3_settings.results_bucket, "acme", batch_id),
        engine_app="llmbatch-engine-fake",
        **fields,
    )


def test_a_lone_file_batch_fills_the_slots_the_engine_reports(
    s3_settings: S3Settings, node_minio: Minio
) -> None:
    batch_id = f"w-{uuid.uuid4().hex[:8]}"
    data = b"".join(json.dumps(_line(i)).encode() + b"\n" for i in range(300))
    key = f"acme/{batch_id}/in.jsonl"
    node_minio.put_object(s3_settings.input_bucket, key, io.BytesIO(data), len(data))
    spec = _spec(s3_settings, batch_id, input_uri=f"s3://{s3_settings.input_bucket}/{key}")
    engine = _run(s3_settings, node_minio, spec)
    assert sum(engine.calls) == 300
    # 4 calls of 64 lines at the engine at once: its 128 slots running and as many waiting their turn
    # (batch_size 2 would send 2 a call)
    assert engine.calls[:-1] == [64] * (len(engine.calls) - 1), engine.calls
    assert engine.calls[-1] == 300 % 64


def test_a_small_batch_keeps_calls_of_its_batch_size(s3_settings: S3Settings, node_minio: Minio) -> None:
    batch_id = f"w-{uuid.uuid4().hex[:8]}"
    lines = [BatchInputLine.model_validate(_line(i)) for i in range(6)]
    engine = _run(s3_settings, node_minio, _spec(s3_settings, batch_id, requests=lines))
    # 6 lines over 4 calls: batch_size (2) is the least a call carries
    assert engine.calls == [2, 2, 2], engine.calls


class SlowEngine(SlottedEngine):
    """The slotted engine, each call taking ``call_s`` longer; it keeps the ``due`` each call carried and
    stops the attempt after ``stop_after`` calls (if given)."""

    def __init__(self, slots: int, call_s: float, stop_after: int | None = None) -> None:
        super().__init__(slots)
        self.call_s = call_s
        self.stop_after = stop_after
        self.attempt: RunnerAttempt | None = None
        self.dues: list[float | None] = []

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
            self.dues.append(due)
            if self.attempt is not None and self.stop_after is not None and len(self.dues) >= self.stop_after:
                self.attempt.request_stop("stopped")
        threading.Event().wait(self.call_s)  # the engine's work (a sleep: nothing is asserted on time)
        return super().generate(requests, group=group, priority=priority, due=due)


def _run_slow(spec: JobSpec, stop_after: int | None = None) -> SlowEngine:
    engine = SlowEngine(0, call_s=0.3, stop_after=stop_after)
    attempt = RunnerAttempt(spec, tokenizer=WhitespaceTokenizer, keep_text=True, engine=lambda: engine)
    engine.attempt = attempt
    attempt.run()
    return engine


def _slow_spec(
    s3_settings: S3Settings, node_minio: Minio, lines: int, left_s: float
) -> tuple[JobSpec, float]:
    batch_id = f"d-{uuid.uuid4().hex[:8]}"
    data = b"".join(json.dumps(_line(i)).encode() + b"\n" for i in range(lines))
    key = f"acme/{batch_id}/in.jsonl"
    node_minio.put_object(s3_settings.input_bucket, key, io.BytesIO(data), len(data))
    deadline = datetime.now(UTC) + timedelta(seconds=left_s)
    config = EngineConfig(backend=FAKE_BACKEND, batch_size=4, batches_in_flight=1)
    uri = f"s3://{s3_settings.input_bucket}/{key}"
    return _spec(s3_settings, batch_id, input_uri=uri, engine=config, deadline=deadline), deadline.timestamp()


def test_a_batch_near_its_deadline_says_so_with_every_call(
    s3_settings: S3Settings, node_minio: Minio
) -> None:
    """2.5 s before its deadline (under URGENT_S): from its first call, before any answer."""
    spec, deadline = _slow_spec(s3_settings, node_minio, 60, 2.5)
    engine = _run_slow(spec)
    assert engine.dues and engine.dues == [deadline] * len(engine.dues), engine.dues


def test_a_batch_far_from_its_deadline_says_so_once_its_rate_says_it_misses_it(
    s3_settings: S3Settings, node_minio: Minio
) -> None:
    """4 lines a call, 0.3 s a call: 12,000 lines need about 900 s, 700 s are left: its calls after the
    first answer carry its deadline (the attempt is stopped after 4 calls); with an hour, 60 lines: none."""
    spec, deadline = _slow_spec(s3_settings, node_minio, 12_000, 700.0)
    engine = _run_slow(spec, stop_after=4)
    assert engine.dues[0] is None  # nothing answered yet: nothing to judge by
    assert engine.dues[1:] == [deadline] * (len(engine.dues) - 1) and len(engine.dues) >= 3, engine.dues
    spec, _ = _slow_spec(s3_settings, node_minio, 60, 3600.0)
    engine = _run_slow(spec)
    assert engine.dues == [None] * len(engine.dues), engine.dues
