"""Dispatcher <-> Ray job contract: :class:`JobSpec` in, :class:`Manifest` out.

The dispatcher hands a :class:`JobSpec` to the job (as JSON); the job writes results under
``output_prefix`` (``s3://<results bucket>/<tenant>/<batch_id>/<lifecycle>/``) and, last, a :class:`Manifest`
at ``<output_prefix>manifest.json``. Only shards listed in the manifest are final: a crashed
attempt may leave stray files, which readers must ignore.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, computed_field, model_validator

from llmbatch.schemas.batch import DEFAULT_PRIORITY
from llmbatch.schemas.common import (
    BatchId,
    BatchStatus,
    Endpoint,
    ModelName,
    S3Prefix,
    S3Uri,
    Tenant,
    UtcDatetime,
    whole_match,
)
from llmbatch.schemas.errors import SchemaError
from llmbatch.schemas.lines import DEFAULT_MAX_LINE_BYTES
from llmbatch.schemas.openai import BatchInputLine, ErrorObject, RequestCounts, Usage

MANIFEST_NAME = "manifest.json"
SHARD_KINDS = ("output", "error")


LIFECYCLE_PATTERN = r"^[a-z0-9]{1,32}$"
"""A batch lifecycle's id (see :func:`output_prefix`)."""

POOL_RESOURCE_PREFIX = "llmbatch_tenant_"
POOL_RESOURCE_PATTERN = r"^llmbatch_tenant_[a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?$"
POOL_SHARE = 0.01
"""What a pooled tenant's driver asks of its pool's resource (and the least any of its tasks asks).

A node of a tenant's pool starts with ``--num-cpus=0 --resources='{"llmbatch_tenant_<tenant>": N}'``
(N: its CPUs): the tenant's tasks ask that resource where others ask CPUs, and no other work, which
asks CPUs, can land on the node and run with the tenant's keys."""


def tenant_pool_resource(tenant: str) -> str:
    """The Ray custom resource that marks the nodes of ``tenant``'s own worker pool."""
    return f"{POOL_RESOURCE_PREFIX}{tenant}"


def submission_id(batch_id: str, attempt: int, lifecycle: str | None = None) -> str:
    """The Ray submission id of an attempt: ``<batch_id>-<lifecycle>-a<attempt>``
    (``<batch_id>-a<attempt>`` for a batch accepted before lifecycles existed)."""
    return f"{batch_id}-{lifecycle}-a{attempt}" if lifecycle else f"{batch_id}-a{attempt}"


def output_prefix(bucket: str, tenant: str, batch_id: str, lifecycle: str | None = None) -> str:
    """``s3://<bucket>/<tenant>/<batch_id>/<lifecycle>/``: where one lifecycle of a batch keeps its
    results and manifest. A batch id accepted again after its record expired is a new lifecycle,
    so it never reads (or overwrites) the shards of the earlier one. Without ``lifecycle``:
    ``s3://<bucket>/<tenant>/<batch_id>/`` (the batch's folder, and the layout of batches accepted
    before lifecycles existed)."""
    base = f"s3://{bucket}/{tenant}/{batch_id}/"
    return f"{base}{lifecycle}/" if lifecycle else base


def shard_name(kind: Literal["output", "error"], index: int, attempt: int | None = None) -> str:
    """``output-00000.jsonl`` / ``error-00003.jsonl``; with ``attempt``: ``output-a2-00000.jsonl``.

    The Ray job always names shards per attempt, so a retried attempt never overwrites (or appends
    to) a shard an earlier attempt wrote.
    """
    if attempt is not None:
        return f"{kind}-a{attempt}-{index:05d}.jsonl"
    return f"{kind}-{index:05d}.jsonl"


VLLM_BACKEND = "vllm"
BACKEND_REF_PATTERN = r"^(?:vllm|[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*)$"
"""``vllm``, or ``package.module:Class``: the import path of a plug-in engine backend."""

EngineBackendRef = Annotated[
    str,
    whole_match(
        BACKEND_REF_PATTERN,
        "engine.backend: use 'vllm' or the import path 'package.module:Class' of an engine "
        "backend installed where the engines run",
    ),
    Field(
        max_length=200,
        json_schema_extra={"pattern": BACKEND_REF_PATTERN},
        description="The engine: 'vllm', or 'package.module:Class', a plug-in class installed on "
        "the Ray workers that is constructed with (model_path, this config) and drives requests "
        "as vLLM's does (see llmbatch.ray_job.engines.backends).",
    ),
]
BackendOption = str | int | float | bool | list[str]


Dtype = Literal["auto", "bfloat16", "float16", "float32"]
"""The dtypes an engine entry may name (``auto``: see ``llmbatch.ray_job.engines.cpu_dtype`` on CPUs)."""


class EngineConfig(BaseModel):
    """How the job runs the engine (vLLM): parallelism, resources and engine arguments."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    batch_size: int = Field(default=64, ge=1, le=65_536, description="Requests per Ray Data batch.")
    replicas: int = Field(default=1, ge=1, le=1024, description="Engine actors (data parallelism).")
    num_gpus_per_replica: float = Field(default=0.0, ge=0, le=64, description="0 on CPU.")
    num_cpus_per_replica: float = Field(default=1.0, gt=0, le=1024)
    tensor_parallel_size: int = Field(default=1, ge=1, le=64)
    max_model_len: int | None = Field(default=None, ge=16)
    dtype: Dtype = "auto"
    enforce_eager: bool = False
    max_num_seqs: int | None = Field(default=None, ge=1)
    max_num_batched_tokens: int | None = Field(
        default=None,
        ge=16,
        description="Tokens per engine step (vLLM's chunked-prefill budget). Smaller = shorter steps, "
        "so an urgent batch waits less for the engine; on CPU 512 costs no throughput (measured).",
    )
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Passed to the engine verbatim (e.g. gpu_memory_utilization)."
    )
    batches_in_flight: int = Field(
        default=4,
        ge=1,
        le=64,
        description="Batches each engine replica works on at once, so the engine never idles between "
        "batches.",
    )
    runner: Literal["generate", "pooling"] = Field(
        default="generate",
        description="'generate': a text-generation model (/v1/chat/completions, /v1/completions); "
        "'pooling': an embedding model (/v1/embeddings), vLLM's --runner pooling.",
    )
    backend: EngineBackendRef = "vllm"
    backend_options: dict[str, BackendOption] = Field(
        default_factory=dict,
        max_length=32,
        description="Passed to a plug-in backend (see backend); none for vllm.",
    )

    @model_validator(mode="after")
    def _options_need_a_plugin(self) -> EngineConfig:
        if self.backend == VLLM_BACKEND and self.backend_options:
            raise ValueError(
                "engine.backend_options: the vllm backend takes none; put vLLM's arguments in "
                "engine.engine_kwargs"
            )
        return self


class JobSpec(BaseModel):
    """Everything one Ray job attempt needs; exactly one of ``input_uri`` and ``requests``."""

    model_config = ConfigDict(extra="forbid")

    batch_id: BatchId
    attempt: int = Field(ge=1)
    endpoint: Endpoint
    model: ModelName
    model_path: str | None = Field(
        default=None, description="What the engine loads (local folder or HF id); defaults to model."
    )
    tenant: Tenant = "default"
    input_uri: S3Uri | None = None
    requests: Annotated[list[BatchInputLine], Field(min_length=1)] | None = None
    output_prefix: S3Prefix
    lifecycle: str | None = Field(
        default=None,
        pattern=LIFECYCLE_PATTERN,
        description="Which lifecycle of the batch id this is (in the output prefix and submission id).",
    )
    engine: EngineConfig = Field(default_factory=EngineConfig)
    pool_resource: str | None = Field(
        default=None,
        pattern=POOL_RESOURCE_PATTERN,
        description="The Ray resource of the tenant's own worker pool (``llmbatch_tenant_<tenant>``): "
        "the driver and every task and actor of the job ask for a share of it, so the job runs only "
        "on nodes whose environment holds that tenant's S3 keys (scoped to its prefixes).",
    )
    engine_app: str | None = Field(
        default=None,
        max_length=200,
        description="Ray Serve application of the model's shared, warm engine "
        "(ray_job.engines.serve_engine): when set the job starts no engine of its own.",
    )
    engine_wait_s: float = Field(
        default=600.0,
        gt=0,
        le=86_400,
        description="How long a call may wait for a shared engine (cold start included) before the "
        "attempt fails with engine_unavailable.",
    )
    redis_url: str | None = Field(default=None, description="Where to write progress counters, if set.")
    progress_key: str | None = Field(
        default=None, description="Redis hash the job writes progress to (chosen by the dispatcher)."
    )
    progress_interval_s: float = Field(default=5.0, gt=0, le=3600)
    shard_max_lines: int = Field(default=10_000, ge=1, description="Lines per output/error shard at most.")
    max_line_bytes: int = Field(
        default=DEFAULT_MAX_LINE_BYTES,
        ge=1024,
        le=1 << 30,
        description="Longest input line answered as a request; a longer one becomes a line_too_large "
        "error line (read in bounded memory, never parsed or tokenized).",
    )
    shard_max_bytes: int = Field(default=64 << 20, ge=1024, description="Bytes per shard at most (about).")
    shard_max_seconds: float = Field(
        default=300.0,
        gt=0,
        description="Close a shard after this long, so a crash loses at most this much work.",
    )
    deadline: UtcDatetime | None = None
    priority: int = Field(
        default=DEFAULT_PRIORITY,
        ge=0,
        le=9,
        description="The batch's priority (0-9, higher first): on a shared engine, requests of higher "
        "priority run first and batches of equal priority take turns.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        if (self.input_uri is None) == (self.requests is None):
            raise ValueError("set exactly one of input_uri or requests")
        tail = f"/{self.batch_id}/{self.lifecycle}/" if self.lifecycle else f"/{self.batch_id}/"
        if not self.output_prefix.endswith(tail):
            raise ValueError(
                f"output_prefix must end with '{tail}' (s3://bucket/<tenant>/<batch_id>/[<lifecycle>/])"
            )
        if self.pool_resource is not None and self.pool_resource != tenant_pool_resource(self.tenant):
            raise ValueError(
                f"pool_resource must be {tenant_pool_resource(self.tenant)!r}: a job runs "
                "on its own tenant's pool"
            )
        return self

    def stage_resources(self, num_cpus: float) -> dict[str, Any]:
        """Ray resources of a task or actor of this job that needs ``num_cpus`` CPUs. On a tenant's pool
        it asks the pool's resource instead (the pool's nodes advertise no CPU: see :data:`POOL_SHARE`),
        so it runs only there."""
        if self.pool_resource is None:
            return {"num_cpus": num_cpus}
        return {"num_cpus": 0, "resources": {self.pool_resource: max(num_cpus, POOL_SHARE)}}

    @property
    def submission_id(self) -> str:
        """``<batch_id>-<lifecycle>-a<attempt>`` (see :func:`submission_id`)."""
        return submission_id(self.batch_id, self.attempt, self.lifecycle)

    @property
    def engine_group(self) -> str:
        """What a shared engine shares fairly between: ``<tenant>/<batch_id>``."""
        return f"{self.tenant}/{self.batch_id}"

    @property
    def manifest_uri(self) -> str:
        """``<output_prefix>manifest.json``."""
        return self.output_prefix + MANIFEST_NAME


class S3Session(BaseModel):
    """Temporary S3 keys (an STS session) that reach one batch's input object and output prefix only:
    what the dispatcher hands the shared batch runner with each batch (see
    ``llmbatch.dispatcher.backends.s3_sessions``).
    Never logged, never in a spec, an event or a job's ``runtime_env``."""

    model_config = ConfigDict(extra="forbid")

    access_key: SecretStr = Field(min_length=1)
    secret_key: SecretStr = Field(min_length=1)
    session_token: SecretStr = Field(min_length=1)
    expires_at: UtcDatetime | None = None

    def plain(self) -> dict[str, str | None]:
        """The keys in clear, for the one request body that carries them to the runner."""
        return {
            "access_key": self.access_key.get_secret_value(),
            "secret_key": self.secret_key.get_secret_value(),
            "session_token": self.session_token.get_secret_value(),
            "expires_at": self.expires_at.isoformat() if self.expires_at else None,
        }


class RunnerSubmission(BaseModel):
    """What the dispatcher POSTs to the batch runner: the spec, and the batch's own S3 session when
    the dispatcher mints one (``LLMBATCH_DISPATCHER__RUNNER_S3_SESSIONS``)."""

    model_config = ConfigDict(extra="forbid")

    spec: JobSpec
    s3_session: S3Session | None = None


class ShardInfo(BaseModel):
    """One result file listed by a manifest."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    uri: S3Uri
    lines: int = Field(ge=0)
    size_bytes: int | None = Field(default=None, ge=0)
    attempt: int = Field(default=1, ge=1, description="Attempt that wrote it.")


class AttemptRecord(BaseModel):
    """What one attempt did (the manifest keeps the history)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    attempt: int = Field(ge=1)
    submission_id: str
    status: BatchStatus | Literal["partial"]
    started_at: UtcDatetime | None = None
    finished_at: UtcDatetime | None = None
    completed: int = Field(default=0, ge=0)
    failed: int = Field(default=0, ge=0)
    error: ErrorObject | None = None


class Timings(BaseModel):
    """Wall-clock timings of the attempt that wrote the manifest."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    started_at: UtcDatetime
    finished_at: UtcDatetime
    engine_start_s: float | None = Field(default=None, ge=0)
    generation_s: float | None = Field(default=None, ge=0)


class Manifest(BaseModel):
    """``<output_prefix>manifest.json``: the authoritative list of final shards and the totals."""

    model_config = ConfigDict(extra="ignore")

    schema_version: Literal[1] = 1
    batch_id: BatchId
    attempt: int = Field(ge=1, description="The attempt that wrote this manifest.")
    status: Literal[
        BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.CANCELLED, BatchStatus.EXPIRED, "partial"
    ] = Field(
        description="'completed' = every request ended; 'partial' = the job stopped early (results kept)."
    )
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    usage: Usage = Field(default_factory=Usage)
    output_shards: list[ShardInfo] = Field(default_factory=list)
    error_shards: list[ShardInfo] = Field(default_factory=list)
    attempts: list[AttemptRecord] = Field(default_factory=list)
    timings: Timings
    error: ErrorObject | None = None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def output_uris(self) -> list[str]:
        """URIs of the final output shards, in order."""
        return [shard.uri for shard in self.output_shards]

    @computed_field  # type: ignore[prop-decorator]
    @property
    def error_uris(self) -> list[str]:
        """URIs of the final error shards, in order."""
        return [shard.uri for shard in self.error_shards]

    @property
    def started_at(self) -> datetime:
        """Start of the attempt that wrote the manifest."""
        return self.timings.started_at

    @property
    def finished_at(self) -> datetime:
        """End of the attempt that wrote the manifest."""
        return self.timings.finished_at

    def to_json(self) -> bytes:
        """The manifest as JSON bytes (what the job writes)."""
        return self.model_dump_json(indent=2).encode()


def parse_manifest(raw: bytes | str) -> Manifest:
    """Parse ``manifest.json``; raises :class:`SchemaError`."""
    try:
        return Manifest.model_validate_json(raw)
    except ValidationError as exc:
        raise SchemaError.from_validation_error(exc) from None


def parse_job_spec(raw: bytes | str) -> JobSpec:
    """Parse a JSON :class:`JobSpec`; raises :class:`SchemaError`."""
    try:
        return JobSpec.model_validate_json(raw)
    except ValidationError as exc:
        raise SchemaError.from_validation_error(exc) from None
