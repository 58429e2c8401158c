"""A job backend for measuring the dispatcher alone: every attempt runs at once, in the dispatcher's own
process, as the batch runner runs it (:class:`~llmbatch.ray_job.batch_runner.runner_attempt.RunnerAttempt`:
the batch's inline lines or input file, its shards, manifest and progress on the real S3 and Redis) on the
fake engine, with no Ray, no Serve and no HTTP in between. What is left is the dispatcher's own work per
batch (intake, launch, polling, finish, publish) and one small job's S3 writes.

The CPU seconds the attempts themselves spent (their threads' own time) are counted in
:attr:`InstantBackend.attempt_cpu_s`, so a bench can take them out of the process's CPU time.

With several dispatcher processes (``shared``: a folder they all see), the replica that launches an
attempt is often not the one that tracks its batch: a submit then only leaves the spec in the folder,
and the attempt runs in the process that first asks for its status (the batch's tracker, claiming it
with an exclusive create), which leaves the attempt's end there for any other to read. So the attempts'
work is spread as the batch runner's replicas would spread it, not piled on the launching leader.
Not for production: the test seam of ``bench/bench_dispatcher_load.py``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from llmbatch.dispatcher.backends.backend import JobInfo, JobState, SubmitResult
from llmbatch.ray_job.batch_runner.runner_attempt import RunnerAttempt
from llmbatch.ray_job.engines.backend_fake import WhitespaceTokenizer
from llmbatch.ray_job.job.engine import Engine, LocalEngine
from llmbatch.ray_job.lines.records import Generation, GenRequest
from llmbatch.ray_job.storage import job_redis
from llmbatch.schemas.batch import DEFAULT_PRIORITY
from llmbatch.schemas.job import EngineConfig, JobSpec


class _SharedEngine:
    """One fake engine for every attempt: each call's keys (its input line numbers, which repeat across
    batches) made unique on the engine and given back in the answers, as an engine replica does."""

    def __init__(self, engine: LocalEngine) -> None:
        self._engine = engine
        self.max_model_len = engine.max_model_len
        self.default_max_tokens = engine.default_max_tokens
        self.engine_start_s = 0.0
        self.ready_at = engine.ready_at
        self._calls = itertools.count()

    def generate(
        self,
        requests: list[GenRequest],
        *,
        group: str = "",
        priority: int = DEFAULT_PRIORITY,
        due: float | None = None,
        stop: threading.Event | None = None,
    ) -> list[Generation]:
        call = next(self._calls)
        on_engine = [replace(r, key=f"{call}:{r.key}") for r in requests]
        out = self._engine.generate(on_engine, group=group, priority=priority, due=due, stop=stop)
        return [replace(g, key=r.key) for g, r in zip(out, requests, strict=True)]


@dataclass
class _Run:
    attempt: RunnerAttempt
    state: JobState = JobState.PENDING
    exit_code: int | None = None
    start_time: float = field(default_factory=time.time)
    end_time: float | None = None


class InstantBackend:
    """:class:`~llmbatch.dispatcher.backends.backend.JobBackend` running attempts in ``workers`` threads of
    this process on one fake engine."""

    def __init__(self, workers: int = 8, shared: Path | None = None) -> None:
        self.shared = shared
        if shared is not None:
            shared.mkdir(parents=True, exist_ok=True)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="instant-attempt")
        self._runs: dict[str, _Run] = {}
        self._lock = threading.Lock()
        self._engine: Engine | None = None
        self._redis: Any = None
        self.attempt_cpu_s = 0.0
        self.attempts = 0

    def _engine_for(self, spec: JobSpec) -> Engine:
        with self._lock:
            if self._engine is None:
                config = EngineConfig.model_validate(spec.engine.model_dump())
                self._engine = _SharedEngine(LocalEngine("fake", config))
            return self._engine

    def _run(self, run: _Run) -> None:
        began = time.thread_time()
        run.state = JobState.RUNNING
        try:
            code = run.attempt.run()
        except Exception:
            code = 1
        run.exit_code = code
        run.end_time = time.time()
        run.state = JobState.SUCCEEDED if code == 0 else JobState.FAILED
        sid = run.attempt.spec.submission_id
        if self.shared is not None:  # for the process that tracks the batch, if it is another
            end = {"state": run.state.value, "exit_code": code, "start": run.start_time, "end": run.end_time}
            tmp = self.shared / f"{sid}.end.tmp{os.getpid()}"
            tmp.write_text(json.dumps(end))
            tmp.replace(self.shared / f"{sid}.end")
        with self._lock:
            self.attempt_cpu_s += time.thread_time() - began
            self.attempts += 1

    async def submit(self, spec: JobSpec) -> SubmitResult:
        if self.shared is not None:  # the batch's tracker runs it (see the module's docstring)
            path = self.shared / f"{spec.submission_id}.spec"
            try:
                with path.open("x") as out:
                    out.write(spec.model_dump_json())
            except FileExistsError:
                return SubmitResult(spec.submission_id, True, via="batch_runner")
            return SubmitResult(spec.submission_id, False, via="batch_runner")
        return self._start(spec)

    def _start(self, spec: JobSpec) -> SubmitResult:
        with self._lock:
            if spec.submission_id in self._runs:
                return SubmitResult(spec.submission_id, True, via="batch_runner")
            if spec.redis_url and self._redis is None:  # the runner's one client for every batch
                self._redis = job_redis.connect(spec.redis_url, timeout_s=5)
            attempt = RunnerAttempt(
                spec,
                tokenizer=WhitespaceTokenizer,
                keep_text=True,
                engine=lambda: self._engine_for(spec),
                redis=self._redis,
            )
            run = self._runs[spec.submission_id] = _Run(attempt)
        self._pool.submit(self._run, run)
        return SubmitResult(spec.submission_id, False, via="batch_runner")

    async def status(self, submission_id: str) -> JobInfo:
        run = self._runs.get(submission_id)
        if run is None and self.shared is not None:
            return self._shared_status(submission_id)
        if run is None:
            return JobInfo(JobState.NOT_FOUND)
        return JobInfo(run.state, exit_code=run.exit_code, start_time=run.start_time, end_time=run.end_time)

    def _shared_status(self, sid: str) -> JobInfo:
        assert self.shared is not None
        with contextlib.suppress(FileNotFoundError):
            end = json.loads((self.shared / f"{sid}.end").read_text())
            return JobInfo(
                JobState(end["state"]),
                exit_code=end["exit_code"],
                start_time=end["start"],
                end_time=end["end"],
            )
        try:
            spec = JobSpec.model_validate_json((self.shared / f"{sid}.spec").read_text())
        except FileNotFoundError:
            return JobInfo(JobState.NOT_FOUND)
        try:
            (self.shared / f"{sid}.claim").open("x").close()
        except FileExistsError:  # another process runs it
            return JobInfo(JobState.RUNNING)
        self._start(spec)
        return JobInfo(JobState.PENDING)

    async def stop(self, submission_id: str) -> bool:
        run = self._runs.get(submission_id)
        if run is None or run.state.is_terminal:
            return False
        run.attempt.request_stop("stopped")
        return True

    async def delete(self, submission_id: str) -> bool:
        if self.shared is not None:
            for suffix in ("spec", "claim", "end"):
                (self.shared / f"{submission_id}.{suffix}").unlink(missing_ok=True)
        with self._lock:
            return self._runs.pop(submission_id, None) is not None

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
