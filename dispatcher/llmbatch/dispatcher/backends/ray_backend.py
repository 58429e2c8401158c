"""Ray Jobs API backend (``JobSubmissionClient``): a local head or a KubeRay RayCluster head service.

- submission id = ``<batch_id>-a<attempt>``; Ray answering "already exists" means the attempt was
  submitted before (a crash between submit and bookkeeping): it counts as submitted;
- an unknown submission id (HTTP 404; e.g. after a head restart, which loses every job record) is
  :attr:`JobState.NOT_FOUND`, never an exception;
- connection trouble is :class:`RayUnavailable` (retriable); the client is rebuilt on the next call;
- 401/403 (a missing or rotated token) is :class:`RayUnavailable` too: every batch would be refused
  alike, so it is an outage to wait out, never a verdict on one batch (other 4xx: :class:`JobRejected`).

The SDK is synchronous (``requests``): every call runs in a worker thread with a timeout.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from llmbatch.dispatcher.backends.backend import JobInfo, JobState, SubmitResult
from llmbatch.dispatcher.backends.ray_http import auth_headers
from llmbatch.dispatcher.errors import DispatcherError, JobRejected, PermanentError, RayUnavailable, classify
from llmbatch.dispatcher.settings import DispatcherSettings
from llmbatch.schemas.job import JobSpec

if TYPE_CHECKING:
    from llmbatch.dispatcher.backends.s3_sessions import JobSessions
    from llmbatch.ray_job.job.submit import SessionRef

log = logging.getLogger(__name__)
T = TypeVar("T")

_STATES = {s.value: s for s in JobState}
_AUTH_CODES = frozenset({401, 403})


def _status_code(exc: BaseException) -> int | None:
    text = str(exc)
    marker = "status code "
    if marker in text:
        digits = text.split(marker, 1)[1][:3]
        if digits.isdigit():
            return int(digits)
    return None


def job_env(settings: DispatcherSettings, spec: JobSpec) -> dict[str, str]:
    """Extra environment of the job's processes (besides what ``llmbatch.ray_job.job.submit.runtime_env``
    sets)."""
    from llmbatch.dispatcher.backends.engines import engine_env_vars, runner_env_vars

    env = engine_env_vars(settings) if spec.engine.backend == "vllm" else {}
    env.update(runner_env_vars(settings))  # the same as the batch runner's: where S3 is, job.env_vars
    return env


def build_submission(
    settings: DispatcherSettings,
    spec: JobSpec,
    spec_uri: str | None = None,
    session: SessionRef | None = None,
) -> dict[str, Any]:
    """``submit_job`` keyword arguments for one attempt (entrypoint, runtime_env, resources).
    ``session``: where the attempt takes S3 keys of its own; its processes then start with the
    node's blanked (:func:`llmbatch.ray_job.storage.node_secrets.job_withheld`)."""
    from llmbatch.ray_job.job import submit as job_submit
    from llmbatch.ray_job.storage import node_secrets

    job = settings.job
    s3 = settings.s3
    extra: dict[str, Any] = {}
    if job.pip:
        extra["pip"] = list(job.pip)
    variables = job_env(settings, spec)
    # a job never calls the batch runner: it runs without its credential, whatever else it keeps
    variables.update(node_secrets.withheld((node_secrets.RUNNER_TOKEN,)))
    if session is not None:
        variables.update(node_secrets.withheld(node_secrets.job_withheld(spec)))
    env = job_submit.runtime_env(
        s3_endpoint=s3.endpoint,
        env_vars=variables,
        stop_wait_s=job.ray_stop_wait_s,
        **extra,
    )
    if not job.ship_modules:
        env.pop("py_modules", None)
    kwargs = job_submit.submit_kwargs(spec, env, spec_uri=spec_uri, python=job.python, session=session)
    if spec.pool_resource is None:
        kwargs["entrypoint_num_cpus"] = job.entrypoint_num_cpus
    elif job.entrypoint_num_cpus:  # the pool's nodes have no CPU: the driver asks its pool's resource
        kwargs["entrypoint_resources"] = {spec.pool_resource: job.entrypoint_num_cpus}
    if job.entrypoint_num_gpus:
        kwargs["entrypoint_num_gpus"] = job.entrypoint_num_gpus
    if job.entrypoint_memory:
        kwargs["entrypoint_memory"] = job.entrypoint_memory
    if job.entrypoint_resources:  # beside the tenant pool's share that submit_kwargs may have set
        pool = kwargs.get("entrypoint_resources", {})
        kwargs["entrypoint_resources"] = {**job.entrypoint_resources, **pool}
    kwargs["metadata"] = {**kwargs.get("metadata", {}), "llmbatch": "dispatcher"}
    return kwargs


SpecUploader = Callable[[JobSpec], Awaitable[str]]


class RayJobsBackend:
    def __init__(
        self,
        settings: DispatcherSettings,
        *,
        timeout_s: float = 30.0,
        max_threads: int = 8,
        upload_spec: SpecUploader | None = None,
        sessions: JobSessions | None = None,
    ) -> None:
        self.settings = settings
        self.upload_spec = upload_spec
        self.sessions = sessions
        """With these, each attempt gets S3 keys of its own
        (:mod:`llmbatch.dispatcher.backends.s3_sessions`)."""
        self.timeout_s = timeout_s
        self._client: Any = None
        self._sem = asyncio.Semaphore(max_threads)

    def _get_client(self) -> Any:
        if self._client is None:
            # The token, when there is one, travels in our own Authorization header. Ray's client-side
            # "token" mode would look for a token of its own, and Ray reads the mode once per process:
            # a token-less backend later in the same process would then be refused before it asks.
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            from ray.job_submission import JobSubmissionClient

            timeout = self.timeout_s

            class _TimedClient(JobSubmissionClient):
                def _do_request(self, method: str, endpoint: str, **kwargs: Any) -> Any:
                    kwargs.setdefault("timeout", timeout)
                    return super()._do_request(method, endpoint, **kwargs)

            ray = self.settings.ray
            self._client = _TimedClient(
                ray.address,
                headers=auth_headers(ray.auth_token) or None,
                verify=str(ray.ca_file) if ray.ca_file is not None else True,
            )
        return self._client

    async def _call(self, what: str, fn: Callable[[Any], T]) -> T:
        async with self._sem:
            try:
                return await asyncio.wait_for(
                    asyncio.to_thread(lambda: fn(self._get_client())), self.timeout_s + 5
                )
            except DispatcherError:
                raise  # already translated by ``fn``
            except Exception as exc:
                code = _status_code(exc)
                if code in _AUTH_CODES or type(exc).__name__ == "AuthenticationError":
                    # a missing or rotated token (Ray's AuthenticationError, or a bare 401/403):
                    # an outage of every batch alike, not a fault of this one
                    self._client = None
                    raise RayUnavailable(
                        f"Ray refused our credentials ({code or 'token'}) for {what}: check "
                        "LLMBATCH_RAY__AUTH_TOKEN "
                        "against the cluster's token (rotated?); batches wait until it is fixed"
                    ) from exc
                if code is not None and code < 500 and code not in {404, 408, 429}:
                    raise JobRejected(f"Ray refused {what}: {str(exc)[:500]}") from exc
                err = classify(exc, default=RayUnavailable)
                if (
                    (code is not None and code >= 500)
                    or isinstance(exc, ConnectionError | TimeoutError)
                    or err.retriable
                ):
                    self._client = None
                    raise RayUnavailable(f"Ray {what}: {type(exc).__name__}: {str(exc)[:300]}") from exc
                raise err from exc

    async def submit(self, spec: JobSpec) -> SubmitResult:
        """Submit one attempt; with :attr:`sessions`, it goes with an S3 session of its own, dropped
        again when the submit made no job (so the keys do not wait in Redis for nothing)."""
        if self.sessions is None:
            return await self._submit(spec, None)
        session = await self.sessions.issue(spec)
        try:
            result = await self._submit(spec, session)
        except BaseException:
            await self.sessions.withdraw(session)  # had a job been made after all, it fails and is retried
            raise
        if result.already_existed:
            await self.sessions.withdraw(session)  # that attempt runs with the session it was made with
        return result

    async def _submit(self, spec: JobSpec, session: SessionRef | None) -> SubmitResult:
        from llmbatch.ray_job.job.submit import SpecTooLargeError

        try:
            kwargs = build_submission(self.settings, spec, session=session)
        except SpecTooLargeError:
            if self.upload_spec is None:
                raise JobRejected(
                    f"the job spec of {spec.submission_id} is too large for a command line "
                    "and no spec uploader is configured"
                ) from None
            kwargs = build_submission(
                self.settings, spec, spec_uri=await self.upload_spec(spec), session=session
            )
        sid = spec.submission_id

        def submit(client: Any) -> SubmitResult:
            try:
                client.submit_job(**kwargs)
                return SubmitResult(sid, already_existed=False)
            except RuntimeError as exc:
                if "already exists" in str(exc):
                    return SubmitResult(sid, already_existed=True)
                raise

        return await self._call("submit", submit)

    async def status(self, submission_id: str) -> JobInfo:
        def get(client: Any) -> JobInfo:
            try:
                details = client.get_job_info(submission_id)
            except RuntimeError as exc:
                if _status_code(exc) == 404 or "does not exist" in str(exc):
                    return JobInfo(JobState.NOT_FOUND)
                raise
            status = str(getattr(details.status, "value", details.status))
            start = getattr(details, "start_time", None)
            end = getattr(details, "end_time", None)
            return JobInfo(
                state=_STATES.get(status, JobState.PENDING),
                exit_code=getattr(details, "driver_exit_code", None),
                message=(details.message or "")[:2000] if getattr(details, "message", None) else None,
                error_type=getattr(details, "error_type", None),
                start_time=start / 1000 if start else None,
                end_time=end / 1000 if end else None,
            )

        return await self._call("status", get)

    async def stop(self, submission_id: str) -> bool:
        def stop(client: Any) -> bool:
            try:
                return bool(client.stop_job(submission_id))
            except RuntimeError as exc:
                if _status_code(exc) == 404 or "does not exist" in str(exc):
                    return False
                raise

        return await self._call("stop", stop)

    async def delete(self, submission_id: str) -> bool:
        def delete(client: Any) -> bool:
            try:
                return bool(client.delete_job(submission_id))
            except RuntimeError as exc:
                if _status_code(exc) == 404 or "does not exist" in str(exc):
                    return False  # unknown: deleted already, or never a Ray job (the batch runner's)
                if _status_code(exc) == 400 or "terminal" in str(exc):
                    # not finished yet by the head's account, or found as a driver job for a moment:
                    # worth asking again later, not an answer (seen in CI: jobs never deleted)
                    raise RayUnavailable(f"Ray cannot delete {submission_id} yet: {str(exc)[:300]}") from exc
                raise

        return await self._call("delete", delete)

    async def logs_tail(self, submission_id: str, lines: int = 20) -> str:
        def get(client: Any) -> str:
            return "\n".join(str(client.get_job_logs(submission_id)).splitlines()[-lines:])

        try:
            return await self._call("logs", get)
        except (RayUnavailable, PermanentError):
            return ""

    async def ping(self) -> bool:
        try:
            await self._call("ping", lambda client: client.get_version())
            return True
        except Exception:
            return False

    async def close(self) -> None:
        self._client = None
