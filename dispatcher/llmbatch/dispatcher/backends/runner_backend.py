"""The short path: small batches on the batch runner (:mod:`llmbatch.ray_job.batch_runner.runner`), the
rest as Ray jobs.

:class:`RoutedBackend` is the tracker's :class:`~llmbatch.dispatcher.backends.backend.JobBackend` when shared
engines
and the short path are on. It sends a batch to the runner when :func:`takes_short_path` says so
(shared engine, at most ``short_path_max_lines`` inline lines or an input file of at most
``short_path_max_bytes``), every other batch to the Jobs API. Status and stop ask the runner first
and fall back to the Jobs API for the submission ids it does not know, so a dispatcher restart or
a change of the limits never loses track of a batch; the status checks of one tracker tick reach the
runner as one request (:mod:`llmbatch.dispatcher.domain.coalesce`). A runner replica that was replaced forgets
its runs: the tracker then sees NOT_FOUND and retries the attempt, as after a Ray head restart.
While the runner does not answer at all, a submission the Jobs API does not know either is
reported as :class:`~llmbatch.dispatcher.errors.RayUnavailable` (unknown), never as lost.

:class:`RunnerClient` is transport only (HTTP through Serve's proxy, with the runner's credential):
connection trouble, 5xx, 401/403 (a credential the runner does not take: set-up, never the batch's
fault) and 429 (the runner is full) are :class:`~llmbatch.dispatcher.errors.RayUnavailable`
(retriable), other 4xx a
:class:`~llmbatch.dispatcher.errors.JobRejected`.
"""

from __future__ import annotations

import asyncio
import http.client
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from llmbatch.dispatcher.backends.backend import JobBackend, JobInfo, JobState, SubmitResult
from llmbatch.dispatcher.backends.input_sizes import SizeOf
from llmbatch.dispatcher.backends.ray_http import tls_context
from llmbatch.dispatcher.backends.s3_sessions import SessionMinter
from llmbatch.dispatcher.domain.coalesce import Coalescer
from llmbatch.dispatcher.domain.scheduler import short_path_fits
from llmbatch.dispatcher.errors import JobRejected, RayUnavailable
from llmbatch.ray_job.batch_runner.runner_http import MAX_STATUS_IDS, ROUTE_PREFIX
from llmbatch.schemas.job import JobSpec
from llmbatch.settings import RaySettings

if TYPE_CHECKING:
    from pydantic import SecretStr

_STATES = {s.value: s for s in JobState}


def takes_short_path(spec: JobSpec, *, max_lines: int, max_bytes: int, input_size: int | None) -> bool:
    """Whether ``spec`` runs on the batch runner: a shared engine and a small input
    (:func:`~llmbatch.dispatcher.domain.scheduler.short_path_fits`). Never a pooled tenant's batch: the
    runner reads
    and
    writes every tenant's files with its own keys."""
    if spec.engine_app is None:
        return False
    lines = len(spec.requests) if spec.requests is not None else None
    return short_path_fits(
        pooled=spec.pool_resource is not None,
        lines=lines,
        input_size=input_size,
        max_lines=max_lines,
        max_bytes=max_bytes,
    )


def job_info(view: dict[str, Any]) -> JobInfo:
    """A runner's run view (``GET /runs/<id>``) as the tracker's :class:`JobInfo`."""
    exit_code = view.get("driver_exit_code")
    return JobInfo(
        state=_STATES.get(str(view.get("status")), JobState.PENDING),
        exit_code=int(exit_code) if exit_code is not None else None,
        message=str(view["message"])[:2000] if view.get("message") else None,
        start_time=float(view["start_time"]) if view.get("start_time") else None,
        end_time=float(view["end_time"]) if view.get("end_time") else None,
    )


class RunnerClient:
    """The batch runner's HTTP API (see :mod:`llmbatch.ray_job.batch_runner.runner`)."""

    def __init__(
        self,
        serve_address: str,
        timeout_s: float = 30.0,
        *,
        ca_file: Path | None = None,
        sessions: SessionMinter | None = None,
        token: SecretStr | None = None,
    ) -> None:
        self.base = serve_address.rstrip("/") + ROUTE_PREFIX
        self._token = token
        self.timeout_s = timeout_s
        self.context = tls_context(self.base, ca_file)
        self.sessions = sessions
        # the tracker checks its batches at once: one request for the states of all of them
        self._statuses: Coalescer[str, JobInfo | None] = Coalescer(
            self.statuses, missing=None, max_keys=MAX_STATUS_IDS
        )

    @classmethod
    def of(
        cls, ray: RaySettings, timeout_s: float = 30.0, *, sessions: SessionMinter | None = None
    ) -> RunnerClient:
        """The runner behind ``ray``'s Serve proxy (verified with its CA bundle; Ray's token is not
        sent: the proxy does not ask for it, and the runner is an application, not the cluster).
        With ``sessions``, each batch goes with S3 keys of its own
        (:mod:`llmbatch.dispatcher.backends.s3_sessions`). Every request carries ``ray.runner_token``."""
        return cls(
            ray.serve_address, timeout_s, ca_file=ray.ca_file, sessions=sessions, token=ray.runner_token
        )

    def _request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, Any]:
        headers = {"Content-Type": "application/json"}
        if self._token is not None:
            headers["Authorization"] = "Bearer " + self._token.get_secret_value()
        req = urllib.request.Request(  # noqa: S310 - the Serve address from settings
            self.base + path, data=body, method=method, headers=headers
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s, context=self.context) as resp:  # noqa: S310
                status, raw = int(resp.status), resp.read()
        except urllib.error.HTTPError as exc:
            raw = exc.read()[:4000]
            if exc.code == 404 and raw.startswith(b"{"):  # the runner's own 404: an unknown run
                return 404, None
            detail = raw.decode("utf-8", "replace")
            if exc.code in (401, 403):  # a credential the runner does not take: set-up, not the batch
                raise RayUnavailable(
                    f"the batch runner refused this dispatcher's credential ({exc.code}): give the "
                    f"dispatcher and the Ray nodes the same LLMBATCH_RAY__RUNNER_TOKEN; {detail[:300]}"
                ) from exc
            if exc.code >= 500 or exc.code in (404, 408, 429):  # 404 without JSON: no runner app yet
                raise RayUnavailable(f"batch runner answered {exc.code}: {detail[:500]}") from exc
            raise JobRejected(f"the batch runner refused the batch ({exc.code}): {detail[:1000]}") from exc
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            raise RayUnavailable(f"batch runner at {self.base} did not answer: {exc}") from exc
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, dict):  # every answer of the runner is an object: a proxy's page is not
            raise RayUnavailable(
                f"batch runner at {self.base} answered {status} with something that is "
                f"not a JSON object: {raw[:200]!r}"
            )
        return status, body

    async def submit(self, spec: JobSpec) -> SubmitResult:
        session = await self.sessions.mint_async(spec) if self.sessions is not None else None
        payload = orjson.dumps(
            {
                "spec": orjson.Fragment(spec.model_dump_json()),
                "s3_session": session.plain() if session is not None else None,
            }
        )
        _, body = await asyncio.to_thread(self._request, "POST", "/runs", payload)
        return SubmitResult(
            spec.submission_id, already_existed=bool(body.get("already_existed")), via="batch_runner"
        )

    async def status(self, submission_id: str) -> JobInfo | None:
        """The run's state; ``None`` when the runner does not know it. The calls of one event-loop turn
        share one request (:meth:`statuses`)."""
        return await self._statuses.get(submission_id)

    async def statuses(self, submission_ids: Sequence[str]) -> dict[str, JobInfo | None]:
        """The states of many runs in one request (``POST /statuses``); ``None`` for unknown ones. A
        runner from before that route (its 404) is asked run by run."""
        payload = orjson.dumps({"submission_ids": list(submission_ids)})
        code, body = await asyncio.to_thread(self._request, "POST", "/statuses", payload)
        if code == 404:
            answers = await asyncio.gather(*(self._status_of(sid) for sid in submission_ids))
            return dict(zip(submission_ids, answers, strict=True))
        runs = body.get("runs")
        if not isinstance(runs, dict):
            raise RayUnavailable(f"batch runner at {self.base} answered POST /statuses without 'runs'")
        return {
            sid: job_info(view) if isinstance(view := runs.get(sid), dict) else None for sid in submission_ids
        }

    async def _status_of(self, submission_id: str) -> JobInfo | None:
        code, body = await asyncio.to_thread(self._request, "GET", "/runs/" + submission_id)
        return None if code == 404 else job_info(body)

    async def stop(self, submission_id: str) -> bool | None:
        """True if a stop was requested; ``None`` when the runner does not know the run."""
        code, body = await asyncio.to_thread(self._request, "POST", f"/runs/{submission_id}/stop")
        return None if code == 404 else bool(body.get("stopped"))

    async def engines(self) -> dict[str, dict[str, Any]]:
        """The shared engines' figures per model (``GET /engines``: queue, activity, tokens/s)."""
        _, body = await asyncio.to_thread(self._request, "GET", "/engines")
        engines = body.get("engines") if isinstance(body, dict) else None
        return engines if isinstance(engines, dict) else {}


class RoutedBackend:
    """Small batches to the runner, the rest to the Jobs API (see the module docstring)."""

    def __init__(
        self, jobs: JobBackend, runner: RunnerClient, *, max_lines: int, max_bytes: int, size_of: SizeOf
    ) -> None:
        self.jobs = jobs
        self.runner = runner
        self.max_lines = max_lines
        self.max_bytes = max_bytes
        self.size_of = size_of

    async def submit(self, spec: JobSpec) -> SubmitResult:
        size = None
        if spec.engine_app is not None and spec.requests is None and spec.input_uri and self.max_lines > 0:
            size = await self.size_of(spec.input_uri)
        if takes_short_path(spec, max_lines=self.max_lines, max_bytes=self.max_bytes, input_size=size):
            return await self.runner.submit(spec)
        return await self.jobs.submit(spec)

    async def status(self, submission_id: str) -> JobInfo:
        try:
            info = await self.runner.status(submission_id)
        except RayUnavailable:
            # a Ray job still answers; a run of the runner cannot be told from a lost job now, and
            # calling it lost would start a second attempt beside a live one: retry later instead
            info = await self.jobs.status(submission_id)
            if info.state is JobState.NOT_FOUND:
                raise
            return info
        return info if info is not None else await self.jobs.status(submission_id)

    async def stop(self, submission_id: str) -> bool:
        try:
            stopped = await self.runner.stop(submission_id)
        except RayUnavailable:
            stopped = None
        return stopped if stopped is not None else await self.jobs.stop(submission_id)

    async def delete(self, submission_id: str) -> bool:
        # runs of the batch runner are forgotten by the runner itself (it keeps the last max_runs)
        return await self.jobs.delete(submission_id)

    async def ping(self) -> bool:
        return await self.jobs.ping()

    async def close(self) -> None:
        await self.jobs.close()
