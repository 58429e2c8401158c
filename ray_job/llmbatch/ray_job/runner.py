"""The short path: small batches run inside a long-lived Serve replica, not as a Ray job each.

A Ray job per batch costs 15-20 s before the first request reaches a warm engine on these
machines (driver process, ``ray.init``, Ray Data actor pools, a first handle to the engine). The
batch runner keeps all of that warm: one Serve application (``llmbatch-runner``, behind Serve's
HTTP proxy) whose replica holds the tokenizers and the engine handles, and runs each batch it is
given in a thread of its own. A batch keeps everything the job path gives it: the same reader,
prompt and engine stages, shards, manifest, progress and heartbeats in Redis, resume after a lost
attempt, stop and deadline (checked between blocks of ``engine.batch_size`` lines).

HTTP (for the dispatcher, which is not a Ray driver), under the route prefix (parsed in
:mod:`llmbatch.ray_job.runner_http`):

- ``POST /runs`` with a :class:`~llmbatch.schemas.job.JobSpec` as JSON: 202 (started) or 200 (that
  submission id is known already), 400 for a spec that does not parse, 429 when the replica runs
  ``max_runs`` batches already;
- ``GET /runs/<submission_id>``: 200 with the run's state (the Jobs API's states and exit codes),
  404 when this replica does not know it (never given, or the replica was replaced: the dispatcher
  treats that as a lost job and retries);
- ``POST /statuses`` with ``{"submission_ids": [...]}`` (at most
  :data:`~llmbatch.ray_job.runner_http.MAX_STATUS_IDS`): 200
  ``{"runs": {submission_id: state or null}}``, the states of many runs in one request (null: unknown);
- ``POST /runs/<submission_id>/stop``: 200 ``{"stopped": bool}``, 404 when unknown;
- ``GET /engines``: 200 ``{"engines": {model: figures}}``, the shared engines' figures summed over
  their replicas (:mod:`llmbatch.ray_job.engine_stats`, from every node's metrics agent; about 10 s old).

One replica (the runs live in its memory); its work is light (tokenizing, S3 writes), the
generation runs on the engines' own replicas.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, cast

import orjson

from llmbatch.ray_job import node_secrets, rows
from llmbatch.ray_job.backends import keeps_prompt_text, make_tokenizer
from llmbatch.ray_job.engine import Engine, EngineStage
from llmbatch.ray_job.engine_stats import summarize_metrics
from llmbatch.ray_job.errors import ExitCode, InvalidSpecError
from llmbatch.ray_job.main import Attempt, StopRequested
from llmbatch.ray_job.memory import MemoryPeak
from llmbatch.ray_job.outcome import SUPERSEDED
from llmbatch.ray_job.pipeline import source_of
from llmbatch.ray_job.prompts import build_rows
from llmbatch.ray_job.reader import iter_blocks
from llmbatch.ray_job.records import Generation, GenRequest
from llmbatch.ray_job.runner_http import (
    APP_NAME,
    DEPLOYMENT,
    ROUTE_PREFIX,
    parse_status_ids,
    parse_submission,
    route,
)
from llmbatch.ray_job.tokenizers import Tokenizer
from llmbatch.schemas.batch import DEFAULT_PRIORITY
from llmbatch.schemas.common import utcnow
from llmbatch.schemas.job import JobSpec, S3Session

log = logging.getLogger(__name__)

IMPORT_PATH = "llmbatch.ray_job.runner:build_app"
# how long a finished run stays answerable (the dispatcher polls every second or so)
KEEP_FINISHED_S = 3600.0


class RunnerAttempt(Attempt):
    """An attempt run in a thread of the runner: no signals, no Ray Data, a warm engine."""

    def __init__(
        self,
        spec: JobSpec,
        *,
        tokenizer: Callable[[], Tokenizer],
        keep_text: bool,
        engine: Callable[[], Engine],
        s3_session: S3Session | None = None,
    ) -> None:
        super().__init__(spec, utcnow(), session=s3_session)  # the batch's own keys, else the node's
        # the runner's process is every run's: no figure of its own
        self.memory_peak = MemoryPeak(sample=None)
        self._tokenizer = tokenizer
        self._keep_text = keep_text
        self._engine = engine
        self._stop = threading.Event()
        self._timer: threading.Timer | None = None

    def request_stop(self, reason: str) -> None:
        """Stop at the next block boundary (``deadline``, ``stopped``, ``superseded``), keeping what
        finished."""
        self.stop_reason = self.stop_reason or reason
        self._stop.set()

    def _superseded(self) -> None:  # a thread of the runner: no signal, the stop flag
        self.request_stop(SUPERSEDED)

    def _install_stop(self) -> None:
        if self.spec.deadline is not None:
            left = (self.spec.deadline - utcnow()).total_seconds()
            self._timer = threading.Timer(max(left, 0.0), self.request_stop, args=("deadline",))
            self._timer.daemon = True
            self._timer.start()

    def _ignore_stops(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _check_stop(self) -> None:
        if self._stop.is_set():
            raise StopRequested(self.stop_reason)

    def _run_pipeline(self, input_path: str | None) -> None:
        spec = self.spec
        tokenizer = self._tokenizer()
        stage = EngineStage.on(
            self._engine(),
            endpoint=spec.endpoint.value,
            batch_id=spec.batch_id,
            model=spec.model,
            group=spec.engine_group,
            priority=spec.priority,
        )
        source = source_of(spec, self.prior.done_shards, input_path=input_path)
        in_flight = max(1, spec.engine.batches_in_flight)
        pool = ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix=f"run-{spec.batch_id}"[:40])
        pending: deque[Future[list[rows.Row]]] = deque()
        try:
            for block in iter_blocks(source, self.fs):
                self._check_stop()
                prompted = build_rows(
                    tokenizer, spec.endpoint, block, batch_id=spec.batch_id, keep_text=self._keep_text
                )
                pending.append(pool.submit(stage.process, prompted))
                while len(pending) >= in_flight:
                    self._take(pending.popleft())
            while pending:
                self._take(pending.popleft())
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        self.pipeline_done = True

    def _take(self, future: Future[list[rows.Row]]) -> None:
        while True:
            self._check_stop()
            try:
                finished = future.result(timeout=0.25)
            except FutureTimeout:
                continue
            self.consume(finished)
            for writer in self.writers.values():
                writer.roll_if_old()
            return


class WarmEngine:
    """A batch's view of a cached engine: its own wait for it (zero when it was warm)."""

    def __init__(self, engine: Engine, *, waited_s: float) -> None:
        self._engine = engine
        self.max_model_len = engine.max_model_len
        self.default_max_tokens = engine.default_max_tokens
        self.engine_start_s = waited_s
        self.ready_at = time.time()

    def generate(
        self, requests: list[GenRequest], *, group: str = "", priority: int = DEFAULT_PRIORITY
    ) -> list[Generation]:
        return self._engine.generate(requests, group=group, priority=priority)


@dataclass
class Run:
    """One submission as the runner tracks it (states and exit codes of the Jobs API)."""

    spec: JobSpec
    attempt: RunnerAttempt
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
        }


class BatchRunner:
    """Runs small batches in threads of one Serve replica (see the module docstring)."""

    def __init__(self, max_runs: int = 64) -> None:
        self.max_runs = max_runs
        self._runs: dict[str, Run] = {}
        self._lock = threading.Lock()
        self._locks: dict[object, threading.Lock] = {}
        self._tokenizers: dict[tuple[str, str], Tokenizer] = {}
        self._engines: dict[str, Engine] = {}

    # --- HTTP ---------------------------------------------------------------------------------

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import Response

        op, sid = route(request.method, request.url.path)
        if op == "submit":
            code, body = self.submit(await request.body())
        elif op == "status" and sid is not None:
            code, body = self.status(sid)
        elif op == "statuses":
            code, body = self.statuses(await request.body())
        elif op == "stop" and sid is not None:
            code, body = self.stop(sid)
        elif op == "engines":
            code, body = 200, {"engines": await asyncio.to_thread(engine_figures)}
        else:
            code, body = 404, {"error": f"no route {request.method} {request.url.path}"}
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
        with self._lock:
            self._prune()
            if spec.submission_id in self._runs:
                return 200, {"submission_id": spec.submission_id, "already_existed": True}
            active = sum(1 for r in self._runs.values() if r.end_time is None)
            if active >= self.max_runs:
                return 429, {"error": f"the runner runs {active} batches already (max_runs)"}
            attempt = RunnerAttempt(
                spec,
                tokenizer=lambda: self._tokenizer(spec),
                keep_text=keep_text,
                engine=lambda: self._engine(spec),
                s3_session=session,
            )
            run = Run(spec, attempt)
            self._runs[spec.submission_id] = run
        threading.Thread(
            target=self._execute, args=(run,), name=f"run-{spec.submission_id}"[:60], daemon=True
        ).start()
        return 202, {"submission_id": spec.submission_id, "already_existed": False}

    def status(self, submission_id: str) -> tuple[int, dict[str, Any]]:
        run = self._runs.get(submission_id)
        if run is None:
            return 404, {"error": f"unknown submission {submission_id}"}
        return 200, run.view()

    def statuses(self, raw: bytes) -> tuple[int, dict[str, Any]]:
        """The states of the runs ``raw`` (``{"submission_ids": [...]}``) names; null for unknown ones."""
        try:
            ids = parse_status_ids(raw)
        except ValueError as exc:
            return 400, {"error": str(exc)}
        runs = {sid: run.view() if (run := self._runs.get(sid)) is not None else None for sid in ids}
        return 200, {"runs": runs}

    def stop(self, submission_id: str) -> tuple[int, dict[str, Any]]:
        run = self._runs.get(submission_id)
        if run is None:
            return 404, {"error": f"unknown submission {submission_id}"}
        if run.end_time is not None:
            return 200, {"stopped": False}
        run.attempt.request_stop("stopped")
        return 200, {"stopped": True}

    # --- internals ----------------------------------------------------------------------------

    def _execute(self, run: Run) -> None:
        run.state = "RUNNING"
        try:
            code = run.attempt.run()
        except BaseException as exc:  # never leave a run RUNNING forever
            log.exception("run %s crashed", run.spec.submission_id)
            code, run.message = 1, f"{type(exc).__name__}: {exc}"[:2000]
        else:
            error = (run.attempt.result or {}).get("error")
            if code != 0 and isinstance(error, dict):
                run.message = f"{error.get('code')}: {error.get('message')}"[:2000]
        if code == ExitCode.ENGINE_UNAVAILABLE:  # ask for the engine again next time
            self._engines.pop(run.spec.engine_app or "", None)
        run.exit_code = code
        run.end_time = time.time()
        run.state = "SUCCEEDED" if code == 0 else "FAILED"

    def _prune(self) -> None:
        horizon = time.time() - KEEP_FINISHED_S
        for sid in [s for s, r in self._runs.items() if r.end_time is not None and r.end_time < horizon]:
            del self._runs[sid]

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
        from llmbatch.ray_job.serve_engine import ServeEngine

        app = spec.engine_app or ""
        started = time.perf_counter()
        # every batch waits for a replica itself (a cold start when the model scaled to zero or was
        # redeployed since the handle was made), so its manifest reports that wait as engine start
        engine = self._once(self._engines, app, lambda: ServeEngine(app, wait_s=spec.engine_wait_s))
        engine.wait_ready()
        return WarmEngine(engine, waited_s=time.perf_counter() - started)


def engine_figures(timeout_s: float = 5.0) -> dict[str, dict[str, Any]]:
    """The shared engines' figures per model, from the metrics agent of every live node."""
    import urllib.request

    import ray

    texts = []
    for node in ray.nodes():  # type: ignore[no-untyped-call]
        port = node.get("MetricsExportPort")
        if not node.get("Alive") or not port:
            continue
        url = f"http://{node['NodeManagerAddress']}:{port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp:
                texts.append(resp.read().decode("utf-8", "replace"))
        except OSError as exc:
            log.warning("no metrics from node %s: %s", node.get("NodeManagerAddress"), exc)
    return {model: f.as_dict() for model, f in summarize_metrics(texts).items()}


def serve_application(
    *, max_runs: int, env_vars: dict[str, str] | None = None, num_cpus: float = 0.2
) -> dict[str, Any]:
    """The runner's entry in a Serve config (HTTP route :data:`ROUTE_PREFIX`, one replica)."""
    app: dict[str, Any] = {
        "name": APP_NAME,
        "route_prefix": ROUTE_PREFIX,
        "import_path": IMPORT_PATH,
        "args": {"max_runs": max_runs},
        "deployments": [
            {
                "name": DEPLOYMENT,
                "num_replicas": 1,
                "max_ongoing_requests": 256,
                "ray_actor_options": {"num_cpus": num_cpus},
            }
        ],
        # the dispatcher polls every run about once a second: no access-log line per poll
        "logging_config": {"enable_access_log": False},
    }
    if env_vars:
        app["runtime_env"] = {"env_vars": dict(env_vars)}
    return app


def build_app(args: dict[str, Any]) -> Any:
    """Serve application builder (``import_path``): ``args = {"max_runs": N}``."""
    from ray import serve

    deployment = cast(Any, serve.deployment)(BatchRunner).options(name=DEPLOYMENT)
    return deployment.bind(int(args.get("max_runs", 64)))
