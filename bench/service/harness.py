"""The service under benchmark: the stack, one dispatcher process with shared engines on the local model,
a producer client and the results topic of one run (:class:`Service`); it submits batches, waits for
their terminal events and reads their figures. :func:`registry_json` is the engine entry it runs."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from bench.bench_ray_job import input_lines
from bench.service.common import BenchError, Sub, say
from bench.service.ledger import Ledger, Load
from bench.service.scheduling import schedule
from llmbatch.ray_job.engines.backends import FAKE_BACKEND

T = TypeVar("T")

if TYPE_CHECKING:
    from llmbatch.demo.run import DispatcherProcess
    from llmbatch.dispatcher.backends.serve_api import ServeApi
    from llmbatch.dispatcher.settings import DispatcherSettings
    from llmbatch.producer import BatchClient

ROOT = Path(__file__).resolve().parents[2]


def registry_json(args: argparse.Namespace, model_path: str) -> str:
    """``LLMBATCH_ENGINES__MODELS``: the stack's engine entry (``--batch-size`` and
    ``--batches-in-flight`` when given), no idle drop."""
    from llmbatch.schemas.engines import EngineModel, EngineRegistry, ReplicaResources, Scaling
    from llmbatch.schemas.job import EngineConfig
    from llmbatch.stack.dispatcher_env import LOCAL_ENGINE
    from llmbatch.stack.model import SERVED_MODEL

    # unset: the stack's own entry (as `llmbatch stack env` configures it)
    given = {"batch_size": args.batch_size, "batches_in_flight": args.batches_in_flight}
    window = {k: v for k, v in given.items() if v is not None}
    if args.engine == "fake":
        engine = EngineConfig(backend=FAKE_BACKEND, backend_options={"delay_s": args.fake_delay_s}, **window)
    else:
        engine = EngineConfig.model_validate({**LOCAL_ENGINE, **window})
    entry = EngineModel(
        path=model_path,
        engine=engine,
        resources=ReplicaResources(
            num_cpus=(1.0 if args.engine == "vllm" else 0.25) / args.max_replicas,
            omp_threads=args.omp_threads or None,
        ),
        # the engine must not leave between phases (the cold phases drop it on purpose)
        scaling=Scaling(min_replicas=0, max_replicas=args.max_replicas, idle_s=3600),
    )
    if getattr(args, "max_active", None):  # a bench that needs the engine to be the bottleneck
        entry = entry.model_copy(update={"max_active_requests": args.max_active})
    models = EngineRegistry(models={SERVED_MODEL: entry}).model_dump(mode="json", exclude_defaults=True)
    return json.dumps(models["models"])


class Service:
    """The stack, one dispatcher process, a producer client and the results topic of one run."""

    def __init__(self, args: argparse.Namespace, model_path: str) -> None:
        self.args = args
        self.model_path = model_path
        self.tag = uuid.uuid4().hex[:8]
        self.own_stack = args.stack_dir is None
        self.run_dir = (args.stack_dir or ROOT / "run" / f"bench-service-{self.tag}").resolve()
        self.workdir = self.run_dir / "bench"
        self.load = Load()
        self.ledger = Ledger()
        self.proc: DispatcherProcess | None = None
        self.client: BatchClient | None = None
        self.api: ServeApi | None = None
        self.dsettings: DispatcherSettings | None = None
        self.subs: list[Sub] = []
        self.state: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        # read once: under `split` this process itself is pinned, and `normal` must give back every core
        self.cores = os.sched_getaffinity(0)

    # --- up and down ---------------------------------------------------------------------------

    async def start(self) -> dict[str, Any]:
        from llmbatch.demo.run import DispatcherProcess, dispatcher_env
        from llmbatch.dispatcher.backends.serve_api import ServeApi
        from llmbatch.dispatcher.ops.engines_cli import only_llmbatch_env
        from llmbatch.dispatcher.settings import DispatcherSettings
        from llmbatch.producer import BatchClient, ensure_topics
        from llmbatch.stack import manager
        from llmbatch.stack.ports import free_port
        from llmbatch.stack.process import StackError
        from llmbatch.stack.state import StackState

        self._tasks.append(asyncio.create_task(self.load.run()))
        began = time.monotonic()
        if self.own_stack:
            say(f"[stack] starting kafka, redis, minio, ray in {self.run_dir} ...")
            try:
                state = await asyncio.to_thread(manager.up, self.run_dir)
            except StackError as exc:  # a Ray head start can time out on a loaded machine: once more
                say(f"[stack] {exc}; starting what is missing again ...")
                state = await asyncio.to_thread(manager.up, self.run_dir)
        else:
            state = StackState.load(self.run_dir)
            missing = [n for n in manager.ALL_SERVICES if n not in state.services]
            if missing:
                raise BenchError(f"{', '.join(missing)} not recorded in {self.run_dir}")
        stack_s = time.monotonic() - began
        self.state = state
        port = free_port()
        env = dispatcher_env(state, Path(self.model_path), port)
        registry = registry_json(self.args, self.model_path)
        env.update(
            {
                "LLMBATCH_ENGINES__MODELS": registry,
                "LLMBATCH_DISPATCHER__INSTANCE_ID": f"bench-{self.tag}",
                "LLMBATCH_DISPATCHER__GROUP_ID": f"bench-{self.tag}",
                "LLMBATCH_REDIS__KEY_PREFIX": f"bench{self.tag}",
                # this run's own topics: another dispatcher on a shared stack never sees its batches
                "LLMBATCH_KAFKA__TOPICS__REQUESTS": f"bench-{self.tag}.requests",
                "LLMBATCH_KAFKA__TOPICS__RESULTS": f"bench-{self.tag}.results",
                "LLMBATCH_KAFKA__TOPICS__DEAD_LETTER": f"bench-{self.tag}.requests.dlt",
            }
        )
        with only_llmbatch_env(env):
            self.dsettings = DispatcherSettings(_env_file=None)
        self.api = ServeApi(self.dsettings.ray.address, timeout_s=120)
        self.workdir.mkdir(parents=True, exist_ok=True)
        say(f"[dispatcher] starting (log {self.run_dir / 'logs' / 'bench-dispatcher.log'}) ...")
        self.proc = DispatcherProcess(env, self.run_dir / "logs" / "bench-dispatcher.log", port)
        ready_s = await asyncio.to_thread(self.proc.wait_ready, 300.0)
        self.client = BatchClient(manager.settings_for(state, self.dsettings))
        await self.client.ensure_buckets()
        await ensure_topics(self.client.settings)
        self.ledger.task = asyncio.create_task(self.ledger.follow(self.client))
        self._tasks.append(self.ledger.task)
        return {
            "stack_up_s": round(stack_s, 1),
            "dispatcher_ready_s": round(ready_s, 1),
            "dispatcher_pid": self.proc.proc.pid,
            "run_dir": str(self.run_dir),
            "engines": json.loads(registry),
        }

    async def running(self, work: Callable[[], Awaitable[T]]) -> T:
        """``work()``'s result; the dispatcher's log tail is printed when it fails, and everything this
        run started is stopped either way."""
        try:
            return await work()
        except BaseException:
            if self.proc is not None:
                say(f"--- dispatcher log tail\n{self.proc.tail()}")
            raise
        finally:
            await self.stop()

    async def stop(self) -> None:
        from llmbatch.stack import manager

        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.client is not None:
            await self.client.close()
        if self.proc is not None:
            rc = await asyncio.to_thread(self.proc.stop)
            say(f"[dispatcher] stopped (exit {rc})")
        if self.own_stack and not self.args.keep:
            stopped = await asyncio.to_thread(manager.down, self.run_dir)
            say(f"[stack] stopped: {', '.join(stopped)}")
        elif self.api is not None and self.dsettings is not None:
            # a stack we did not start: remove our Serve apps (the engine holds GBs), keep the rest up
            from llmbatch.dispatcher.backends.engines import serve_config
            from llmbatch.schemas.engines import EngineRegistry

            with contextlib.suppress(Exception):
                await self.api.deploy(
                    serve_config(EngineRegistry(models={}), http_address=self.dsettings.ray.serve_address)
                )

    def scheduling(self, mode: str) -> dict[str, int]:
        """Experiment: the CPU scheduling of this run's processes (the Ray head's session and the
        sessions of Kafka, Redis, MinIO, the dispatcher and this bench). ``normal``: all SCHED_OTHER,
        autogroup nice 0. ``nice19``: the sessions but the Ray head's at autogroup nice 19.
        ``batch-out``: every thread but the engine replicas' SCHED_BATCH (a SCHED_BATCH thread never
        preempts a running one when it wakes). ``batch``: that, and the replicas' gloo loop threads.
        ``both``: ``batch`` and ``nice19``. ``split``: the engine replicas' threads on the last core
        of this process' affinity, every other thread on the remaining ones (the default: all of them;
        threads started later inherit their parent thread's)."""
        return schedule(mode, self.cores, self.state, None if self.proc is None else self.proc.proc.pid)

    def need(self) -> tuple[BatchClient, DispatcherProcess, ServeApi, DispatcherSettings]:
        if self.client is None or self.proc is None or self.api is None or self.dsettings is None:
            raise BenchError("the service is not started")
        return self.client, self.proc, self.api, self.dsettings

    # --- the engine ----------------------------------------------------------------------------

    async def cold(self) -> float:
        """Drop the model's engine (its Serve app) and deploy it again at zero replicas, as the
        dispatcher deployed it; the batch runner stays. Returns the seconds it took."""
        from llmbatch.dispatcher.backends.engines import cluster_serve_config, summarize, without
        from llmbatch.ray_job.batch_runner.runner_http import APP_NAME
        from llmbatch.stack.model import SERVED_MODEL

        _, _, api, dsettings = self.need()
        began = time.monotonic()
        registry = dsettings.engines
        await api.deploy(cluster_serve_config(dsettings, without(registry, SERVED_MODEL)))
        await self._serve_until(
            lambda d: summarize(registry, d)[0].status == "NOT_DEPLOYED", "engine removed"
        )
        await api.deploy(cluster_serve_config(dsettings))

        def ready(details: dict[str, Any]) -> bool:
            row = summarize(registry, details)[0]
            if row.status == "DEPLOY_FAILED":
                raise BenchError(f"the engine app failed to deploy: {row.message}")
            runner = ((details.get("applications") or {}).get(APP_NAME) or {}).get("status")
            return row.status == "RUNNING" and row.running == 0 and runner == "RUNNING"

        await self._serve_until(ready, "engine deployed at zero replicas")
        return time.monotonic() - began

    async def _serve_until(
        self, check: Callable[[dict[str, Any]], bool], what: str, within: float = 600.0
    ) -> None:
        _, _, api, _ = self.need()
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if check(await api.status()):
                return
            await asyncio.sleep(1)
        raise BenchError(f"Serve: no {what} within {within:.0f} s")

    # --- batches -------------------------------------------------------------------------------

    async def submit(
        self,
        texts: list[str],
        *,
        priority: int,
        name: str,
        deadline: datetime | None = None,
        tenant: str = "default",
    ) -> Sub:
        from llmbatch.stack.model import SERVED_MODEL

        client, _, _, dsettings = self.need()
        lines = input_lines(texts, self.args.max_tokens)
        batch_id = f"bench-{name}-{uuid.uuid4().hex[:8]}"
        submitted = time.time()
        # inline up to the short path's line limit, a file above it (an inline batch over the limit
        # would run as a Ray job; a file of at most short_path_max_bytes takes the short path)
        if len(lines) <= dsettings.dispatcher.short_path_max_lines:
            handle = await client.submit(
                lines,
                model=SERVED_MODEL,
                batch_id=batch_id,
                priority=priority,
                deadline=deadline,
                tenant=tenant,
            )
        else:
            path = self.workdir / f"{batch_id}.jsonl"
            path.write_text("".join(json.dumps(line) + "\n" for line in lines))
            handle = await client.submit(
                file=path,
                model=SERVED_MODEL,
                batch_id=batch_id,
                priority=priority,
                deadline=deadline,
                tenant=tenant,
            )
        sub = Sub(handle.batch_id, len(lines), priority, submitted)
        self.subs.append(sub)
        return sub

    async def wait(self, subs: list[Sub], what: str) -> None:
        _, proc, _, _ = self.need()
        await self.ledger.until(
            lambda: all(s.batch_id in self.ledger.terminal for s in subs),
            self.args.timeout,
            proc,
            f"terminal events of {what}",
        )

    async def under_way(self, sub: Sub, what: str) -> None:
        """Until ``sub`` has answered lines (its progress) or ended."""
        _, proc, _, _ = self.need()
        await self.ledger.until(
            lambda: self.ledger.progress.get(sub.batch_id, 0) > 0 or sub.batch_id in self.ledger.terminal,
            self.args.timeout,
            proc,
            f"progress of {what}",
        )

    async def phase(self, name: str, batches: list[tuple[list[str], int]]) -> dict[str, Any]:
        """Submit ``batches`` (texts, priority) at once; wait for all; their figures."""
        subs = await asyncio.gather(
            *(
                self.submit(texts, priority=priority, name=f"{name}{i}")
                for i, (texts, priority) in enumerate(batches)
            )
        )
        await self.wait(list(subs), name)
        return await self.figures(list(subs))

    async def figures(self, subs: list[Sub], *, cancelled_ok: bool = False) -> dict[str, Any]:
        from llmbatch.schemas.events import EventType

        client, _, _, _ = self.need()
        rows: list[dict[str, Any]] = []
        for sub in subs:
            done = self.ledger.terminal[sub.batch_id]
            data = done.data
            ok = done.type is EventType.COMPLETED or (cancelled_ok and done.type is EventType.CANCELLED)
            if not ok or (done.type is EventType.COMPLETED and data.request_counts.failed):
                raise BenchError(
                    f"{sub.batch_id} ended {done.type.value}: {data.request_counts} {data.error}"
                )
            accepted = self.ledger.accepted.get(sub.batch_id)
            accepted_t = accepted.time.timestamp() if accepted is not None else data.accepted_at.timestamp()
            manifest = await client.manifest(sub.batch_id, tenant=data.tenant)
            rows.append(
                {
                    "batch_id": sub.batch_id,
                    "status": str(data.status),
                    "lines": sub.lines,
                    "completed": data.request_counts.completed,
                    "output_tokens": data.usage.completion_tokens,
                    "submit_to_accepted_s": round(accepted_t - sub.submitted, 3),
                    "accepted_to_terminal_s": round(done.time.timestamp() - accepted_t, 3),
                    "submit_to_terminal_s": round(done.time.timestamp() - sub.submitted, 3),
                    "generation_s": manifest.timings.generation_s,
                    "engine_start_s": manifest.timings.engine_start_s,
                }
            )
        first = min(s.submitted for s in subs)
        last = max(self.ledger.terminal[s.batch_id].time.timestamp() for s in subs)
        tokens = sum(r["output_tokens"] for r in rows)
        return {
            "batches": len(rows),
            "lines": sum(r["lines"] for r in rows),
            "wall_s": round(last - first, 2),  # first submit -> last terminal event
            "output_tokens": tokens,
            "tokens_per_s": round(tokens / (last - first), 1),
            # the runner measures the wait for a replica only when it first meets the model: after the
            # engine was dropped and deployed again the manifest says ~0 and the start is in generation_s
            "max_engine_start_s": max((r["engine_start_s"] or 0.0) for r in rows),
            "load1": self.load.window(first, last),
            "rows": rows,
        }

    async def routes(self) -> dict[str, int]:
        """How the batches ran: on the batch runner (short path) or as a Ray job each."""
        from ray.job_submission import JobSubmissionClient

        _, _, _, dsettings = self.need()
        jobs = await asyncio.to_thread(JobSubmissionClient(dsettings.ray.address).list_jobs)
        ids = {j.submission_id for j in jobs}
        as_job = sum(f"{s.batch_id}-a1" in ids for s in self.subs)
        return {"short_path": len(self.subs) - as_job, "ray_job": as_job}


def run_main(
    args: argparse.Namespace,
    measure: Callable[[Service, argparse.Namespace], Awaitable[dict[str, Any]]],
    show: Callable[[dict[str, Any]], None],
) -> int:
    """A service bench's ``main``: ``measure`` on a :class:`Service` of ``args`` (everything it started
    stopped either way), then its report: ``total_s`` added, written to ``args.report`` if given, printed
    as JSON (``args.json``) or by ``show``. The private run folder goes after a successful run unless
    ``args.keep``. 1 when the bench could not finish."""
    from llmbatch.stack.model import ensure_model
    from llmbatch.stack.process import StackError

    svc = Service(args, str(ensure_model()))
    began = time.monotonic()
    try:
        report = asyncio.run(svc.running(lambda: measure(svc, args)))
    except (BenchError, StackError) as exc:
        say(f"error: {exc}")
        return 1
    report["total_s"] = round(time.monotonic() - began, 1)
    if svc.own_stack and not args.keep:
        shutil.rmtree(svc.run_dir, ignore_errors=True)
    if args.report is not None:
        args.report.write_text(json.dumps(report, indent=2, default=str) + "\n")
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        show(report)
    return 0
