"""Shared helpers for the ray_job integration tests: submit the job through the Ray Jobs API
exactly as the dispatcher does (``llmbatch.ray_job.job.submit``), against the real MinIO, Redis and Ray
head."""

from __future__ import annotations

import asyncio
import io
import os
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson
from minio import Minio
from ray.job_submission import JobStatus, JobSubmissionClient

from llmbatch.dispatcher.backends.ray_http import auth_headers
from llmbatch.dispatcher.backends.s3_sessions import JobSessions, SessionMinter
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.ray_job.engines.engine_env import engine_env
from llmbatch.ray_job.job.submit import SessionRef, parse_result, runtime_env, submit_kwargs
from llmbatch.ray_job.storage import node_secrets
from llmbatch.schemas.job import EngineConfig, JobSpec, Manifest, parse_manifest
from llmbatch.settings import RaySettings, RedisSettings, S3Settings
from llmbatch.stack.state import CACHE_DIR

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"


def chat_line(custom_id: str, content: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": CHAT,
        "body": {"messages": [{"role": "user", "content": content}], **body},
    }


def completion_line(custom_id: str, prompt: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": CMPL, "body": {"prompt": prompt, **body}}


def to_jsonl(lines: list[dict[str, Any] | bytes]) -> bytes:
    return b"".join((item if isinstance(item, bytes) else orjson.dumps(item)) + b"\n" for item in lines)


def engine_vars() -> dict[str, str]:
    """The engine environment (vLLM caches, offline, ``VLLM_CPU_KVCACHE_SPACE``...) the harness's jobs
    get; also what a test's shared engine replicas get (``serve_config(registry, engine_vars())``)."""
    return engine_env(
        CACHE_DIR / "engine-cache",
        omp_threads_bind=os.environ.get("LLMBATCH_OMP_THREADS_BIND") or None,
    )


@dataclass
class Harness:
    s3: S3Settings
    ray: RaySettings
    redis: RedisSettings
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])

    def __post_init__(self) -> None:
        self.minio = Minio(
            self.s3.host,
            access_key=self.s3.access_key.get_secret_value(),
            secret_key=self.s3.secret_key.get_secret_value(),
            secure=self.s3.secure,
            region=self.s3.region,
        )
        self.input_bucket = f"rj-in-{self.tag}"
        self.results_bucket = f"rj-out-{self.tag}"
        for bucket in (self.input_bucket, self.results_bucket):
            if not self.minio.bucket_exists(bucket):
                self.minio.make_bucket(bucket)
        self.client = JobSubmissionClient(self.ray.address)
        self.env = runtime_env(
            s3_endpoint=self.s3.endpoint,
            engine_env=engine_vars(),
        )

    # --- objects ------------------------------------------------------------------------------

    def put_input(self, name: str, lines: list[dict[str, Any] | bytes]) -> str:
        data = to_jsonl(lines)
        self.minio.put_object(self.input_bucket, name, io.BytesIO(data), len(data))
        return f"s3://{self.input_bucket}/{name}"

    def read(self, uri: str) -> bytes:
        bucket, _, key = uri.removeprefix("s3://").partition("/")
        resp = self.minio.get_object(bucket, key)
        try:
            return bytes(resp.read())
        finally:
            resp.close()
            resp.release_conn()

    def manifest(self, spec: JobSpec) -> Manifest:
        return parse_manifest(self.read(spec.manifest_uri))

    def lines(self, uris: list[str]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for uri in uris:
            out.extend(orjson.loads(raw) for raw in self.read(uri).splitlines() if raw.strip())
        return out

    def objects(self, spec: JobSpec) -> list[str]:
        prefix = spec.output_prefix.removeprefix(f"s3://{self.results_bucket}/")
        return sorted(
            o.object_name or "" for o in self.minio.list_objects(self.results_bucket, prefix=prefix)
        )

    # --- jobs ---------------------------------------------------------------------------------

    def spec(
        self, name: str, *, attempt: int = 1, endpoint: str = CHAT, engine: EngineConfig, **kw: Any
    ) -> JobSpec:
        """A spec for batch ``<name>-<tag>`` (unique per test session: the Ray head keeps job ids)."""
        batch_id = f"{name}-{self.tag}"
        data: dict[str, Any] = {
            "batch_id": batch_id,
            "attempt": attempt,
            "endpoint": endpoint,
            "model": "SmolLM2-135M-Instruct",
            "output_prefix": f"s3://{self.results_bucket}/default/{batch_id}/",
            "engine": engine,
        }
        data.update(kw)
        return JobSpec.model_validate(data)

    def submit(self, spec: JobSpec, session: SessionRef | None = None) -> str:
        """Submit ``spec``; with ``session``, as the dispatcher does for an attempt with S3 keys of its
        own (named on the command line, the node's S3 keys blanked in the job's environment)."""
        env = self.env
        if session is not None:
            blanks = node_secrets.withheld(node_secrets.job_withheld(spec))
            env = {**env, "env_vars": {**env["env_vars"], **blanks}}
        self.client.submit_job(**submit_kwargs(spec, env, python=sys.executable, session=session))
        return spec.submission_id

    def issue_session(self, spec: JobSpec) -> SessionRef:
        """``spec``'s S3 session, minted by the real MinIO's STS and kept in the real Redis by the
        dispatcher's own code (:class:`llmbatch.dispatcher.backends.s3_sessions.JobSessions`)."""

        async def issue() -> SessionRef:
            store = StateStore.from_url(self.redis.url, password=self.redis.effective_password())
            try:
                return await JobSessions(SessionMinter(self.s3, duration_s=900), store).issue(spec)
            finally:
                await store.close()

        return asyncio.run(issue())

    def wait(self, submission_id: str, timeout: float = 600) -> JobStatus:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.client.get_job_status(submission_id)
            if status.is_terminal():
                return status
            time.sleep(0.5)
        self.client.stop_job(submission_id)
        raise AssertionError(
            f"{submission_id} not finished after {timeout}s:\n{self.logs_tail(submission_id)}"
        )

    def logs_tail(self, submission_id: str, chars: int = 6000) -> str:
        return self.client.get_job_logs(submission_id)[-chars:]

    def run(self, spec: JobSpec, timeout: float = 600) -> tuple[JobStatus, dict[str, Any]]:
        """Submit, wait, return the final status and the LLMBATCH_RESULT object."""
        sid = self.submit(spec)
        status = self.wait(sid, timeout)
        result = parse_result(self.client.get_job_logs(sid))
        assert result is not None, f"no result line from {sid} ({status}):\n{self.logs_tail(sid)}"
        return status, result

    def exit_code(self, submission_id: str) -> int | None:
        return self.client.get_job_info(submission_id).driver_exit_code

    def state(self, kind: str) -> list[dict[str, Any]]:
        """Ray's state API (the dashboard's ``/api/v0/<kind>``): every actor or placement group."""
        req = urllib.request.Request(
            f"{self.ray.address}/api/v0/{kind}?detail=1&limit=10000",
            headers=auth_headers(self.ray.auth_token),
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            rows: list[dict[str, Any]] = orjson.loads(resp.read())["data"]["result"]["result"]
        return rows
