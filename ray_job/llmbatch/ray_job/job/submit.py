"""How to launch the job through the Ray Jobs API (used by the dispatcher and the tests).

    from ray.job_submission import JobSubmissionClient
    from llmbatch.ray_job.job.submit import runtime_env, submit_kwargs

    env = runtime_env(s3_endpoint=..., s3_access_key=..., s3_secret_key=..., engine_env=engine_env(cache))
    client.submit_job(**submit_kwargs(spec, env))
    ...
    result = parse_result(client.get_job_logs(spec.submission_id))

``submit_kwargs`` sets ``submission_id = <batch_id>-a<attempt>`` and ``entrypoint_num_cpus=0``
(the driver only coordinates; giving it a CPU can starve the pipeline on small clusters).

``python`` must name the cluster's interpreter (the one Ray runs on, with ray/vllm installed):
``python`` in the production image; on the local stack the venv's ``bin/python`` (the head's
PATH does not include the venv). ``-P`` keeps the head's working directory off ``sys.path``, so
the shipped ``py_modules`` are imported, never a checkout that happens to be the cwd.
Credentials in ``env_vars`` are visible to anyone who can read the Ray dashboard: in production,
prefer putting ``AWS_*`` on the Ray pods from a Kubernetes Secret and leave them out here.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
import shlex
import shutil
import tempfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson

from llmbatch import ray_job, schemas
from llmbatch.ray_job.job.outcome import RESULT_PREFIX
from llmbatch.schemas.errors import LLMBatchError
from llmbatch.schemas.job import POOL_SHARE, JobSpec

MAX_ENTRYPOINT_CHARS = 100_000
"""Linux limits one argument to 128 KiB; bigger specs go through ``--spec-uri``."""
STOP_WAIT_S = 15
"""Seconds Ray waits after SIGTERM before SIGKILL (the job flushes shards and the manifest)."""


class SpecTooLargeError(LLMBatchError, ValueError):
    """The spec does not fit on a command line: upload it and use :func:`entrypoint_for_uri`."""


SHIPPED = (ray_job, schemas)
"""What a job needs of llmbatch on a Ray node: the job and the contracts (self-contained: neither
imports another part of llmbatch, nor Kafka or Redis client code at import)."""


@functools.cache
def _shipped_digest() -> str:
    """A hash of the shipped packages' files: they do not change while a process runs, so it is read
    once, not at every submission."""
    files = sorted(
        (f"{source.name}/{path.relative_to(source)}", path)
        for source in _shipped_sources()
        for path in source.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    )
    digest = hashlib.sha256()
    for name, path in files:
        digest.update(name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _shipped_sources() -> list[Path]:
    return [Path(next(iter(module.__path__))) for module in SHIPPED]


def package_dirs() -> list[str]:
    """For ``runtime_env["py_modules"]``: one folder named ``llmbatch`` holding copies of
    ``llmbatch.ray_job`` and ``llmbatch.schemas``, so a Ray node imports them by their names as the
    dispatcher does. The copy is made once per content (its hash names the folder, under the
    temporary directory; made again should something delete it), and Ray uploads a content only once
    too."""
    staged = Path(tempfile.gettempdir()) / f"llmbatch-py-modules-{_shipped_digest()}" / "llmbatch"
    if not staged.is_dir():
        building = staged.parent.with_name(f"{staged.parent.name}.{os.getpid()}.tmp")
        shutil.rmtree(building, ignore_errors=True)
        for source in _shipped_sources():
            shutil.copytree(
                source, building / "llmbatch" / source.name, ignore=shutil.ignore_patterns("__pycache__")
            )
        try:
            building.rename(staged.parent)
        except OSError:  # another process staged the same content meanwhile
            shutil.rmtree(building, ignore_errors=True)
    return [str(staged)]


def runtime_env(
    *,
    s3_endpoint: str | None = None,
    engine_env: Mapping[str, str] | None = None,
    env_vars: Mapping[str, str] | None = None,
    stop_wait_s: int = STOP_WAIT_S,
    **extra: Any,
) -> dict[str, Any]:
    """The job's ``runtime_env``: the two packages as ``py_modules`` plus the job's variables.

    ``engine_env`` is :func:`llmbatch.ray_job.engines.engine_env.engine_env` output; ``extra`` is merged as
    further runtime_env fields (e.g. ``pip`` or ``container`` on a real cluster). No credentials: the Ray
    dashboard and Jobs API show a runtime_env, so the job takes ``AWS_ACCESS_KEY_ID`` /
    ``AWS_SECRET_ACCESS_KEY`` and ``LLMBATCH_REDIS__PASSWORD`` from the Ray workers' environment.
    """
    variables: dict[str, str] = {"PYTHONUNBUFFERED": "1", "RAY_JOB_STOP_WAIT_TIME_S": str(stop_wait_s)}
    variables.update(engine_env or {})
    if s3_endpoint:
        variables["LLMBATCH_S3__ENDPOINT"] = s3_endpoint
    variables.update(env_vars or {})
    return {"py_modules": package_dirs(), "env_vars": variables, **extra}


@dataclass(frozen=True)
class SessionRef:
    """Where the attempt takes its S3 session (:mod:`llmbatch.ray_job.storage.s3_session`): a Redis URL
    without a password and a random key. Names only: what the Jobs API shows of it gives no access alone."""

    redis_url: str
    key: str

    def arguments(self) -> str:
        """The command-line arguments that name it (shell-quoted)."""
        if urlsplit(self.redis_url).password is not None:
            raise ValueError("the session's Redis URL must hold no password (the job takes it from its env)")
        return f"--s3-session-key {shlex.quote(self.key)} --s3-session-redis {shlex.quote(self.redis_url)}"


def encode_spec(spec: JobSpec) -> str:
    """URL-safe base64 of the zlib-compressed spec JSON (what ``--spec-b64`` takes)."""
    packed = zlib.compress(spec.model_dump_json(exclude_none=True).encode(), 9)
    return base64.urlsafe_b64encode(packed).decode().rstrip("=")


def entrypoint(spec: JobSpec, *, python: str = "python", session: SessionRef | None = None) -> str:
    """``python -m llmbatch.ray_job --spec-b64 ...``; :class:`SpecTooLargeError` when it is too long."""
    command = f"{python} -P -m llmbatch.ray_job --spec-b64 {encode_spec(spec)}"
    if session is not None:
        command += " " + session.arguments()
    if len(command) > MAX_ENTRYPOINT_CHARS:
        raise SpecTooLargeError(
            f"the encoded spec takes {len(command)} characters (limit {MAX_ENTRYPOINT_CHARS}): upload "
            "spec.model_dump_json() to S3 and use entrypoint_for_uri()"
        )
    return command


def entrypoint_for_uri(spec_uri: str, *, python: str = "python", session: SessionRef | None = None) -> str:
    """``python -m llmbatch.ray_job --spec-uri s3://...`` for a spec uploaded to S3."""
    if not spec_uri.startswith("s3://") or any(c.isspace() or c in "'\"`$\\;&|<>" for c in spec_uri):
        raise ValueError(f"unsafe spec URI for a command line: {spec_uri[:80]!r}")
    command = f"{python} -P -m llmbatch.ray_job --spec-uri {spec_uri}"
    return command + " " + session.arguments() if session is not None else command


def submit_kwargs(
    spec: JobSpec,
    env: dict[str, Any],
    *,
    spec_uri: str | None = None,
    python: str = "python",
    session: SessionRef | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``JobSubmissionClient.submit_job`` for this attempt (a pooled
    tenant's driver asks for a share of its pool's resource, so it starts only on the pool).
    ``session``: where the attempt takes its own S3 keys (:mod:`llmbatch.ray_job.storage.s3_session`)."""
    if spec_uri:
        command = entrypoint_for_uri(spec_uri, python=python, session=session)
    else:
        command = entrypoint(spec, python=python, session=session)
    kwargs: dict[str, Any] = {
        "submission_id": spec.submission_id,
        "entrypoint": command,
        "runtime_env": env,
        "entrypoint_num_cpus": 0,
        "metadata": {"batch_id": spec.batch_id, "attempt": str(spec.attempt)},
    }
    if spec.pool_resource:
        kwargs["entrypoint_resources"] = {spec.pool_resource: POOL_SHARE}
    return kwargs


def parse_result(logs: str) -> dict[str, Any] | None:
    """The last ``LLMBATCH_RESULT`` object in a job's logs, or ``None``."""
    for line in reversed(logs.splitlines()):
        start = line.find(RESULT_PREFIX)
        if start < 0:
            continue
        try:
            value = orjson.loads(line[start + len(RESULT_PREFIX) :])
        except orjson.JSONDecodeError:
            continue
        if isinstance(value, dict):
            return value
    return None
