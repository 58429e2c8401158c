"""Dispatcher settings: the shared connection settings plus the service's own knobs.

Environment: prefix ``LLMBATCH_``, ``__`` for nesting, e.g. ``LLMBATCH_DISPATCHER__MAX_IN_FLIGHT=8``,
``LLMBATCH_JOB__PIP='["vllm==0.32.0"]'``. The models the service runs are one JSON object,
``LLMBATCH_ENGINES__MODELS='{"SmolLM2-135M-Instruct": {"path": "/models/smollm2", "engine":
{"enforce_eager": true}}}'`` (:class:`llmbatch.schemas.engines.EngineRegistry`): a request naming any other
model
is rejected (``model_not_found``), and a dispatcher without a model refuses to start. Credentials stay
``SecretStr``: never logged, and never handed to a Ray job or Serve replica (its ``runtime_env`` is
shown by the Ray dashboard and the Jobs API); the Ray workers take the S3 keys and the Redis password
from their own environment (a Kubernetes Secret, or the local stack's head).
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, Field, SecretStr, model_validator

from llmbatch.dispatcher.domain.retry import AttemptPolicy, Backoff
from llmbatch.dispatcher.job_options import JobOptions
from llmbatch.schemas.batch import InlineLimits
from llmbatch.schemas.engines import EngineRegistry
from llmbatch.settings import LLMBatchSettings


def _default_instance() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


OWN_ENGINE_IN_FLIGHT = 4  # each launched batch starts an engine
SHARED_IN_FLIGHT = 256  # launched batches only hold a driver; the engines' capacity admits them


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
    max_in_flight: int | None = Field(
        default=None,
        ge=1,
        le=10_000,
        description="Most batches launched at once (submitted/running/finalizing: a Ray job or a batch "
        f"runner run each). Unset: {OWN_ENGINE_IN_FLIGHT} with an engine per batch; {SHARED_IN_FLIGHT} with "
        "shared engines, where each model's replicas decide (admission by their capacity, the "
        "registry's admit_per_replica).",
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
    record_max_attempts: int = Field(
        default=3,
        ge=1,
        le=20,
        description="Attempts at processing one consumed record that fails for another reason than an "
        "outage (e.g. Redis out of memory, an unexpected error); then it is dead-lettered "
        "(processing_failed) and the consumer moves on. Outages (Redis or Kafka unreachable) are retried "
        "without limit and commit nothing.",
    )
    lease_ttl_s: float = Field(
        default=15.0,
        ge=1,
        description="Tracker leases (the launching leader's and each shard's): a dead replica's work moves "
        "to the others this long after it stopped renewing them.",
    )
    tracker_shards: int = Field(
        default=16,
        ge=1,
        le=1024,
        description="Shards of the batches in flight: the live replicas share them (each holds the leases "
        "of about shards / replicas of them, checks those batches' jobs, ends them and publishes their "
        "events), so more replicas track more batches. The same on every replica; changing it moves "
        "batches between replicas once (harmless: every state change is a compare-and-set).",
    )
    poll_interval_s: float = Field(default=1.0, gt=0, description="Tracker tick (Ray polling, launching).")
    progress_interval_s: float = Field(default=10.0, gt=0, description="Least time between progress events.")
    heartbeat_timeout_s: float = Field(
        default=180.0, gt=0, description="A running job silent this long is lost."
    )
    submitted_timeout_s: float = Field(
        default=900.0, gt=0, description="A job PENDING this long is stopped and retried."
    )
    job_delete_settle_s: float = Field(
        default=20.0,
        ge=0,
        le=3600,
        description="How long after a batch's terminal event its Ray jobs are deleted from the head (Ray "
        "writes back a job deleted before its supervisor exited; such a job is deleted again later).",
    )
    job_delete_recheck_s: float = Field(
        default=60.0,
        gt=0,
        le=86_400,
        description="How long after deleting a finished Ray job the head is asked for it again (deleted "
        "again if Ray wrote it back); also the wait before retrying a delete the head could not answer.",
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
    stall_timeout_s: float = Field(
        default=300.0,
        gt=0,
        le=86_400,
        description="/livez fails when the consumer or the tracker loop has not moved for this long (a "
        "hang; retrying through an outage counts as moving, so an outage does not restart the pod).",
    )
    stored_bytes_every_s: float = Field(
        default=3600.0,
        ge=0,
        le=7 * 86_400,
        description="How often the tracker leader lists the input and results buckets to export "
        "llmbatch_tenant_stored_bytes (every object's entry is read: set it long on buckets of many "
        "millions of objects); 0 = never.",
    )
    reconcile_interval_s: float = Field(
        default=600.0,
        ge=0,
        le=86_400,
        description="How often the tracker leader looks for accepted batches whose state Redis lost "
        "(and takes them in again from the requests topic), first when it becomes leader; 0 = never.",
    )
    reconcile_lookback_s: float = Field(
        default=86_400.0,
        gt=0,
        le=30 * 86_400,
        description="How far back the reconcile pass reads the results topic for accepted batches.",
    )
    inline_limits: InlineLimits = InlineLimits()
    request_in_redis_max_bytes: int = Field(
        default=16_384,
        ge=0,
        le=64 << 20,
        description="Request records up to this size are kept in Redis until the batch ends; larger ones "
        "(inline batches of many prompts) only by their coordinates, read back from the requests topic "
        "at launch, so Redis memory does not grow with prompt sizes. The requests topic's retention "
        "must then outlast the queue wait (a record gone by launch fails the batch: request_gone).",
    )
    log_level: str = "INFO"
    log_json: bool = True
    inputs_under_tenant_prefix: bool = Field(
        default=True,
        description="An input_uri must name an object under its request's tenant "
        "(s3://<bucket>/<tenant>/...; the producer and the HTTP API upload there), so a producer cannot "
        "point a batch at another tenant's input; other requests are rejected (invalid_field, input_uri).",
    )
    require_signed_events: bool = Field(
        default=False,
        description="Refuse to start unless LLMBATCH_TENANTS__KEYS and LLMBATCH_REPLAY__KEY are set, so "
        "no request, cancel or replay is taken on a producer's word (production: true). Off, a "
        "dispatcher without them warns at start and trusts the tenant and replay headers it reads.",
    )
    shared_engines: bool = Field(
        default=True,
        description="Run batches on each model's shared, warm engine (a Ray Serve application, "
        "llmbatch.ray_job.engines.serve_engine); false starts an engine in every batch's Ray job.",
    )
    deploy_engines: bool = Field(
        default=True,
        description="With shared_engines: deploy the registry's Serve applications on start (off when "
        "a KubeRay RayService owns the Serve config).",
    )
    engine_wait_s: float = Field(
        default=600.0,
        gt=0,
        le=86_400,
        description="With shared_engines: how long a batch waits for an engine (cold start included) "
        "before it fails with engine_unavailable.",
    )
    short_path_max_lines: int = Field(
        default=256,
        ge=0,
        le=100_000,
        description="With shared_engines: batches of at most this many inline lines run on the batch "
        "runner (llmbatch.ray_job.batch_runner.runner, warm, no Ray job each); 0 runs every batch as a "
        "Ray job.",
    )
    short_path_max_bytes: int = Field(
        default=1 << 20,
        ge=0,
        description="With shared_engines: input files up to this size run on the batch runner too.",
    )
    runner_s3_sessions: bool = Field(
        default=True,
        description="Give each batch on the batch runner temporary S3 keys of its own (STS AssumeRole "
        "with the dispatcher's keys and a policy that reaches the batch's input object and output prefix "
        "only); the runner then never uses its node's keys. false: the runner reads and writes with its "
        "node's keys (every tenant's files).",
    )
    runner_s3_session_s: int = Field(
        default=3600,
        ge=900,
        le=43_200,
        description="Lifetime of a runner batch's S3 session (seconds, 900-43200): keep it above the "
        "longest a runner batch takes (they are small: SHORT_PATH_MAX_LINES/BYTES); past it the batch's "
        "reads and writes are refused.",
    )
    runner_s3_role_arn: str | None = Field(
        default=None,
        max_length=2048,
        description="RoleArn of the AssumeRole calls (runner batches' and Ray jobs' S3 sessions), for S3 "
        "services that need one (AWS); MinIO needs none.",
    )
    short_path_max_runs: int = Field(
        default=64,
        ge=1,
        le=10_000,
        description="Batches the runner runs at once; more wait in queued (retried submit).",
    )
    short_path_replicas: int = Field(
        default=2,
        ge=1,
        le=1_000,
        description="Replicas of the batch runner. Its runs live in Redis, so any replica answers for any "
        "run and one lost replica loses only the batches it was running (retried).",
    )
    max_jobs_in_flight: int = Field(
        default=8,
        ge=1,
        le=10_000,
        description="With shared_engines: batches launched as Ray jobs at once (those the short path "
        "does not take). Each job's driver holds ~160 MB on the head while it waits for the cluster "
        "to reserve its stages; more wait in queued. Short-path batches do not count.",
    )

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
    def launch_limit(self) -> int:
        """``max_in_flight``, or its default for the engine mode."""
        if self.max_in_flight is not None:
            return self.max_in_flight
        return SHARED_IN_FLIGHT if self.shared_engines else OWN_ENGINE_IN_FLIGHT

    @property
    def attempt_policy(self) -> AttemptPolicy:
        return AttemptPolicy(self.max_attempts, Backoff(self.retry_backoff_base_s, self.retry_backoff_max_s))

    @property
    def io_backoff(self) -> Backoff:
        return Backoff(self.io_backoff_base_s, self.io_backoff_max_s)


# a variable named like a credential: its value must come from the Ray workers' environment
SECRET_ENV_NAME = re.compile(
    r"(^|_)(PASSWORD|PASSWD|SECRET|TOKEN|CREDENTIALS?)(_|$)|ACCESS_KEY|PRIVATE_KEY", re.IGNORECASE
)


def secret_values(model: BaseModel, path: str = "") -> Iterator[tuple[str, str]]:
    """``(where, value)`` of every non-empty ``SecretStr`` in ``model``, nested models included."""
    for name, value in model:
        where = f"{path}.{name}" if path else name
        if isinstance(value, SecretStr) and value.get_secret_value():
            yield where, value.get_secret_value()
        elif isinstance(value, BaseModel):
            yield from secret_values(value, where)


class DispatcherSettings(LLMBatchSettings):
    """``DispatcherSettings()`` reads the environment (``LLMBATCH_`` prefix, ``__`` nesting)."""

    dispatcher: DispatcherOptions = DispatcherOptions()
    job: JobOptions = JobOptions()
    engines: EngineRegistry = Field(
        default_factory=EngineRegistry,
        description="The models this service runs (LLMBATCH_ENGINES__MODELS as JSON); requests naming "
        "any other model are rejected with model_not_found.",
    )

    @model_validator(mode="after")
    def _no_secret_in_job_env(self) -> DispatcherSettings:
        # job.env_vars go into every job's and the batch runner's runtime_env, which the Ray dashboard
        # and Jobs API show to anyone who can open them
        secrets = list(secret_values(self))
        for key, value in self.job.env_vars.items():
            leaked = [
                where
                for where, secret in secrets
                if value == secret or (len(secret) >= 8 and secret in value)
            ]
            if leaked or SECRET_ENV_NAME.search(key):
                what = f"the value of {leaked[0]}" if leaked else "a credential's name"
                raise ValueError(
                    f"job.env_vars.{key} holds {what}: a job's runtime_env is shown by the Ray dashboard and "
                    f"Jobs API. Give the Ray workers {key} in their own environment (a Kubernetes Secret) "
                    "and remove it from LLMBATCH_JOB__ENV_VARS"
                )
        return self

    @model_validator(mode="after")
    def _heartbeats_fit_the_timeout(self) -> DispatcherSettings:
        # a job beats every job.progress_interval_s; fewer than 3 beats per timeout and one late
        # write (a slow Redis) gets a healthy job stopped as silent
        if self.job.progress_interval_s * 3 > self.dispatcher.heartbeat_timeout_s:
            interval, timeout = self.job.progress_interval_s, self.dispatcher.heartbeat_timeout_s
            raise ValueError(
                f"LLMBATCH_JOB__PROGRESS_INTERVAL_S ({interval:g}) must be at most a third of "
                f"LLMBATCH_DISPATCHER__HEARTBEAT_TIMEOUT_S ({timeout:g}): lower the interval or raise "
                "the timeout"
            )
        return self

    @property
    def served_models(self) -> frozenset[str]:
        """The model names requests may name (the registry's keys)."""
        return frozenset(self.engines.models)

    @property
    def pooling_models(self) -> frozenset[str]:
        """The served models that are embedding models (runner ``pooling``: ``/v1/embeddings`` only)."""
        models = self.engines.models
        return frozenset(name for name, entry in models.items() if entry.engine.runner == "pooling")

    def job_redis_url(self) -> str | None:
        """Where jobs and the batch runner reach Redis (no password: the Ray nodes have it), or None when
        they are given none (``LLMBATCH_JOB__PASS_REDIS_URL`` false)."""
        job = self.job
        if not job.pass_redis_url:
            return None
        if job.redis_url is None:
            return self.redis.url_without_password(job.redis_username)
        parts = urlsplit(job.redis_url)
        netloc = f"{job.redis_username}@{parts.netloc}" if job.redis_username else parts.netloc
        return urlunsplit(parts._replace(netloc=netloc))

    def serving_problem(self) -> str | None:
        """Why a dispatcher with these settings must not start (one line), or ``None``."""
        if not self.engines.models:
            return NO_MODEL_CONFIGURED
        if self.dispatcher.require_signed_events:
            missing = [
                name
                for name, unset in (
                    ("LLMBATCH_TENANTS__KEYS", not self.tenants.keys),
                    ("LLMBATCH_REPLAY__KEY", self.replay.key is None),
                )
                if unset
            ]
            if missing:
                return (
                    f"LLMBATCH_DISPATCHER__REQUIRE_SIGNED_EVENTS is on but {' and '.join(missing)} "
                    f"{'is' if len(missing) == 1 else 'are'} not set: give the dispatcher "
                    f"{'that key' if len(missing) == 1 else 'those keys'} (on Kubernetes the "
                    "llmbatch-tenants and llmbatch-credentials Secrets), or turn the requirement off"
                )
        return None

    def redacted(self) -> dict[str, object]:
        """The settings as a dict safe to log: secrets masked by pydantic, and a password written
        into any URL (``redis://:pw@host``) masked too."""
        masked = _mask_url_passwords(self.model_dump(mode="json"))
        assert isinstance(masked, dict)
        return masked


_URL_PASSWORD = re.compile(r"(?P<head>[a-z][a-z0-9+.-]*://[^/@:\s]*:)[^/@\s]+@", re.IGNORECASE)


def _mask_url_passwords(value: object) -> object:
    if isinstance(value, str):
        return _URL_PASSWORD.sub(r"\g<head>**********@", value)
    if isinstance(value, dict):
        return {k: _mask_url_passwords(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_mask_url_passwords(v) for v in value]
    return value


ENGINES_ENV = "LLMBATCH_ENGINES__MODELS"
ENGINES_EXAMPLE = '{"SmolLM2-135M-Instruct": {"path": "/models/SmolLM2-135M-Instruct"}}'
NO_MODEL_CONFIGURED = (
    f"no model is configured, so every request would be rejected: set {ENGINES_ENV} to a JSON object "
    f"of model name -> entry, e.g. {ENGINES_ENV}='{ENGINES_EXAMPLE}'"
)
