"""The secrets a Ray node's environment holds for llmbatch's processes, by name, and what a Serve
replica that needs none of them is started with instead.

A node gets its S3 keys, the jobs' Redis password and the batch runner's API credential from its own
environment (a Kubernetes Secret; the local stack's head), and every worker it starts inherits them.
Jobs and the batch runner read them (:mod:`llmbatch.ray_job.storage.s3`,
:mod:`llmbatch.ray_job.job.progress`); an engine replica reads no S3 object and no Redis key, and a
batch runner whose batches bring S3 keys of their own (:class:`llmbatch.schemas.job.S3Session`) reads
no node key. Their Serve applications set these variables empty in their ``runtime_env``
(:func:`withheld`), so the code they run over every tenant's prompts (a model's own code among it)
does not find keys to every tenant's files or the state's password in its environment. A Ray job whose
attempt brings S3 keys of its own (:mod:`llmbatch.ray_job.storage.s3_session`) blanks the node's S3 keys in
the job's ``runtime_env`` (every process of the job: :func:`job_withheld`). Empty values are names, not
secrets: the dashboard may show them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from llmbatch.schemas.job import JobSpec

# variable names, not values
S3_ACCESS_KEY = "AWS_ACCESS_KEY_ID"
S3_SECRET_KEY = "AWS_SECRET_ACCESS_KEY"  # noqa: S105
S3_SESSION_TOKEN = "AWS_SESSION_TOKEN"  # noqa: S105
REDIS_PASSWORD = "LLMBATCH_REDIS__PASSWORD"  # noqa: S105
# the batch runner's API credential: the runner checks it, the dispatcher (RaySettings) sends it
RUNNER_TOKEN = "LLMBATCH_RAY__RUNNER_TOKEN"  # noqa: S105

S3_KEYS = (S3_ACCESS_KEY, S3_SECRET_KEY, S3_SESSION_TOKEN)
ALL = (*S3_KEYS, REDIS_PASSWORD, RUNNER_TOKEN)


def withheld(names: Iterable[str]) -> dict[str, str]:
    """``runtime_env`` variables that blank ``names`` in a replica's process (Ray cannot unset one)."""
    return dict.fromkeys(names, "")


def engine_withheld(model_path: str) -> tuple[str, ...]:
    """What an engine replica of a model at ``model_path`` is started without: every node secret,
    but the S3 keys for weights vLLM loads from ``s3://`` itself."""
    if model_path.startswith("s3://"):
        return (REDIS_PASSWORD, RUNNER_TOKEN)
    return ALL


def job_withheld(spec: JobSpec) -> tuple[str, ...]:
    """What the processes of ``spec``'s Ray job, with an S3 session of its own, are started without: the
    node's S3 keys, unless the job runs its own engine (no ``engine_app``) of weights vLLM loads from
    ``s3://``. The Redis password stays: the job writes its progress and takes its session with it."""
    if spec.engine_app is None and (spec.model_path or spec.model).startswith("s3://"):
        return (RUNNER_TOKEN,)
    return (*S3_KEYS, RUNNER_TOKEN)


def is_withheld(name: str) -> bool:
    """Whether this process was started without ``name`` on purpose (set empty; unset is not that: a
    node may give credentials another way, e.g. a web identity)."""
    return os.environ.get(name) == ""
