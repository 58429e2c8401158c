"""The short path: small batches run inside long-lived Serve replicas, not as a Ray job each.

A Ray job per batch costs 15-20 s before the first request reaches a warm engine on these
machines (driver process, ``ray.init``, Ray Data actor pools, a first handle to the engine). The
batch runner keeps all of that warm: one Serve application (``llmbatch-runner``, behind Serve's
HTTP proxy) whose replicas hold the tokenizers and the engine handles, and run each batch they are
given in a thread of its own. A batch keeps everything the job path gives it: the same reader,
prompt and engine stages, shards, manifest, progress and heartbeats in Redis, resume after a lost
attempt, stop and deadline (checked between blocks of ``engine.batch_size`` lines).

It trusts no caller. Every request carries ``Authorization: Bearer <token>``, the shared secret
``LLMBATCH_RAY__RUNNER_TOKEN`` that the dispatcher and the Ray nodes both take from one Secret (never
a Serve config or a ``runtime_env``: the dashboard shows those); a runner whose node has none answers
no one. A batch's Redis URL and progress key are the runner's own (its application's ``args``, from
the operator's config) and the batch's identity, never the spec's; its output prefix must be the one
the batch's identity gives in the runner's results bucket.

Its runs live in Redis (:mod:`llmbatch.ray_job.batch_runner.run_store`): any replica answers for any run, a
replaced replica's runs are reported unknown (the dispatcher retries them as lost), and a finished
run stays answerable for days.

HTTP (for the dispatcher, which is not a Ray driver), under the route prefix (parsed in
:mod:`llmbatch.ray_job.batch_runner.runner_http`):

- ``POST /runs`` with a :class:`~llmbatch.schemas.job.JobSpec` as JSON: 202 (started) or 200 (that
  submission id is known already), 400 for a spec that does not parse, 429 when the replica runs
  ``max_runs`` batches already;
- ``GET /runs/<submission_id>``: 200 with the run's state (the Jobs API's states and exit codes),
  404 when no replica knows it (never given, or its replica was replaced: the dispatcher treats that
  as a lost job and retries);
- ``POST /statuses`` with ``{"submission_ids": [...]}`` (at most
  :data:`~llmbatch.ray_job.batch_runner.runner_http.MAX_STATUS_IDS`): 200
  ``{"runs": {submission_id: state or null}}``, the states of many runs in one request (null: unknown);
- ``POST /runs/<submission_id>/stop``: 200 ``{"stopped": bool}``, 404 when unknown;
- ``GET /engines``: 200 ``{"engines": {model: figures}}``, the shared engines' figures summed over
  their replicas (:mod:`llmbatch.ray_job.engines.engine_stats`, from every node's metrics agent; about
  10 s old).

401 without the credential, 503 while the runs' Redis does not answer. The work of a replica is light
(tokenizing, S3 writes); the generation runs on the engines' own replicas.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import orjson

from llmbatch.ray_job.batch_runner.run_store import BEAT_S, MemoryRuns, RedisRuns, RunStore
from llmbatch.ray_job.batch_runner.runner_attempt import RunnerAttempt, WarmEngine
from llmbatch.ray_job.batch_runner.runner_config import RunnerPlace
from llmbatch.ray_job.batch_runner.runner_http import (
    DEPLOYMENT,
    credential_problem,
    parse_status_ids,
    parse_submission,
    route,
)
from llmbatch.ray_job.engines import tokenizers
from llmbatch.ray_job.engines.backends import keeps_prompt_text, make_tokenizer
from llmbatch.ray_job.engines.engine_figures import engine_figures
from llmbatch.ray_job.engines.tokenizers import Tokenizer
from llmbatch.ray_job.errors import ExitCode, InvalidSpecError
from llmbatch.ray_job.job.engine import Engine
from llmbatch.ray_job.storage import node_secrets
from llmbatch.schemas.common import utcnow
from llmbatch.schemas.job import JobSpec

log = logging.getLogger(__name__)


@dataclass
class Run:
    """One submission as this replica runs it (states and exit codes of the Jobs API)."""

    spec: JobSpec
    attempt: RunnerAttempt
    owner: str
    state: str = "PENDING"
    exit_code: int | None = None
    message: str | None = None
    start_time: float = field(default_factory=time.time)
    end_time: float | None = None

    def view(self) -> dict[str, Any]:
        return {
            "submission_id": self.spec.submission_id,
            "status": self.state,
            "driver_exit_code": self.exit_code,
            "message": self.message,
            "start_time": self.start_time,
            "end_time": self.end_time,
            "owner": self.owner,
        }


class BatchRunner:
    """Runs small batches in threads of its Serve replicas (see the module docstring). ``runs``: where
    the runs are kept (default: Redis at ``place.redis_url``, else this replica's memory)."""

    def __init__(
        self, max_runs: int = 64, *, place: RunnerPlace | None = None, runs: RunStore | None = None
    ) -> None:
        self.max_runs = max_runs
        self.place = place or RunnerPlace()
        self.replica = secrets.token_hex(8)
        self._redis: Any = None  # the client of place.redis_url: the runs' and every batch's progress
        if runs is None and self.place.redis_url is not None:
            from llmbatch.ray_job.storage import job_redis

            client = job_redis.connect(self.place.redis_url, timeout_s=5)
            runs = RedisRuns(client, self.place.key_prefix, self.replica)
            self._redis = client
        self.runs: RunStore = runs if runs is not None else MemoryRuns()
        self._active: dict[str, Run] = {}  # this replica's runs not yet ended and saved
        self._lock = threading.Lock()
        self._locks: dict[object, threading.Lock] = {}
        self._tokenizers: dict[tuple[str, str], Tokenizer] = {}
        self._engines: dict[str, Engine] = {}
        self._closed = threading.Event()
        self._beat_error: str | None = None
        self._beater = threading.Thread(target=self._beat_loop, name="runner-beat", daemon=True)
        self._beater.start()
        # a replica's first batch would wait for the tokenizers' imports (7-8 s on a 2-core CPU node,
        # what a warm engine's batch took outside generation on a replica it was the first of); a
        # batch that comes sooner waits for the same import (Python's import lock), never twice
        threading.Thread(target=tokenizers.preload, name="runner-preload", daemon=True).start()

    # --- HTTP ---------------------------------------------------------------------------------

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import Response

        problem = credential_problem(
            request.headers.get("authorization"), os.environ.get(node_secrets.RUNNER_TOKEN)
        )
        if problem is not None:
            refusal = {"error": problem[1]}
            return Response(orjson.dumps(refusal), status_code=problem[0], media_type="application/json")
        op, sid = route(request.method, request.url.path)
        code: int
        body: dict[str, Any]
        try:
            if op == "submit":
                raw = await request.body()
                code, body = await asyncio.to_thread(self.submit, raw)
            elif op == "status" and sid is not None:
                code, body = await asyncio.to_thread(self.status, sid)
            elif op == "statuses":
                raw = await request.body()
                code, body = await asyncio.to_thread(self.statuses, raw)
            elif op == "stop" and sid is not None:
                code, body = await asyncio.to_thread(self.stop, sid)
            elif op == "engines":
                figures = await asyncio.to_thread(engine_figures, 5.0)
                code, body = 200, {"engines": figures}
            else:
                code, body = 404, {"error": f"no route {request.method} {request.url.path}"}
        except Exception as exc:  # the runs' Redis (or anything else) failed: the caller retries
            log.warning("runner request %s failed: %s", op or "?", type(exc).__name__)
            code, body = 503, {"error": f"the batch runner cannot answer now ({type(exc).__name__})"}
        return Response(orjson.dumps(body), status_code=code, media_type="application/json")

    # --- operations ---------------------------------------------------------------------------

    def submit(self, raw: bytes) -> tuple[int, dict[str, Any]]:
        """Start a run of the spec in ``raw`` (JSON)."""
        try:
            submission = parse_submission(raw)
        except ValueError as exc:
            return 400, {"error": str(exc)[:2000]}
        spec, session = submission.spec, submission.s3_session
        if session is not None and session.expires_at is not None and session.expires_at <= utcnow():
            return 400, {"error": "s3_session: the batch's S3 session has expired; submit with a new one"}
        if spec.engine_app is None:
            return 400, {"error": "engine_app: the batch runner only runs batches on a shared engine"}
        if (problem := self.place.prefix_problem(spec)) is not None:
            return 400, {"error": problem}
        if session is None and node_secrets.is_withheld(node_secrets.S3_ACCESS_KEY):
            return 400, {
                "error": "s3_session: this batch runner was deployed to run batches with S3 keys "
                "of their own and has none of its node's; set "
                "LLMBATCH_DISPATCHER__RUNNER_S3_SESSIONS alike on every dispatcher "
                "(the one that submitted this has it false)"
            }
        try:
            keep_text = keeps_prompt_text(spec.engine.backend)
        except InvalidSpecError as exc:
            return 400, {"error": str(exc)[:2000]}
        spec = self.place.spec_for(spec)
        with self._lock:
            if spec.submission_id in self._active:
                return 200, {"submission_id": spec.submission_id, "already_existed": True}
            if len(self._active) >= self.max_runs:
                return 429, {"error": f"the runner runs {len(self._active)} batches already (max_runs)"}
            attempt = RunnerAttempt(
                spec,
                tokenizer=lambda: self._tokenizer(spec),
                keep_text=keep_text,
                engine=lambda: self._engine(spec),
                s3_session=session,
                # spec_for gave the spec this runner's Redis: its progress shares the runner's client
                redis=self._redis if spec.redis_url == self.place.redis_url else None,
            )
            run = Run(spec, attempt, owner=self.replica)
            self._active[spec.submission_id] = run
        try:
            claimed = self.runs.claim(spec.submission_id, run.view())
        except BaseException:
            with self._lock:
                self._active.pop(spec.submission_id, None)
            raise
        if not claimed:  # another replica (or an earlier life of this one) has it
            with self._lock:
                self._active.pop(spec.submission_id, None)
            return 200, {"submission_id": spec.submission_id, "already_existed": True}
        threading.Thread(
            target=self._execute, args=(run,), name=f"run-{spec.submission_id}"[:60], daemon=True
        ).start()
        return 202, {"submission_id": spec.submission_id, "already_existed": False}

    def status(self, submission_id: str) -> tuple[int, dict[str, Any]]:
        view = self._views([submission_id])[submission_id]
        if view is None:
            return 404, {"error": f"unknown submission {submission_id}"}
        return 200, view

    def statuses(self, raw: bytes) -> tuple[int, dict[str, Any]]:
        """The states of the runs ``raw`` (``{"submission_ids": [...]}``) names; null for unknown ones."""
        try:
            ids = parse_status_ids(raw)
        except ValueError as exc:
            return 400, {"error": str(exc)}
        return 200, {"runs": self._views(ids)}

    def stop(self, submission_id: str) -> tuple[int, dict[str, Any]]:
        run = self._active.get(submission_id)
        if run is not None:
            run.attempt.request_stop("stopped")
            return 200, {"stopped": True}
        asked = self.runs.ask_stop(submission_id)  # its owner polls for it (_beat_loop)
        if asked is None:
            return 404, {"error": f"unknown submission {submission_id}"}
        return 200, {"stopped": asked}

    def close(self) -> None:
        """Stop beating (a test's runner; a replica's ends with its process)."""
        self._closed.set()

    # --- internals ----------------------------------------------------------------------------

    def _views(self, ids: list[str]) -> dict[str, dict[str, Any] | None]:
        """This replica's own runs from memory (they answer through a Redis outage), the rest from the
        store."""
        own = {sid: run.view() for sid in ids if (run := self._active.get(sid)) is not None}
        rest = [sid for sid in ids if sid not in own]
        found: dict[str, dict[str, Any] | None] = dict(own)
        if rest:
            found.update(self.runs.views(rest))
        return {sid: found.get(sid) for sid in ids}

    def _execute(self, run: Run) -> None:
        run.state = "RUNNING"
        self._save(run, once=True)
        try:
            code = run.attempt.run()
        except BaseException as exc:  # never leave a run RUNNING forever
            log.exception("run %s crashed", run.spec.submission_id)
            code, run.message = 1, f"{type(exc).__name__}: {exc}"[:2000]
        else:
            error = (run.attempt.result or {}).get("error")
            if code != 0 and isinstance(error, dict):
                run.message = f"{error.get('code')}: {error.get('message')}"[:2000]
        if code in (ExitCode.ENGINE_UNAVAILABLE, ExitCode.INFRA_UNAVAILABLE):  # a new handle next time
            self._engines.pop(run.spec.engine_app or "", None)
        run.exit_code = code
        run.end_time = time.time()
        run.state = "SUCCEEDED" if code == 0 else "FAILED"
        self._save(run, once=False)
        with self._lock:
            self._active.pop(run.spec.submission_id, None)
        try:
            self.runs.forget(run.spec.submission_id)
        except Exception as exc:  # a stop key left behind expires by itself
            log.warning("run %s: could not drop its stop key: %s", run.spec.submission_id, type(exc).__name__)

    def _save(self, run: Run, *, once: bool) -> None:
        """Record the run's state; the end of a run is retried until the store takes it (until then this
        replica answers for it from memory)."""
        delay = 1.0
        while True:
            try:
                self.runs.save(run.spec.submission_id, run.view())
                return
            except Exception as exc:
                if once or self._closed.is_set():
                    log.warning("run %s: state not saved: %s", run.spec.submission_id, type(exc).__name__)
                    return
                log.warning(
                    "run %s: end not saved (%s), retrying in %.0f s",
                    run.spec.submission_id,
                    type(exc).__name__,
                    delay,
                )
                time.sleep(delay)
                delay = min(delay * 2, 30.0)

    def _beat_loop(self) -> None:
        """Say this replica lives and pass on the stops other replicas took for its runs."""
        while not self._closed.is_set():
            try:
                self.runs.beat()
                active = dict(self._active)
                for sid in self.runs.stops_asked(active):
                    active[sid].attempt.request_stop("stopped")
                problem = None
            except Exception as exc:
                problem = type(exc).__name__
            if problem != self._beat_error:  # once per change of state
                if problem is None:
                    log.info("the runs' store answers again")
                else:
                    log.warning("the runs' store does not answer: %s", problem)
                self._beat_error = problem
            self._closed.wait(BEAT_S)

    def _once(self, cache: dict[Any, Any], key: Any, make: Callable[[], Any]) -> Any:
        """``cache[key]``, made once (in a run's thread, never on the event loop); one lock per key
        so a cold model never holds up the batches of a warm one."""
        found = cache.get(key)
        if found is not None:
            return found
        with self._lock:
            lock = self._locks.setdefault((id(cache), key), threading.Lock())
        with lock:
            found = cache.get(key)
            if found is None:
                found = cache[key] = make()
        return found

    def _tokenizer(self, spec: JobSpec) -> Tokenizer:
        key = (spec.engine.backend, spec.model_path or spec.model)
        tok: Tokenizer = self._once(self._tokenizers, key, lambda: make_tokenizer(*key))
        return tok

    def _engine(self, spec: JobSpec) -> Engine:
        from llmbatch.ray_job.engines.serve_client import ServeEngine

        app = spec.engine_app or ""
        started = time.perf_counter()
        # every batch waits for a replica itself (a cold start when the model scaled to zero or was
        # redeployed since the handle was made), so its manifest reports that wait as engine start
        engine = self._once(self._engines, app, lambda: ServeEngine(app, wait_s=spec.engine_wait_s))
        engine.wait_ready()
        return WarmEngine(engine, waited_s=time.perf_counter() - started, slots=engine.slots)


def build_app(args: dict[str, Any]) -> Any:
    """Serve application builder (``import_path``): ``args`` as
    :func:`~llmbatch.ray_job.batch_runner.runner_config.serve_application` writes them
    (``max_runs``, ``redis_url``, ``key_prefix``, ``results_bucket``)."""
    from ray import serve

    place = RunnerPlace(
        redis_url=str(args["redis_url"]) if args.get("redis_url") else None,
        key_prefix=str(args.get("key_prefix") or "llmbatch"),
        results_bucket=str(args["results_bucket"]) if args.get("results_bucket") else None,
    )
    deployment = cast(Any, serve.deployment)(BatchRunner).options(name=DEPLOYMENT)
    return deployment.bind(int(args.get("max_runs", 64)), place=place)
