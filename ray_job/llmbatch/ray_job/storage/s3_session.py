"""The attempt's own S3 keys, taken once from Redis (``--s3-session-key``).

A Ray job runs with the node's environment, whose S3 keys reach every tenant's files. With job S3
sessions (``LLMBATCH_JOB__S3_SESSIONS``) the dispatcher mints temporary keys limited to the batch's
input object and output prefix (:mod:`llmbatch.dispatcher.backends.s3_sessions`), stores them in Redis under
a random
key
that only this attempt's command line names, and blanks the node's keys in the job's ``runtime_env``.
The driver takes them with ``GETDEL`` before anything else, so the Redis copy lives only until the
driver starts: the Jobs API shows the key's name, never the keys, and a name that was already taken
fails the attempt (retried with a new session) instead of running with someone else's.

The driver hands the session to the one task that reads S3 besides itself (the reader, inside its
``Source``); it is never logged, never in an event or a spec.
"""

from __future__ import annotations

from pydantic import ValidationError

from llmbatch.ray_job.errors import ExitCode, JobError
from llmbatch.ray_job.storage import job_redis
from llmbatch.schemas.job import S3Session


class SessionMissingError(JobError):
    """The attempt's S3 session is not in Redis: expired before the driver started, or taken by
    another process (the Jobs API shows its name). A new attempt gets a new one."""

    code = "s3_session_missing"


class SessionUnavailableError(JobError):
    """Redis did not answer the session's fetch: an outage, retried as a new attempt without counting
    against the batch's attempts."""

    exit_code = ExitCode.INFRA_UNAVAILABLE
    code = "s3_session_unavailable"


def fetch(redis_url: str, key: str, *, timeout_s: float = 10.0) -> S3Session:
    """Take (``GETDEL``) the session stored at ``key``; the job's Redis password comes from the
    node's environment, as for progress. Raises :class:`SessionMissingError` or
    :class:`SessionUnavailableError`; neither's message holds a key."""
    import redis

    client = job_redis.connect(redis_url, timeout_s=timeout_s)
    try:
        raw = client.getdel(key)
    except redis.RedisError as exc:
        raise SessionUnavailableError(
            f"cannot take the attempt's S3 session from Redis ({type(exc).__name__}: {str(exc)[:200]})"
        ) from None
    finally:
        client.close()
    if raw is None:
        raise SessionMissingError(
            f"the attempt's S3 session {key} is not in Redis: it expired before the driver started "
            "(LLMBATCH_JOB__S3_SESSION_S) or another process took it; a new attempt gets a new one"
        )
    try:
        return S3Session.model_validate_json(raw)
    except ValidationError as exc:
        fields = ", ".join(
            ".".join(str(p) for p in e["loc"]) or "body"
            for e in exc.errors(include_input=False, include_url=False)
        )
        raise SessionMissingError(f"the attempt's S3 session {key} is unreadable ({fields})") from None
