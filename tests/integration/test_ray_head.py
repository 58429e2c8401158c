"""Jobs API on the real Ray head: runtime_env ships the project's packages; exit codes surface."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from ray.job_submission import JobStatus, JobSubmissionClient

from llmbatch.ray_job.job.submit import package_dirs
from llmbatch.settings import RaySettings

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _wait(client: JobSubmissionClient, job_id: str, timeout: float = 300) -> JobStatus:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = client.get_job_status(job_id)
        if status.is_terminal():
            return status
        time.sleep(1)
    raise AssertionError(f"job {job_id} still {client.get_job_status(job_id)} after {timeout}s")


def test_job_with_project_package_in_runtime_env(ray_settings: RaySettings) -> None:
    client = JobSubmissionClient(ray_settings.address)
    job_id = f"t-{uuid.uuid4().hex[:8]}-a1"
    client.submit_job(
        submission_id=job_id,
        # -P as in the real entrypoint (llmbatch.ray_job.job.submit): the driver's cwd may be a checkout,
        # which must not shadow the shipped package; nor may the checkout's editable install (its .pth
        # puts ray_job/ on sys.path too): the shipped llmbatch folder comes first
        entrypoint="python -P -c "
        "\"import llmbatch.ray_job.engines.engine_env as m; print('SHIPPED', m.__file__)\"",
        runtime_env={"py_modules": package_dirs(), "env_vars": {"RAY_AUTH_MODE": "disabled"}},
        entrypoint_num_cpus=0,
    )
    assert _wait(client, job_id) == JobStatus.SUCCEEDED
    logs = client.get_job_logs(job_id)
    shipped = [ln for ln in logs.splitlines() if ln.startswith("SHIPPED")]
    assert shipped, logs
    # imported from the uploaded package, not from this checkout
    assert "runtime_resources" in shipped[0] and str(REPO) not in shipped[0], shipped[0]


def test_failing_job_reports_exit_code(ray_settings: RaySettings) -> None:
    client = JobSubmissionClient(ray_settings.address)
    job_id = f"t-{uuid.uuid4().hex[:8]}-a1"
    client.submit_job(
        submission_id=job_id, entrypoint="python -c 'import sys; sys.exit(7)'", entrypoint_num_cpus=0
    )
    assert _wait(client, job_id) == JobStatus.FAILED
    info = client.get_job_info(job_id)
    assert info.driver_exit_code == 7


def test_duplicate_submission_id_is_refused(ray_settings: RaySettings) -> None:
    client = JobSubmissionClient(ray_settings.address)
    job_id = f"t-{uuid.uuid4().hex[:8]}-a1"
    client.submit_job(submission_id=job_id, entrypoint="true", entrypoint_num_cpus=0)
    with pytest.raises(RuntimeError, match="already exists"):
        client.submit_job(submission_id=job_id, entrypoint="true", entrypoint_num_cpus=0)
    _wait(client, job_id)
