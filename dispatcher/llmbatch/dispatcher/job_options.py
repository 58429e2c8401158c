"""How the dispatcher launches Ray jobs (``LLMBATCH_JOB__*``): the entrypoint's resources and
environment, how jobs reach S3 and Redis (never with the dispatcher's keys in their ``runtime_env``),
shard and line limits. Part of :class:`llmbatch.dispatcher.settings.DispatcherSettings` (``job``)."""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator, model_validator

from llmbatch.schemas.lines import DEFAULT_MAX_LINE_BYTES


class JobOptions(BaseModel):
    """How Ray jobs are launched (``LLMBATCH_JOB__*``)."""

    @model_validator(mode="after")
    def _sessions_need_redis(self) -> JobOptions:
        if self.s3_sessions and not self.pass_redis_url:
            raise ValueError(
                "job S3 sessions reach the job's driver through Redis: set LLMBATCH_JOB__PASS_REDIS_URL=true "
                "or LLMBATCH_JOB__S3_SESSIONS=false (jobs then use their node's S3 keys)"
            )
        return self

    @field_validator("pass_s3_credentials")
    @classmethod
    def _no_keys_in_runtime_env(cls, value: bool) -> bool:
        if value:
            raise ValueError(
                "S3 keys are no longer sent to Ray jobs (the Ray dashboard and Jobs API show a job's "
                "runtime_env): remove LLMBATCH_JOB__PASS_S3_CREDENTIALS and give the Ray workers "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in their environment (the local stack's head "
                "has them; on Kubernetes a Secret)"
            )
        return value

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
    ship_modules: bool = Field(
        default=True, description="Ship llmbatch.ray_job + llmbatch.schemas as runtime_env py_modules."
    )
    pip: list[str] = Field(
        default_factory=list, description="runtime_env pip requirements for clusters whose image lacks them."
    )
    env_vars: dict[str, str] = Field(default_factory=dict, description="Extra env vars for the job.")
    pass_s3_credentials: bool = Field(
        default=False,
        description="Must stay false (kept so settings that say false still load): S3 keys never travel "
        "in a job's runtime_env, which the Ray dashboard and Jobs API show. The Ray workers take "
        "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY from their own environment.",
    )
    pass_redis_url: bool = Field(default=True, description="Let the job write progress counters to Redis.")
    s3_sessions: bool = Field(
        default=True,
        description="Give each Ray job attempt temporary S3 keys of its own (STS AssumeRole with the "
        "dispatcher's keys and a policy that reaches the batch's input object and output prefix only), "
        "taken once from Redis by its driver; the job's processes start with the node's S3 keys blanked. "
        "Needs PASS_REDIS_URL. false: jobs read and write with their node's keys (every tenant's files).",
    )
    s3_session_s: int = Field(
        default=43_200,
        ge=900,
        le=43_200,
        description="Lifetime of a Ray job attempt's S3 session (seconds, 900-43200), counted from its "
        "submission: an attempt still running past it has its reads and writes refused and fails "
        "(retriable; the next attempt resumes with a new session).",
    )
    redis_url: str | None = Field(
        default=None,
        pattern=r"^rediss?://[^\s:@/]+(:[0-9]{1,5})?(/[0-9]{1,2})?$",
        max_length=512,
        description="Where the Ray side (jobs, the batch runner) reaches Redis, when the Ray nodes reach it "
        "by another address than the dispatcher (e.g. a dispatcher outside the cluster): "
        "redis[s]://host[:port][/db], no user and no password (redis_username and the nodes' "
        "LLMBATCH_REDIS__PASSWORD give those). Unset: LLMBATCH_REDIS__URL's host.",
    )
    redis_username: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9._-]{1,64}$",
        description="The Redis ACL user the jobs connect as (allowed only the progress hashes and taking "
        "their S3 sessions: "
        "`llmbatch dispatcher redis-acl`); its password is LLMBATCH_REDIS__PASSWORD of the Ray nodes. "
        "Unset: the user of LLMBATCH_REDIS__URL.",
    )
    engine_cache_dir: str | None = Field(
        default=None,
        description="When set, vLLM's offline/cache/CPU env vars are passed to the job "
        "(llmbatch.ray_job.engines.engine_env) with this cache folder on the workers.",
    )
    engine_cpu: bool = Field(default=True, description="CPU engine tuning (VLLM_CPU_* variables).")
    omp_threads_bind: str | None = Field(default=None, description="VLLM_CPU_OMP_THREADS_BIND, e.g. '0-1'.")
    kv_cache_gib: int = Field(default=1, ge=1, description="VLLM_CPU_KVCACHE_SPACE (GiB).")
    ray_stop_wait_s: int = Field(
        default=15, ge=1, le=600, description="Seconds Ray waits after SIGTERM before SIGKILL (flush time)."
    )
    progress_interval_s: float = Field(default=2.0, gt=0, le=3600)
    shard_max_lines: int = Field(default=10_000, ge=1, description="Lines per result shard at most.")
    max_line_bytes: int = Field(
        default=DEFAULT_MAX_LINE_BYTES,
        ge=1024,
        le=1 << 30,
        description="Longest input line a job answers as a request; a longer one (a file without "
        "newlines, a huge prompt) becomes a line_too_large error line, read in bounded memory.",
    )
    shard_max_seconds: float = Field(
        default=60.0,
        gt=0,
        description="A shard is closed (durable) after "
        "this long: a stopped or crashed attempt loses at most this much work.",
    )
    stop_wait_s: float = Field(
        default=30.0,
        gt=0,
        description="How long to wait for a stopped job to end; a deadline or a cancel ends the batch "
        "this long after it whatever Ray, the batch runner or S3 answer.",
    )
