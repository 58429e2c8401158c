"""The e2e package's fresh Ray head (``ServiceProvider.fresh_ray``) comes back on the session head's
addresses with no history. Before, it came back on new ports, and with pytest-xdist a worker that ran
integration tests after the e2e package reached a head that was gone (CI: "Connection refused" on
the session's dashboard in test_serve_engine_vllm_faults)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from ray.job_submission import JobStatus, JobSubmissionClient

from tests.support.services import ServiceProvider

pytestmark = pytest.mark.integration


def _run_job(address: str) -> str:
    client = JobSubmissionClient(address)
    sid = client.submit_job(entrypoint="true", entrypoint_num_cpus=0)
    end = time.monotonic() + 180
    while not client.get_job_status(sid).is_terminal():
        assert time.monotonic() < end, f"job {sid} did not end"
        time.sleep(0.5)
    assert client.get_job_status(sid) is JobStatus.SUCCEEDED
    return sid


def test_a_fresh_head_keeps_the_addresses_given_out_before_and_forgets_its_jobs(tmp_path: Path) -> None:
    provider = ServiceProvider(tmp_path / "stack")
    try:
        before = provider.ray()
        if provider.sources["ray"] != "local stack":
            pytest.fail("this test needs the local stack's Ray head (unset LLMBATCH_RAY__ADDRESS)")
        old_pid = provider.local_record("ray").pid  # type: ignore[union-attr]
        sid = _run_job(before.address)

        fresh = provider.fresh_ray()

        assert (fresh.address, fresh.serve_address) == (before.address, before.serve_address)
        record = provider.local_record("ray")
        assert record is not None and record.pid != old_pid
        # the old settings reach the new head, which has no record of the job
        assert sid not in {job.submission_id for job in JobSubmissionClient(before.address).list_jobs()}
    finally:
        provider.close()
