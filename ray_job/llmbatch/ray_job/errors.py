"""Per-request failures (one error-file line each) and the job's exit codes.

A :class:`RequestFailure` never stops the job: it becomes one line of an error shard, with an
OpenAI-style ``code``. Exceptions that mean the whole attempt cannot go on are the ``Job*`` errors
below; :mod:`llmbatch.ray_job.job.main` maps them to exit codes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from llmbatch.schemas.errors import LLMBatchError, SchemaError


class ExitCode(IntEnum):
    """Exit status of ``python -m llmbatch.ray_job`` (the Ray job's ``driver_exit_code``)."""

    OK = 0
    """Every request ended (some may be error lines); manifest status ``completed``."""
    RETRIABLE = 1
    """Anything else: crash, engine died, S3 write failed, stopped early (manifest ``partial``).
    Every code not listed here counts as this one: 2 is Python's own usage error (an interpreter that
    rejects ``-P``), 126/127 the shell's, 128+N a signal, all problems of the cluster, not the batch."""
    INVALID_SPEC = 65
    """The job spec is invalid: retrying cannot help (sysexits ``EX_DATAERR``)."""
    INPUT_NOT_FOUND = 66
    """The input object does not exist or cannot be read: retrying cannot help (``EX_NOINPUT``)."""
    ENGINE_UNAVAILABLE = 69
    """No shared engine of the model answered within ``engine_wait_s``: the batch fails once
    instead of waiting again on every retry (``EX_UNAVAILABLE``)."""
    INFRA_UNAVAILABLE = 75
    """S3, Redis (the attempt's S3 session) or Ray Serve did not serve what the attempt needs (an
    outage, not the batch's fault): retried without counting against the batch's attempts
    (``EX_TEMPFAIL``)."""


class JobError(LLMBatchError):
    """An error that ends the attempt with a given exit code and a machine-readable code."""

    exit_code: ExitCode = ExitCode.RETRIABLE
    code: str = "job_failed"


class InvalidSpecError(JobError):
    exit_code = ExitCode.INVALID_SPEC
    code = "invalid_job_spec"


class InputNotFoundError(JobError):
    exit_code = ExitCode.INPUT_NOT_FOUND
    code = "input_not_found"


class EngineDeadError(JobError):
    """The engine cannot serve any more requests (the attempt must be retried)."""

    code = "engine_dead"


class SupersededError(JobError):
    """A later attempt of the batch is running (this one's stop did not take): it must not write."""

    code = "superseded"


class ClusterBusyError(JobError):
    """The cluster could not reserve the resources of the job's stages in time (retried later)."""

    code = "cluster_busy"


class InfraUnavailableError(JobError):
    """A dependency (S3, Redis, Ray Serve) was down when the attempt needed it: not the batch's fault."""

    exit_code = ExitCode.INFRA_UNAVAILABLE
    code = "infrastructure_unavailable"


class EngineUnavailableError(JobError):
    """No engine of the batch's model answered in time (none could start, or all stayed busy)."""

    exit_code = ExitCode.ENGINE_UNAVAILABLE
    code = "engine_unavailable"


class CallAbandonedError(JobError):
    """The caller of an engine call stopped waiting for it (its attempt was cancelled, reached its
    deadline or was superseded): the call's requests left the engine unanswered."""

    code = "call_abandoned"


# OpenAI-style codes used by the job itself (schema problems use schemas.errors.OPENAI_ERROR_CODES)
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
"""The prompt (plus ``max_tokens``) does not fit the model's context window (HTTP 400)."""
INVALID_PROMPT = "invalid_prompt"
"""The chat template could not render the messages (HTTP 400)."""
INVALID_RESPONSE_FORMAT = "invalid_response_format"
"""The engine could not compile the request's ``response_format`` schema (HTTP 400)."""
ENGINE_ERROR = "engine_error"
"""The engine refused or failed this one request (HTTP 400 when it rejected the parameters, else 500)."""
UNREADABLE_CUSTOM_ID = "@line-{line}"
"""``custom_id`` written for an input line whose own custom_id could not be read."""


@dataclass(frozen=True, slots=True)
class RequestFailure:
    """Why one request produced an error line instead of an output line.

    ``status_code`` is ``None`` for lines that never became a request (unparseable input): their
    error line has ``response: null``. Otherwise the line also carries an OpenAI-style error
    ``response`` with that HTTP status.
    """

    code: str
    message: str
    param: str | None = None
    status_code: int | None = None

    @classmethod
    def from_schema_error(cls, err: SchemaError) -> RequestFailure:
        return cls(code=err.openai_code, message=err.message, param=err.field)

    @classmethod
    def from_engine_exception(cls, exc: BaseException) -> RequestFailure:
        """A per-request engine exception: :class:`RequestRejected` keeps its details, others are 500s."""
        if isinstance(exc, RequestRejected):
            return exc.failure
        text = str(exc) or type(exc).__name__
        return cls(ENGINE_ERROR, f"{type(exc).__name__}: {text}"[:4000], None, 500)


class RequestRejected(LLMBatchError):
    """Raised by a backend when the engine refuses one request (bad parameters): HTTP 400."""

    def __init__(self, message: str, *, code: str = ENGINE_ERROR, param: str | None = None) -> None:
        super().__init__(message)
        self.failure = RequestFailure(code, message[:4000], param, 400)
