"""Dispatcher settings: the shared connection settings plus the service's own knobs.

Environment: prefix ``LLMBATCH_``, ``__`` for nesting, e.g. ``LLMBATCH_DISPATCHER__MAX_IN_FLIGHT=8``,
``LLMBATCH_JOB__PIP='["vllm==0.32.0"]'``, ``LLMBATCH_JOB__ENGINE__ENFORCE_EAGER=true``. Credentials
stay ``SecretStr`` (they are handed to the Ray job only when ``job.pass_s3_credentials`` is set,
through its runtime environment, never logged).
"""

from __future__ import annotations

import os
import socket
from typing import Literal

from pydantic import BaseModel, Field, model_validator
from pydantic_settings import SettingsConfigDict

from dispatcher.retry import AttemptPolicy, Backoff
from llmbatch.settings import LLMBatchSettings
from schemas.batch import InlineLimits
from schemas.job import EngineConfig

CrashPoint = Literal["after_accept", "after_submit", "after_job_end", "after_publish", "after_dlt"]


def _default_instance() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class DispatcherOptions(BaseModel):
    """The service's behaviour (``LLMBATCH_DISPATCHER__*``)."""

    group_id: str = Field(
        default="llmbatch-dispatcher",
        min_length=1,
        description="Kafka consumer group shared by all replicas.",
    )
    instance_id: str = Field(
        default_factory=_default_instance, description="Names this replica (leases, logs)."
    )
    source: str = Field(
        default="urn:llmbatch:dispatcher",
        min_length=1,
        description="ce_source of the events the dispatcher publishes.",
    )
    max_in_flight: int = Field(
        default=4, ge=1, le=10_000, description="Most batches with a Ray job (submitted/running/finalizing)."
    )
    max_queued: int = Field(
        default=10_000, ge=1, description="Queued batches in Redis above which partitions are paused."
    )
    resume_ratio: float = Field(
        default=0.8, gt=0, le=1, description="Partitions resume when the queue drops below max_queued * this."
    )
    max_attempts: int = Field(default=3, ge=1, le=100, description="Ray job attempts per batch.")
    retry_backoff_base_s: float = Field(default=5.0, gt=0)
    retry_backoff_max_s: float = Field(default=300.0, gt=0)
    io_backoff_base_s: float = Field(default=0.2, gt=0, description="Retry delay of transient I/O errors.")
    io_backoff_max_s: float = Field(default=10.0, gt=0)
    lease_ttl_s: float = Field(default=15.0, ge=1, description="Tracker leadership lease.")
    poll_interval_s: float = Field(default=1.0, gt=0, description="Tracker tick (Ray polling, launching).")
    progress_interval_s: float = Field(default=10.0, gt=0, description="Least time between progress events.")
    heartbeat_timeout_s: float = Field(
        default=180.0, gt=0, description="A running job silent this long is lost."
    )
    submitted_timeout_s: float = Field(
        default=900.0, gt=0, description="A job PENDING this long is stopped and retried."
    )
    finished_ttl_s: int = Field(
        default=7 * 86400, ge=60, description="How long finished batches stay in Redis."
    )
    event_dedupe_ttl_s: int = Field(
        default=7 * 86400, ge=60, description="How long command event ids are remembered."
    )
    metrics_host: str = "0.0.0.0"  # noqa: S104 - a pod serves probes and metrics on all interfaces
    metrics_port: int | None = Field(default=9464, ge=0, le=65535, description="None disables; 0 = any free.")
    max_poll_records: int = Field(
        default=100, ge=1, le=100_000, description="Records per fetch: bounds memory and accept latency."
    )
    session_timeout_ms: int = Field(default=10_000, ge=1000)
    heartbeat_interval_ms: int = Field(default=3_000, ge=100)
    max_poll_interval_ms: int = Field(default=300_000, ge=1000)
    shutdown_timeout_s: float = Field(default=20.0, gt=0)
    inline_limits: InlineLimits = InlineLimits()
    log_level: str = "INFO"
    log_json: bool = True
    # test hook: the process SIGKILLs itself at these points (crash tests); never set in production
    crash_at: list[CrashPoint] = Field(default_factory=list)

    @model_validator(mode="after")
    def _coherent(self) -> DispatcherOptions:
        if self.retry_backoff_max_s < self.retry_backoff_base_s:
            raise ValueError("retry_backoff_max_s must be >= retry_backoff_base_s")
        if self.io_backoff_max_s < self.io_backoff_base_s:
            raise ValueError("io_backoff_max_s must be >= io_backoff_base_s")
        if self.heartbeat_interval_ms * 3 > self.session_timeout_ms:
            raise ValueError("heartbeat_interval_ms must be at most a third of session_timeout_ms")
        return self

    @property
    def attempt_policy(self) -> AttemptPolicy:
        return AttemptPolicy(self.max_attempts, Backoff(self.retry_backoff_base_s, self.retry_backoff_max_s))

    @property
    def io_backoff(self) -> Backoff:
        return Backoff(self.io_backoff_base_s, self.io_backoff_max_s)


class JobOptions(BaseModel):
    """How Ray jobs are launched (``LLMBATCH_JOB__*``)."""

    entrypoint_num_cpus: float = Field(
        default=0.0, ge=0, description="0 keeps the driver off the CPU budget Ray Data needs."
    )
    entrypoint_num_gpus: float = Field(default=0.0, ge=0)
    entrypoint_memory: int = Field(default=0, ge=0, description="Bytes; 0 = unset.")
    entrypoint_resources: dict[str, float] = Field(default_factory=dict)
    python: str = Field(
        default="python",
        description="Interpreter of the entrypoint on the cluster "
        "(a local head started from a venv wants that venv's python).",
    )
    ship_modules: bool = Field(default=True, description="Ship ray_job + schemas as runtime_env py_modules.")
    pip: list[str] = Field(
        default_factory=list, description="runtime_env pip requirements for clusters whose image lacks them."
    )
    env_vars: dict[str, str] = Field(default_factory=dict, description="Extra env vars for the job.")
    pass_s3_credentials: bool = Field(
        default=True, description="Hand the S3 endpoint and keys to the job via env vars."
    )
    pass_redis_url: bool = Field(default=True, description="Let the job write progress counters to Redis.")
    model_path: str | None = Field(
        default=None, description="What the engine loads when a request names a model id."
    )
    model_paths: dict[str, str] = Field(default_factory=dict, description="model name -> path, per model.")
    engine: EngineConfig = EngineConfig()
    engine_cache_dir: str | None = Field(
        default=None,
        description="When set, vLLM's offline/cache/CPU env vars are passed to the job "
        "(ray_job.engine_env) with this cache folder on the workers.",
    )
    engine_cpu: bool = Field(default=True, description="CPU engine tuning (VLLM_CPU_* variables).")
    omp_threads_bind: str | None = Field(default=None, description="VLLM_CPU_OMP_THREADS_BIND, e.g. '0-1'.")
    kv_cache_gib: int = Field(default=1, ge=1, description="VLLM_CPU_KVCACHE_SPACE (GiB).")
    ray_stop_wait_s: int = Field(
        default=15, ge=1, le=600, description="Seconds Ray waits after SIGTERM before SIGKILL (flush time)."
    )
    progress_interval_s: float = Field(default=2.0, gt=0, le=3600)
    shard_max_lines: int = Field(default=10_000, ge=1, description="Lines per result shard at most.")
    shard_max_seconds: float = Field(
        default=60.0,
        gt=0,
        description="A shard is closed (durable) after "
        "this long: a stopped or crashed attempt loses at most this much work.",
    )
    stop_wait_s: float = Field(default=30.0, gt=0, description="How long to wait for a stopped job to end.")


class DispatcherSettings(LLMBatchSettings):
    """``DispatcherSettings()`` reads the environment (``LLMBATCH_`` prefix, ``__`` nesting)."""

    model_config = SettingsConfigDict(
        env_prefix="LLMBATCH_",
        env_nested_delimiter="__",
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
    )

    dispatcher: DispatcherOptions = DispatcherOptions()
    job: JobOptions = JobOptions()

    def redacted(self) -> dict[str, object]:
        """The settings as a dict safe to log (secrets masked by pydantic)."""
        return self.model_dump(mode="json")
