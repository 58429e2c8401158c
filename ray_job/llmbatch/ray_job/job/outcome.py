"""How an attempt ends, decided without I/O: its final status and error from what it wrote, the error
of an early stop, the code of the exception that ended it, and the result line of one that ran (from
its manifest) or could not run at all (:mod:`llmbatch.ray_job.job.main` writes them into the manifest and the
result line).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import orjson

from llmbatch.ray_job.errors import EngineDeadError, EngineUnavailableError, JobError, SupersededError
from llmbatch.schemas.deadlines import DEADLINE_EXCEEDED
from llmbatch.schemas.openai import ErrorObject

if TYPE_CHECKING:  # the dispatcher reads result lines (ray_job.job.submit) without loading pyarrow
    from llmbatch.ray_job.job.manifest import Status
    from llmbatch.schemas.job import JobSpec, Manifest

RESULT_PREFIX = "LLMBATCH_RESULT "
"""Starts the machine-readable last line of a job's output (:func:`emit_result`)."""


def emit_result(result: dict[str, Any]) -> None:
    """Print the machine-readable last line the dispatcher parses from the job logs."""
    sys.stdout.write(RESULT_PREFIX + orjson.dumps(result).decode() + "\n")
    sys.stdout.flush()


def settle(
    status: Status,
    error: ErrorObject | None,
    *,
    intact: bool,
    resumed: bool,
    output_lines: int,
    error_lines: int,
    invalid_lines: int,
) -> tuple[Status, ErrorObject | None]:
    """The attempt's final status and error. A ``completed`` attempt whose shards or manifest were not
    all written is ``partial`` (retried); one where no line was a valid request (every line written
    to the error file was invalid, nothing resumed) is ``failed`` with ``input_invalid``, as OpenAI's
    batch is."""
    if not intact and status == "completed":
        status = "partial"
    nothing_valid = not resumed and output_lines == 0 and error_lines == invalid_lines
    if status == "completed" and nothing_valid:
        status = "failed"
        error = ErrorObject(
            code="input_invalid",
            message=(
                f"none of the {error_lines} input lines is a valid request: the error file names each "
                "line's problem"
                if error_lines
                else "the input has no request lines (empty file)"
            ),
        )
    return status, error


SUPERSEDED = "superseded"
"""The stop reason of an attempt that found a later one running (or the batch ended)."""


def stop_error(reason: str) -> ErrorObject:
    """The error of an attempt stopped early for ``reason`` (deadline, superseded, a signal's name)."""
    if reason == SUPERSEDED:
        return ErrorObject(
            code=SupersededError.code,
            message="a later attempt of the batch started or the batch ended: this attempt stopped",
        )
    code_name = DEADLINE_EXCEEDED if reason == "deadline" else "stopped"
    return ErrorObject(code=code_name, message=f"the attempt was stopped early ({reason})")


def failure_code(exc: BaseException) -> str:
    """A machine-readable code for an exception that ended the attempt."""
    if isinstance(exc, JobError):
        return exc.code
    if "EngineDeadError" in str(exc):  # raised in an engine actor, wrapped by Ray
        return EngineDeadError.code
    if "EngineUnavailableError" in str(exc):
        return EngineUnavailableError.code
    return "job_failed"


def failure_result(spec: JobSpec | None, code: int, error_code: str, message: str) -> dict[str, Any]:
    """The result line of an attempt that could not run at all."""
    return {
        "batch_id": spec.batch_id if spec else None,
        "attempt": spec.attempt if spec else None,
        "status": "failed",
        "exit_code": code,
        "error": {"code": error_code, "message": message[:4000]},
        "manifest_uri": spec.manifest_uri if spec else None,
    }


def attempt_result(spec: JobSpec, built: Manifest, error: ErrorObject | None) -> dict[str, Any]:
    """The result line of an attempt that ran, from the manifest it built (the driver adds its
    memory figures)."""
    return {
        "batch_id": spec.batch_id,
        "attempt": spec.attempt,
        "status": built.status,
        "request_counts": built.request_counts.model_dump(),
        "usage": built.usage.model_dump(),
        "manifest_uri": spec.manifest_uri,
        "output_shards": len(built.output_shards),
        "error_shards": len(built.error_shards),
        "timings": built.timings.model_dump(mode="json"),
        "error": error.model_dump(exclude_none=True) if error else None,
    }
