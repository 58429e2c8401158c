"""The job backend interface: how the tracker launches, watches and stops one job attempt.

:class:`~llmbatch.dispatcher.backends.ray_backend.RayJobsBackend` implements it with Ray's Jobs API (local
head or a
KubeRay RayCluster head service); a RayJob-CRD backend could implement the same four calls.
Implementations raise :class:`~llmbatch.dispatcher.errors.RayUnavailable` (retriable) when the cluster does
not answer and :class:`~llmbatch.dispatcher.errors.JobRejected` when it refuses a job for good.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from llmbatch.schemas.job import JobSpec


class JobState(StrEnum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"
    # the cluster does not know the submission id (never submitted, or the head restarted)
    NOT_FOUND = "NOT_FOUND"

    @property
    def is_terminal(self) -> bool:
        return self in {JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED}


@dataclass(frozen=True)
class JobInfo:
    state: JobState
    exit_code: int | None = None
    message: str | None = None
    error_type: str | None = None
    start_time: float | None = None  # unix seconds
    end_time: float | None = None


@dataclass(frozen=True)
class SubmitResult:
    submission_id: str
    already_existed: bool
    via: str = "ray_job"
    """How the attempt runs: ``ray_job`` (the Jobs API) or ``batch_runner`` (the warm short path)."""


class JobBackend(Protocol):
    async def submit(self, spec: JobSpec) -> SubmitResult:
        """Start the attempt ``spec.submission_id``; a duplicate submission id is not an error."""
        ...

    async def status(self, submission_id: str) -> JobInfo: ...

    async def stop(self, submission_id: str) -> bool:
        """Ask the job to stop; True if a stop was requested, False if it was already finished/unknown."""
        ...

    async def delete(self, submission_id: str) -> bool:
        """Forget a finished job (its record and logs on the Ray head); False if it is unknown. A job
        the head will not delete yet (still running by its account) raises a retriable error. Called
        once the batch's terminal event is out, so job records stay bounded."""
        ...

    async def ping(self) -> bool: ...

    async def close(self) -> None: ...


# Exit codes of `python -m llmbatch.ray_job` (see ray_job.errors.ExitCode): 0 ok, 1 retriable, 65 invalid
# spec,
# 66 input not found, 69 no shared engine answered in time (sysexits values: 2 is Python's own usage
# error, e.g. an interpreter that rejects -P; any code not listed is retriable).
EXIT_OK = 0
EXIT_RETRIABLE = 1
EXIT_INVALID_SPEC = 65
EXIT_INPUT_NOT_FOUND = 66
EXIT_ENGINE_UNAVAILABLE = 69
EXIT_INFRA_UNAVAILABLE = 75
"""S3 did not serve the attempt: an outage, retried without spending one of the batch's attempts."""
NON_RETRIABLE_EXITS = frozenset({EXIT_INVALID_SPEC, EXIT_INPUT_NOT_FOUND})
