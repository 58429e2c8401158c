"""Temporary S3 keys for each batch of the shared batch runner (STS ``AssumeRole``).

The batch runner runs every tenant's small batches in one Serve replica. Without sessions it reads and
writes with its node's keys, which reach every tenant's files. With them (``runner_s3_sessions``, the
default), the dispatcher asks the S3 service's STS for keys with its own and a session policy
(:func:`llmbatch.dispatcher.security.minio_policy.batch_policy`) that allows the batch's input object and
output prefix
only; a session's rights are the dispatcher's keys' rights within that policy. The keys travel in the
body of the submit request to the runner (:class:`llmbatch.schemas.job.RunnerSubmission`), which builds that
batch's filesystem from them and never from its node's keys. A bug or a hostile spec in one batch can
then touch no other batch's files, and the keys expire (``runner_s3_session_s``).

A Ray job's processes start from their node's environment, whose keys reach every tenant's files too.
With job sessions (``LLMBATCH_JOB__S3_SESSIONS``, the default) each attempt gets keys of its own the same
way (:class:`JobSessions`); they cannot travel in a job's ``runtime_env`` or command line, which the Jobs
API shows, so they wait in Redis under a random name that only the attempt's command line gives, and the
driver takes them once (:mod:`llmbatch.ray_job.storage.s3_session`). The job's ``runtime_env`` blanks the
node's S3 keys.

MinIO answers ``AssumeRole`` for any of its users (no role); AWS needs ``runner_s3_role_arn``.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from datetime import UTC

import orjson

from llmbatch.adapters.storage import http_client
from llmbatch.dispatcher.errors import JobRejected, StateStoreUnavailable, StorageUnavailable
from llmbatch.dispatcher.security.minio_policy import batch_policy
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.ray_job.job.submit import SessionRef
from llmbatch.schemas.job import JobSpec, S3Session
from llmbatch.settings import S3Settings

SESSION_NAME_MAX = 64
log = logging.getLogger(__name__)


class SessionMinter:
    """Mints one :class:`S3Session` per runner batch with the dispatcher's S3 keys."""

    def __init__(self, s3: S3Settings, *, duration_s: int = 3600, role_arn: str | None = None) -> None:
        self.s3 = s3
        self.duration_s = duration_s
        self.role_arn = role_arn
        self._http = http_client(s3, connect_s=5, read_s=15, retries=2)

    def mint(self, spec: JobSpec) -> S3Session:
        """Keys for ``spec``'s batch (blocking: one HTTP call to the S3 service's STS).

        Raises :class:`StorageUnavailable` (retriable) when the service does not answer or fails, and
        :class:`JobRejected` (the batch fails, naming the cause) when it refuses (wrong keys, no STS, a
        RoleArn needed) or when no policy can hold the batch to its files (a wildcard in its input's
        name)."""
        from minio.credentials.providers import AssumeRoleProvider

        try:
            document = batch_policy(input_uri=spec.input_uri, output_prefix=spec.output_prefix)
        except ValueError as exc:
            raise JobRejected(f"no S3 session can be limited to this batch's files: {exc}") from None
        policy = orjson.dumps(document)
        provider = AssumeRoleProvider(
            sts_endpoint=self.s3.endpoint,
            access_key=self.s3.access_key.get_secret_value(),
            secret_key=self.s3.secret_key.get_secret_value(),
            duration_seconds=self.duration_s,
            policy=policy.decode(),
            region=self.s3.region,
            role_arn=self.role_arn,
            role_session_name=spec.submission_id[:SESSION_NAME_MAX] if self.role_arn else None,
            http_client=self._http,
        )
        try:
            creds = provider.retrieve()
        except ValueError as exc:  # minio's provider: "<url> failed with HTTP status code <n>"
            text = str(exc)
            if any(f"status code {code}" in text for code in (500, 502, 503, 504)):
                raise StorageUnavailable(f"S3 STS at {self.s3.endpoint} failed: {text[-80:]}") from exc
            raise JobRejected(
                f"S3 STS at {self.s3.endpoint} refused AssumeRole with LLMBATCH_S3__ACCESS_KEY's keys "
                f"({text[-40:]}): give that user AssumeRole rights (MinIO: any user has them; AWS: set "
                "LLMBATCH_DISPATCHER__RUNNER_S3_ROLE_ARN), or set LLMBATCH_DISPATCHER__RUNNER_S3_SESSIONS="
                "false to let the runner use its node's keys"
            ) from exc
        except Exception as exc:  # urllib3's connection errors and the like: the service is away
            raise StorageUnavailable(
                f"S3 STS at {self.s3.endpoint} did not answer: {type(exc).__name__}"
            ) from exc
        if not creds.session_token:
            raise JobRejected(f"S3 STS at {self.s3.endpoint} answered AssumeRole without a session token")
        expires = creds.expiration.replace(tzinfo=UTC) if creds.expiration else None  # naive UTC
        return S3Session(
            access_key=creds.access_key,
            secret_key=creds.secret_key,
            session_token=creds.session_token,
            expires_at=expires,
        )

    async def mint_async(self, spec: JobSpec) -> S3Session:
        """:meth:`mint` in a thread (never on the event loop)."""
        return await asyncio.to_thread(self.mint, spec)


class JobSessions:
    """Each Ray job attempt's S3 session, minted by ``minter`` and kept in Redis (``store``) under a
    random key for its driver to take once; the Redis copy lives as long as the session."""

    def __init__(self, minter: SessionMinter, store: StateStore) -> None:
        self.minter = minter
        self.store = store

    async def issue(self, spec: JobSpec) -> SessionRef:
        """Mint ``spec``'s session and store it; what the attempt's command line names.

        Raises :class:`JobRejected` when the spec names no Redis for its job
        (``LLMBATCH_JOB__PASS_REDIS_URL``), besides :meth:`SessionMinter.mint`'s errors and
        :class:`llmbatch.dispatcher.errors.StateStoreUnavailable`."""
        if spec.redis_url is None:
            raise JobRejected(
                "job S3 sessions reach the job through Redis: set LLMBATCH_JOB__PASS_REDIS_URL="
                "true or LLMBATCH_JOB__S3_SESSIONS=false"
            )
        session = await self.minter.mint_async(spec)
        nonce = secrets.token_urlsafe(24)
        await self.store.put_s3_session(nonce, orjson.dumps(session.plain()), self.minter.duration_s)
        return SessionRef(redis_url=spec.redis_url, key=self.store.keys.s3_session(nonce))

    async def withdraw(self, ref: SessionRef) -> None:
        """Drop a session whose submit created no job (refused, failed, or the attempt existed with a
        session of its own), so the keys do not wait in Redis for their whole life. Best effort: a
        driver that still finds none fails as retriable (``s3_session_missing``)."""
        try:
            await self.store.drop_s3_session(ref.key)
        except StateStoreUnavailable:
            log.warning(
                "could not drop an unused S3 session from Redis; it expires by itself",
                extra={"ttl_s": self.minter.duration_s},
            )
