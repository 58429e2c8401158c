"""The run folder's S3 keys (MinIO's user, made on first use), the batch runner's credential, and what a
Ray node's environment gets of them: jobs and Serve replicas find their credentials there, never in a
``runtime_env``."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path


def minio_credentials(run_dir: Path) -> tuple[str, str]:
    """The run folder's MinIO user and password, made on first use (mode 0600).

    MinIO and the Ray head (whose jobs and replicas need the keys) start in parallel and both ask: the
    first file linked into place wins, so both get the same pair."""
    path = run_dir / "minio.credentials.json"
    if not path.exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        keep_minio_credentials(
            run_dir, "llmbatch-" + secrets.token_hex(4), secrets.token_urlsafe(24), replace=False
        )
    user, password = json.loads(path.read_text())
    return str(user), str(password)


def keep_minio_credentials(run_dir: Path, user: str, password: str, *, replace: bool = True) -> None:
    """Write the S3 keys the run folder's services use (a test session whose S3 is not the local
    MinIO hands the local Ray head that S3's keys this way). Atomic; ``replace=False`` keeps a pair
    another start wrote first."""
    path = run_dir / "minio.credentials.json"
    tmp = run_dir / f".minio.credentials.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump([user, password], fh)
    try:
        if replace:
            os.replace(tmp, path)
        else:
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def runner_token(run_dir: Path) -> str:
    """The run folder's batch-runner credential (``LLMBATCH_RAY__RUNNER_TOKEN`` of the Ray head and of
    every dispatcher of the stack), made on first use (mode 0600); concurrent first uses get one."""
    path = run_dir / "runner.token"
    if not path.exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / f".runner.token.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(32))
        try:
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path.read_text().strip()


def ray_node_credentials(
    access_key: str, secret_key: str, redis_password: str | None = None, runner_token: str | None = None
) -> dict[str, str]:
    """The environment a Ray node hands its jobs and Serve replicas: the S3 keys (and the Redis
    password, and the batch runner's credential), which the dispatcher never sends in a
    ``runtime_env`` (the dashboard shows those)."""
    env = {"AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key}
    if redis_password:
        env["LLMBATCH_REDIS__PASSWORD"] = redis_password
    if runner_token:
        env["LLMBATCH_RAY__RUNNER_TOKEN"] = runner_token
    return env
