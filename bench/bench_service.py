"""Benchmark: the issue-11 figures through the real service (Kafka -> dispatcher -> Redis -> Ray Serve
batch runner + shared engine -> MinIO -> results topic), real vLLM on CPU, one run.

    .venv/bin/python bench/bench_service.py [--engine vllm|fake] [--small 16] [--per-batch 8]
        [--warm-runs 10] [--conc 4] [--conc-size 128] [--big 2000] [--cancel-big]
        [--skip ab,throughput,fairness,plain,plain-procs] [--stack-dir DIR] [--json] [--report PATH]
        [--background normal,nice19,batch-out,batch,both,split] [--plain-cpus 1]

Starts a private local stack (``llmbatch stack up`` in ``run/bench-service-<tag>``; ``--stack-dir``
uses a running one instead and leaves it up), a dispatcher process with shared engines on the local
model (as ``make demo`` does), submits batches with the producer SDK and reads every figure from the
results topic: the accepted and terminal events' ``ce_time`` (set by the dispatcher) and the
manifest's ``generation_s``. Batches of at most ``short_path_max_lines`` lines go inline, bigger ones
as a file (both take the short path: the batch runner on the shared engine; the report says which
batches ran as a Ray job instead).

- warm-up: one small batch (engine start, tokenizer, compile caches), then the engine is dropped.
- A/B: ``--small`` batches of ``--per-batch`` prompts at once (A) vs one batch of the same prompts
  (B), each with the engine at zero replicas (the model's Serve app removed and deployed again):
  first submit -> last terminal event. Target A/B <= 1.5.
- warm: a ``--per-batch`` batch (priority 9) on the warm engine, ``--warm-runs`` times, one after
  another: accepted -> terminal minus the manifest's generation time, p50. Target <= 3 s.
- throughput: ``--conc`` batches of ``--conc-size`` prompts at once vs one batch of all of them vs
  plain ``vllm.LLM.chat`` on the same prompts (bench_ray_job's worker, a fresh process after the
  stack is down, run twice: with the engine environment the service's engine has, and with vLLM's own
  CPU processes, ``VLLM_ENABLE_V1_MULTIPROCESSING=1``): output tokens / (first submit -> last
  terminal); plain: tokens / ``llm.chat`` time. Target >= 0.9x one batch and the faster plain run.
  The cores each process of the machine used during the 4 x 128 phase are printed beside it, and each
  one's wake-ups and preemptions per second (context switches summed over its threads): an engine's
  OpenMP threads stall at every barrier one of them is preempted at. The plain runs report their own.
- ``--background``: the throughput phase once per scheduling of the run's processes, in the order
  given (see :meth:`Service.scheduling`; an experiment, the stack keeps the default afterwards).
  ``split`` gives the engine replica the last core alone and the rest of the service the others, as a
  GPU worker pod has its cores to itself; compare it with ``--plain-cpus`` (plain vLLM on those cores
  alone) and ``--omp-threads`` set to their count.
- fairness: a ``--big``-line priority-0 batch, and once it makes progress the warm runs' batch at
  priority 9: its accepted -> terminal vs the warm runs' median (the idle engine). Target <= 2x.

The engine is the local stack's registry entry (``max_num_batched_tokens`` 512, eager, bf16) with
``--batch-size`` x ``--batches-in-flight`` lines of a batch at the engine at once. Prints figures,
ratios and the 1-minute load average of each phase. Everything started is stopped by PID (the private
run folder is removed after a successful run). The defaults with ``--cancel-big`` took 21 min on 2
cores shared with other work; ``--engine fake`` with small sizes checks the plumbing in ~5 min. Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.bench_ray_job import input_lines, prompts, run_plain  # noqa: E402
from llmbatch.stack.dispatcher_env import local_engine_threads  # noqa: E402

if TYPE_CHECKING:
    from dispatcher.serve_api import ServeApi
    from dispatcher.settings import DispatcherSettings
    from llmbatch.demo import DispatcherProcess
    from producer import BatchClient
    from schemas.cloudevents import Envelope

PHASES = ("ab", "throughput", "fairness", "plain", "plain-procs")
SCHEDULINGS = ("normal", "nice19", "batch-out", "batch", "both", "split")
"""``--background`` modes (:meth:`Service.scheduling`)."""


class BenchError(Exception):
    """The run cannot go on; the dispatcher's log tail is printed with it."""


@dataclass
class Sub:
    """One submitted batch."""

    batch_id: str
    lines: int
    priority: int
    submitted: float  # wall clock just before the SDK call


class Load:
    """Samples the 1-minute load average every 2 s, for the figures of each phase."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []

    async def run(self) -> None:
        while True:
            self.samples.append((time.time(), os.getloadavg()[0]))
            await asyncio.sleep(2)

    def window(self, start: float, end: float) -> dict[str, float]:
        values = [v for t, v in self.samples if start <= t <= end] or [os.getloadavg()[0]]
        return {"mean": round(statistics.fmean(values), 2), "max": round(max(values), 2)}


class Ledger:
    """Every event of the run's results topic, kept by batch: accepted, last progress, terminal."""

    def __init__(self) -> None:
        self.accepted: dict[str, Envelope[Any]] = {}
        self.terminal: dict[str, Envelope[Any]] = {}
        self.progress: dict[str, int] = {}
        self.changed = asyncio.Condition()
        self.task: asyncio.Task[None] | None = None

    async def follow(self, client: BatchClient) -> None:
        from schemas.events import EventType

        async with aclosing(client.events(stop_at_terminal=False)) as stream:
            async for envelope in stream:
                batch_id = envelope.batch_id
                if envelope.type is EventType.ACCEPTED:
                    self.accepted.setdefault(batch_id, envelope)
                elif envelope.is_terminal:
                    self.terminal.setdefault(batch_id, envelope)
                elif envelope.type is EventType.PROGRESS:
                    counts = envelope.data.request_counts
                    self.progress[batch_id] = counts.completed + counts.failed
                async with self.changed:
                    self.changed.notify_all()

    async def until(self, check: Callable[[], bool], within: float, proc: DispatcherProcess,
                    what: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        async with self.changed:
            while not check():
                if self.task is not None and self.task.done():
                    raise BenchError(f"following the results topic ended: {self.task.exception()!r}")
                if not proc.alive():
                    raise BenchError(f"the dispatcher exited ({proc.proc.returncode}) waiting for {what}")
                left = deadline - loop.time()
                if left <= 0:
                    raise BenchError(f"no {what} within {within:.0f} s")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), min(left, 2.0))


def registry_json(args: argparse.Namespace, model_path: str) -> str:
    """``LLMBATCH_ENGINES__MODELS``: the stack's engine entry, this run's batch window, no idle drop."""
    from llmbatch.stack.dispatcher_env import LOCAL_ENGINE
    from llmbatch.stack.model import SERVED_MODEL
    from schemas.engines import EngineModel, EngineRegistry, ReplicaResources, Scaling
    from schemas.job import EngineConfig

    window = {"batch_size": args.batch_size, "batches_in_flight": args.batches_in_flight}
    if args.engine == "fake":
        engine = EngineConfig(backend="fake", fake_delay_s=args.fake_delay_s, **window)
    else:
        engine = EngineConfig.model_validate({**LOCAL_ENGINE, **window})
    entry = EngineModel(
        path=model_path,
        engine=engine,
        resources=ReplicaResources(num_cpus=1.0 if args.engine == "vllm" else 0.25,
                                   omp_threads=args.omp_threads or None),
        # the engine must not leave between phases (the cold phases drop it on purpose)
        scaling=Scaling(min_replicas=0, max_replicas=1, idle_s=3600),
    )
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
        from dispatcher.ops.engines_cli import only_llmbatch_env
        from dispatcher.serve_api import ServeApi
        from dispatcher.settings import DispatcherSettings
        from llmbatch.demo import DispatcherProcess, dispatcher_env
        from llmbatch.stack import manager
        from llmbatch.stack.process import StackError, free_port
        from llmbatch.stack.state import StackState
        from producer import BatchClient, ensure_topics

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
        env.update({
            "LLMBATCH_ENGINES__MODELS": registry,
            "LLMBATCH_DISPATCHER__INSTANCE_ID": f"bench-{self.tag}",
            "LLMBATCH_DISPATCHER__GROUP_ID": f"bench-{self.tag}",
            "LLMBATCH_REDIS__KEY_PREFIX": f"bench{self.tag}",
            # this run's own topics: another dispatcher on a shared stack never sees its batches
            "LLMBATCH_KAFKA__TOPICS__REQUESTS": f"bench-{self.tag}.requests",
            "LLMBATCH_KAFKA__TOPICS__RESULTS": f"bench-{self.tag}.results",
            "LLMBATCH_KAFKA__TOPICS__DEAD_LETTER": f"bench-{self.tag}.requests.dlt",
        })
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
        return {"stack_up_s": round(stack_s, 1), "dispatcher_ready_s": round(ready_s, 1),
                "dispatcher_pid": self.proc.proc.pid, "run_dir": str(self.run_dir),
                "engines": json.loads(registry)}

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
            from dispatcher.engines import serve_config
            from schemas.engines import EngineRegistry

            with contextlib.suppress(Exception):
                await self.api.deploy(serve_config(EngineRegistry(models={}),
                                                   http_address=self.dsettings.ray.serve_address))

    def scheduling(self, mode: str) -> dict[str, int]:
        """Experiment: the CPU scheduling of this run's processes (the Ray head's session and the
        sessions of Kafka, Redis, MinIO, the dispatcher and this bench). ``normal``: all SCHED_OTHER,
        autogroup nice 0. ``nice19``: the sessions but the Ray head's at autogroup nice 19.
        ``batch-out``: every thread but the engine replicas' SCHED_BATCH (a SCHED_BATCH thread never
        preempts a running one when it wakes). ``batch``: that, and the replicas' gloo loop threads.
        ``both``: ``batch`` and ``nice19``. ``split``: the engine replicas' threads on the last core
        of this process' affinity, every other thread on the remaining ones (the default: all of them;
        threads started later inherit their parent thread's)."""
        import psutil

        engine_cores, other_cores = core_split(self.cores, mode)

        ray_sid = os.getsid(self.state.services["ray"].pid)
        others = [r.pid for n, r in self.state.services.items() if n != "ray"]
        if self.proc is not None:
            others.append(self.proc.proc.pid)
        others.append(os.getpid())
        other_sids = {os.getsid(p) for p in others}
        counts = {"threads_batch": 0, "threads_other": 0, "sessions_niced": 0}
        for proc in psutil.process_iter(["cmdline"]):
            try:
                sid = os.getsid(proc.pid)
            except OSError:
                continue
            if sid != ray_sid and sid not in other_sids:
                continue
            engine = (proc.info["cmdline"] or [""])[0].startswith("ray::ServeReplica:llmbatch-engine")
            if proc.pid in others:
                with contextlib.suppress(OSError):
                    Path(f"/proc/{proc.pid}/autogroup").write_text(
                        "19\n" if mode in ("nice19", "both") else "0\n")
                    counts["sessions_niced"] += mode in ("nice19", "both")
            for tid_dir in Path(f"/proc/{proc.pid}/task").glob("*"):
                with contextlib.suppress(OSError, ValueError):
                    tid = int(tid_dir.name)
                    comm = (tid_dir / "comm").read_text().strip()
                    batch = mode in ("batch", "batch-out", "both") and (
                        not engine or (mode != "batch-out" and comm == "gloo_tcp_loop"))
                    os.sched_setscheduler(tid, os.SCHED_BATCH if batch else os.SCHED_OTHER,
                                          os.sched_param(0))
                    os.sched_setaffinity(tid, engine_cores if engine else other_cores)
                    counts["threads_batch" if batch else "threads_other"] += 1
        return counts

    def need(self) -> tuple[BatchClient, DispatcherProcess, ServeApi, DispatcherSettings]:
        if self.client is None or self.proc is None or self.api is None or self.dsettings is None:
            raise BenchError("the service is not started")
        return self.client, self.proc, self.api, self.dsettings

    # --- the engine ----------------------------------------------------------------------------

    async def cold(self) -> float:
        """Drop the model's engine (its Serve app) and deploy it again at zero replicas, as the
        dispatcher deployed it; the batch runner stays. Returns the seconds it took."""
        from dispatcher.engines import cluster_serve_config, summarize, without
        from llmbatch.stack.model import SERVED_MODEL
        from ray_job.runner import APP_NAME

        _, _, api, dsettings = self.need()
        began = time.monotonic()
        registry = dsettings.engines
        await api.deploy(cluster_serve_config(dsettings, without(registry, SERVED_MODEL)))
        await self._serve_until(lambda d: summarize(registry, d)[0].status == "NOT_DEPLOYED",
                                "engine removed")
        await api.deploy(cluster_serve_config(dsettings))

        def ready(details: dict[str, Any]) -> bool:
            row = summarize(registry, details)[0]
            if row.status == "DEPLOY_FAILED":
                raise BenchError(f"the engine app failed to deploy: {row.message}")
            runner = ((details.get("applications") or {}).get(APP_NAME) or {}).get("status")
            return row.status == "RUNNING" and row.running == 0 and runner == "RUNNING"

        await self._serve_until(ready, "engine deployed at zero replicas")
        return time.monotonic() - began

    async def _serve_until(self, check: Callable[[dict[str, Any]], bool], what: str,
                           within: float = 600.0) -> None:
        _, _, api, _ = self.need()
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if check(await api.status()):
                return
            await asyncio.sleep(1)
        raise BenchError(f"Serve: no {what} within {within:.0f} s")

    # --- batches -------------------------------------------------------------------------------

    async def submit(self, texts: list[str], *, priority: int, name: str) -> Sub:
        from llmbatch.stack.model import SERVED_MODEL

        client, _, _, dsettings = self.need()
        lines = input_lines(texts, self.args.max_tokens)
        batch_id = f"bench-{name}-{uuid.uuid4().hex[:8]}"
        submitted = time.time()
        # inline up to the short path's line limit, a file above it (an inline batch over the limit
        # would run as a Ray job; a file of at most short_path_max_bytes takes the short path)
        if len(lines) <= dsettings.dispatcher.short_path_max_lines:
            handle = await client.submit(lines, model=SERVED_MODEL, batch_id=batch_id, priority=priority)
        else:
            path = self.workdir / f"{batch_id}.jsonl"
            path.write_text("".join(json.dumps(line) + "\n" for line in lines))
            handle = await client.submit(file=path, model=SERVED_MODEL, batch_id=batch_id, priority=priority)
        sub = Sub(handle.batch_id, len(lines), priority, submitted)
        self.subs.append(sub)
        return sub

    async def wait(self, subs: list[Sub], what: str) -> None:
        _, proc, _, _ = self.need()
        await self.ledger.until(lambda: all(s.batch_id in self.ledger.terminal for s in subs),
                                self.args.timeout, proc, f"terminal events of {what}")

    async def phase(self, name: str, batches: list[tuple[list[str], int]]) -> dict[str, Any]:
        """Submit ``batches`` (texts, priority) at once; wait for all; their figures."""
        subs = await asyncio.gather(*(self.submit(texts, priority=priority, name=f"{name}{i}")
                                      for i, (texts, priority) in enumerate(batches)))
        await self.wait(list(subs), name)
        return await self.figures(list(subs))

    async def figures(self, subs: list[Sub], *, cancelled_ok: bool = False) -> dict[str, Any]:
        from schemas.events import EventType

        client, _, _, _ = self.need()
        rows: list[dict[str, Any]] = []
        for sub in subs:
            done = self.ledger.terminal[sub.batch_id]
            data = done.data
            ok = done.type is EventType.COMPLETED or (cancelled_ok and done.type is EventType.CANCELLED)
            if not ok or (done.type is EventType.COMPLETED and data.request_counts.failed):
                raise BenchError(f"{sub.batch_id} ended {done.type.value}: {data.request_counts} "
                                 f"{data.error}")
            accepted = self.ledger.accepted.get(sub.batch_id)
            accepted_t = accepted.time.timestamp() if accepted is not None else data.accepted_at.timestamp()
            manifest = await client.manifest(sub.batch_id, tenant=data.tenant)
            rows.append({
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
            })
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


# --- the phases ------------------------------------------------------------------------------------


async def measure(svc: Service, args: argparse.Namespace, report: dict[str, Any]) -> None:
    skip = set(args.skip)
    report["setup"] = await svc.start()
    small = prompts(args.per_batch)

    say("[warm-up] one small batch (engine start, tokenizer, caches) ...")
    report["warmup"] = await svc.phase("warmup", [(small, 5)])

    if "ab" not in skip:
        texts = prompts(args.small * args.per_batch)
        chunks = [texts[i * args.per_batch:(i + 1) * args.per_batch] for i in range(args.small)]
        await svc.cold()
        say(f"[A] {args.small} x {args.per_batch} at once, engine cold ...")
        report["A"] = await svc.phase("a", [(c, 5) for c in chunks])
        await svc.cold()
        say(f"[B] 1 x {len(texts)}, engine cold ...")
        report["B"] = await svc.phase("b", [(texts, 5)])

    say(f"[warm] {args.warm_runs} x 1 batch of {args.per_batch} (priority 9) on the warm engine ...")
    warm_began = time.time()
    warm = [await svc.phase("warm", [(small, 9)]) for _ in range(args.warm_runs)]
    rows = [w["rows"][0] for w in warm]
    service = [r["accepted_to_terminal_s"] for r in rows]
    overhead = [r["accepted_to_terminal_s"] - (r["generation_s"] or 0.0) for r in rows]
    report["warm"] = {
        "accepted_to_terminal_s": service,
        "generation_s": [r["generation_s"] for r in rows],
        "overhead_s": [round(x, 3) for x in overhead],
        "submit_to_accepted_s": [r["submit_to_accepted_s"] for r in rows],
        "p50_accepted_to_terminal_s": statistics.median(service),
        "p50_generation_s": statistics.median(r["generation_s"] or 0.0 for r in rows),
        "p50_overhead_s": round(statistics.median(overhead), 3),
        "p50_submit_to_accepted_s": statistics.median(r["submit_to_accepted_s"] for r in rows),
        "load1": svc.load.window(warm_began, time.time()),
    }

    if "throughput" not in skip:
        texts = prompts(args.conc * args.conc_size)
        for run, mode in enumerate(args.background or [None]):
            key = "conc" if mode is None else f"conc_{mode}_{run}"
            if mode is not None:
                say(f"[throughput] scheduling {mode}: {svc.scheduling(mode)}")
            say(f"[throughput] {args.conc} x {args.conc_size} at once, warm engine ...")
            before, switched, began = cpu_snapshot(), switch_snapshot(), time.perf_counter()
            report[key] = await svc.phase("conc", [
                (texts[i * args.conc_size:(i + 1) * args.conc_size], 5) for i in range(args.conc)])
            wall = time.perf_counter() - began
            report[key]["cpu_cores"] = cpu_by_component(before, cpu_snapshot(), wall)
            report[key]["switches"] = switches_by_component(switched, switch_snapshot(), wall)
            say(f"[throughput] {mode}: {report[key]['tokens_per_s']:.1f} tok/s; "
                f"switches {report[key]['switches']}")
        if args.background:
            report["conc"] = report[f"conc_{args.background[0]}_0"]
            svc.scheduling("normal")
        say(f"[throughput] 1 x {len(texts)}, warm engine ...")
        report["one"] = await svc.phase("one", [(texts, 5)])

    if "fairness" not in skip:
        _, proc, _, _ = svc.need()
        say(f"[fairness] {args.big}-line batch at priority 0 ...")
        big = await svc.submit(prompts(args.big), priority=0, name="big")
        await svc.ledger.until(lambda: svc.ledger.progress.get(big.batch_id, 0) > 0
                               or big.batch_id in svc.ledger.terminal, args.timeout, proc,
                               "progress of the big batch")
        say(f"[fairness] ... under way; {args.per_batch}-line batch at priority 9 beside it ...")
        urgent = await svc.phase("urgent", [(small, 9)])
        big_done_first = big.batch_id in svc.ledger.terminal
        if args.cancel_big and not big_done_first:
            client, _, _, _ = svc.need()
            await client.cancel(big.batch_id, reason="bench: fairness measured")
        say("[fairness] waiting for the big batch to end ...")
        await svc.wait([big], "the big batch")
        big_figures = await svc.figures([big], cancelled_ok=True)
        idle = report["warm"]["p50_accepted_to_terminal_s"]
        loaded = urgent["rows"][0]["accepted_to_terminal_s"]
        report["fairness"] = {
            "idle_s": idle,
            "loaded_s": loaded,
            "ratio": round(loaded / idle, 2),
            "big_finished_first": big_done_first,  # True: the figure is void
            "big": {k: v for k, v in big_figures.items() if k != "rows"} | {
                "status": big_figures["rows"][0]["status"], "completed": big_figures["rows"][0]["completed"]},
            "urgent": urgent,
        }
    report["routes"] = await svc.routes()


def component(cmd: list[str]) -> str:
    """A label for a process: a Ray worker's title (``ray::ServeReplica:...``), a Python script or module,
    else the executable."""
    head = cmd[0]
    if head.startswith("ray::"):
        return head.split(" ")[0][:60]
    if Path(head).name.startswith("python") and len(cmd) > 1:
        arg = cmd[2] if cmd[1] in ("-m", "-u") and len(cmd) > 2 else cmd[1]
        return "python " + (Path(arg).name if "/" in arg else arg)[:50]
    if Path(head).name == "java":
        return "java (Kafka)"
    return Path(head).name[:40]


def cpu_snapshot() -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of every process of this machine, labelled by :func:`component`."""
    import psutil

    out: dict[int, tuple[str, float]] = {}
    for proc in psutil.process_iter(["cmdline", "name", "cpu_times"]):
        cmd, times = proc.info["cmdline"] or [proc.info["name"] or "?"], proc.info["cpu_times"]
        if times is None:
            continue
        out[proc.pid] = (component(cmd), times.user + times.system)
    return out


def switch_snapshot() -> dict[int, tuple[str, int, int]]:
    """Context switches of every process of this machine, summed over its threads: voluntary (the
    thread slept and was woken: a wake-up) and involuntary (it was preempted while it could run)."""
    import psutil

    from bench.bench_ray_job import thread_switches

    out: dict[int, tuple[str, int, int]] = {}
    for proc in psutil.process_iter(["cmdline", "name"]):
        switches = thread_switches(proc.pid)
        if switches is not None:
            out[proc.pid] = (component(proc.info["cmdline"] or [proc.info["name"] or "?"]), *switches)
    return out


def switches_by_component(before: dict[int, tuple[str, int, int]], after: dict[int, tuple[str, int, int]],
                          wall_s: float, top: int = 10) -> dict[str, dict[str, int]]:
    """Wake-ups and preemptions per second of each component between two snapshots, the most waking
    first, and ``outside the engine``: the wake-ups of everything but engine replicas."""
    rates: dict[str, list[float]] = {}
    for pid, (label, woke, preempted) in after.items():
        _, woke0, preempted0 = before.get(pid, (label, 0, 0))
        rate = rates.setdefault(label, [0.0, 0.0])
        rate[0] += (woke - woke0) / wall_s
        rate[1] += (preempted - preempted0) / wall_s
    ranked = sorted(rates.items(), key=lambda kv: -kv[1][0])[:top]
    out = {label: {"wakeups_per_s": round(w), "preempted_per_s": round(p)} for label, (w, p) in ranked}
    outside = sum(w for label, (w, _) in rates.items() if "llmbatch-engine" not in label)
    out["outside the engine"] = {"wakeups_per_s": round(outside), "preempted_per_s": 0}
    return out


def cpu_by_component(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
                     wall_s: float, top: int = 10) -> dict[str, float]:
    """Share of one core each component used between two snapshots (processes alive at the end)."""
    used: dict[str, float] = {}
    for pid, (label, seconds) in after.items():
        used[label] = used.get(label, 0.0) + seconds - before.get(pid, (label, 0.0))[1]
    ranked = sorted(used.items(), key=lambda kv: -kv[1])[:top]
    return {label: round(seconds / wall_s, 3) for label, seconds in ranked if seconds > 0}


def core_split(cores: set[int], mode: str) -> tuple[set[int], set[int]]:
    """The cores of the engine replicas' threads and of every other thread under ``mode``: with
    ``split`` the last core for the engines alone and the others for the rest (all of them on one
    core), else every core for every thread."""
    if mode != "split" or len(cores) < 2:
        return set(cores), set(cores)
    last = max(cores)
    return {last}, set(cores) - {last}


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def plain(args: argparse.Namespace, model_path: str, env_overrides: dict[str, str] | None = None
          ) -> dict[str, Any]:
    """Plain ``vllm.LLM.chat`` on the throughput prompts, in a fresh process (bench_ray_job's worker),
    with the engine environment the service's engine has (``env_overrides`` on top)."""
    import tempfile

    from llmbatch.stack.dispatcher_env import LOCAL_ENGINE

    texts = prompts(args.conc * args.conc_size)
    load_before = os.getloadavg()[0]
    cores = os.sched_getaffinity(0)
    if args.plain_cpus:  # the child inherits this process' affinity
        env_overrides = {**(env_overrides or {}), "OMP_NUM_THREADS": str(len(args.plain_cpus))}
        os.sched_setaffinity(0, args.plain_cpus)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-service-") as tmp:
            path = Path(tmp) / "input.jsonl"
            path.write_text("".join(json.dumps(line) + "\n" for line in input_lines(texts, args.max_tokens)))
            result = run_plain(model_path, path, int(str(LOCAL_ENGINE["max_model_len"])), env_overrides)
    finally:
        os.sched_setaffinity(0, cores)
    result.pop("texts", None)
    result["tokens_per_s"] = round(result["output_tokens"] / result["generation_s"], 1)
    result["load1"] = {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)}
    return result


def ratios(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each issue-11 figure with its target; absent when its phase was skipped."""
    out: dict[str, dict[str, Any]] = {}

    def put(name: str, value: float, target: str, ok: bool) -> None:
        out[name] = {"value": round(value, 2), "target": target, "met": ok}

    if "A" in report and "B" in report:
        ab = report["A"]["wall_s"] / report["B"]["wall_s"]
        put("A/B (first submit -> last terminal)", ab, "<= 1.5", ab <= 1.5)
    warm = report["warm"]["p50_overhead_s"]
    put("warm p50 accepted->terminal minus generation (s)", warm, "<= 3", warm <= 3)
    if "conc" in report and "one" in report:
        conc = report["conc"]["tokens_per_s"]
        put("concurrent / one batch (tok/s)", conc / report["one"]["tokens_per_s"], ">= 0.9",
            conc >= 0.9 * report["one"]["tokens_per_s"])
        # against the faster of the two plain runs (the engine's environment, vLLM's own processes)
        best = max((report[k]["tokens_per_s"] for k in ("plain", "plain_vllm_procs") if k in report),
                   default=None)
        if best is not None:
            put("concurrent / plain LLM.chat, the faster (tok/s)", conc / best, ">= 0.9", conc >= 0.9 * best)
            # issue 13's figure: one big batch (e.g. --conc 2 --conc-size 1024: 1 x 2048) against plain
            one = report["one"]["tokens_per_s"]
            put("one batch / plain LLM.chat, the faster (tok/s)", one / best, ">= 0.9", one >= 0.9 * best)
    if "fairness" in report:
        f = report["fairness"]
        put("fairness: beside the big batch / idle", f["ratio"], "<= 2",
            f["ratio"] <= 2 and not f["big_finished_first"])
    return out


def show(report: dict[str, Any], args: argparse.Namespace) -> None:
    cpu = report["cpu"]
    print(f"through the service ({args.engine} engine), {cpu['model']}, {cpu['cores']} cores, "
          f"AVX-512 {cpu['avx512']}; batch window {args.batch_size} x {args.batches_in_flight}, "
          f"max_tokens {args.max_tokens}; routes {report.get('routes')}")

    def line(label: str, key: str) -> None:
        if key in report:
            r = report[key]
            print(f"  {label:34} {r['wall_s']:8.1f} s  {r['output_tokens']:6} tokens  "
                  f"{r['tokens_per_s']:7.1f} tok/s  load1 {r['load1']['mean']:.1f} "
                  f"(max {r['load1']['max']:.1f})")

    line(f"warm-up (engine start {report['warmup']['max_engine_start_s'] or 0:.0f} s)", "warmup")
    line(f"A: {args.small} x {args.per_batch} at once, cold", "A")
    line(f"B: 1 x {args.small * args.per_batch}, cold", "B")
    w = report["warm"]
    print(f"  warm {args.per_batch}-line batch x {len(w['overhead_s'])}: accepted->terminal p50 "
          f"{w['p50_accepted_to_terminal_s']:.2f} s, generation p50 {w['p50_generation_s']:.2f} s, overhead "
          f"p50 {w['p50_overhead_s']:.2f} s (all {w['overhead_s']}), submit->accepted p50 "
          f"{w['p50_submit_to_accepted_s']:.2f} s; load1 {w['load1']['mean']:.1f}")
    line(f"{args.conc} x {args.conc_size} at once, warm", "conc")
    if "cpu_cores" in report.get("conc", {}):
        shares = ", ".join(f"{k} {v:.2f}" for k, v in report["conc"]["cpu_cores"].items())
        print(f"    cores used during it, by process: {shares}")
    if "switches" in report.get("conc", {}):
        rates = ", ".join(f"{k} {v['wakeups_per_s']} ({v['preempted_per_s']})"
                          for k, v in report["conc"]["switches"].items())
        print(f"    wake-ups/s (preempted/s) during it, by process: {rates}")
    for run, mode in enumerate(args.background):
        line(f"  scheduling {mode}", f"conc_{mode}_{run}")
    line(f"1 x {args.conc * args.conc_size}, warm", "one")
    for key, label in (("plain", "plain LLM.chat, engine env"),
                       ("plain_vllm_procs", "plain, vLLM's processes")):
        if key in report:
            p = report[key]
            print(f"  {label:34} engine start {p['engine_start_s']:.1f} s, generation "
                  f"{p['generation_s']:.1f} s, {p['output_tokens']} tokens, {p['tokens_per_s']:.1f} tok/s; "
                  f"load1 {p['load1']['before']:.1f} -> {p['load1']['after']:.1f}; its threads preempted "
                  f"{p.get('preempted_per_s', '?')}/s, woken {p.get('wakeups_per_s', '?')}/s")
    if "fairness" in report:
        f = report["fairness"]
        big = f["big"]
        print(f"  fairness: {args.per_batch}-line p9 batch idle {f['idle_s']:.2f} s, beside the "
              f"{args.big}-line p0 batch {f['loaded_s']:.2f} s (accepted->terminal); big batch "
              f"{big['status']} {big['completed']}/{big['lines']} lines, {big['tokens_per_s']:.1f} tok/s, "
              f"finished first: {f['big_finished_first']}; load1 {f['urgent']['load1']['mean']:.1f}")
    for name, r in report["ratios"].items():
        print(f"  {name:50} {r['value']:7.2f}  target {r['target']:6}  {'met' if r['met'] else 'NOT met'}")


QUICK = {"small": 8, "per_batch": 8, "warm_runs": 3, "conc": 4, "conc_size": 64, "big": 400}
"""``--quick``: the same phases on smaller sizes (the throughput phase still generates 256 prompts)."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("vllm", "fake"), default="vllm")
    parser.add_argument("--small", type=int, default=16, help="small batches in A")
    parser.add_argument("--per-batch", type=int, default=8, help="prompts per small batch")
    parser.add_argument("--warm-runs", type=int, default=10)
    parser.add_argument("--conc", type=int, default=4, help="batches at once in the throughput phase")
    parser.add_argument("--conc-size", type=int, default=128, help="prompts per batch there")
    parser.add_argument("--big", type=int, default=2000, help="lines of the priority-0 batch (fairness)")
    parser.add_argument("--cancel-big", action="store_true",
                        help="cancel the big batch once the urgent one finished (saves its remaining time)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=64,
                        help="lines per engine call of a batch (the stack's own entry says 4)")
    parser.add_argument("--batches-in-flight", type=int, default=4, help="engine calls of a batch at once")
    parser.add_argument("--omp-threads", type=int, default=local_engine_threads(),
                        help="the engine replica's OMP_NUM_THREADS (default: the local stack's, every "
                        "core; 0: Ray's, its num_cpus, 1 thread)")
    parser.add_argument("--fake-delay-s", type=float, default=0.5, help="fake engine: seconds per request")
    parser.add_argument("--skip", type=lambda s: [x for x in s.split(",") if x], default=[],
                        help=f"comma list of {','.join(PHASES)}")
    parser.add_argument("--background", type=lambda s: [x for x in s.split(",") if x],
                        default=[], help=f"experiment, comma list of {','.join(SCHEDULINGS)}: run "
                        "the throughput phase once per scheduling of the run's processes")
    parser.add_argument("--plain-cpus", type=lambda s: {int(x) for x in s.split(",") if x}, default=set(),
                        help="experiment, comma list of CPU numbers: the plain runs on these cores only, "
                        "with as many OpenMP threads (compare with --background split)")
    parser.add_argument("--stack-dir", type=Path, default=None,
                        help="use the stack running there (left up) instead of a private one")
    parser.add_argument("--keep", action="store_true", help="leave the private stack up")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for one phase")
    parser.add_argument("--json", action="store_true", help="print the report as JSON only")
    parser.add_argument("--report", type=Path, default=None, help="also write the JSON report here")
    quick = ", ".join(f"--{name.replace('_', '-')} {value}" for name, value in QUICK.items())
    parser.add_argument("--quick", action="store_true",
                        help=f"smaller defaults ({quick}): about 15 minutes on 2 cores instead of over an "
                        "hour; sizes given explicitly win")
    args = parser.parse_args()
    if args.quick:
        given = {a.split("=", 1)[0] for a in sys.argv[1:] if a.startswith("--")}
        for name, value in QUICK.items():
            if f"--{name.replace('_', '-')}" not in given:
                setattr(args, name, value)
    for option, values, known in (("--skip", args.skip, PHASES),
                                  ("--background", args.background, SCHEDULINGS)):
        if unknown := set(values) - set(known):
            parser.error(f"{option}: unknown {sorted(unknown)}; choose from {', '.join(known)}")
    if bad := args.plain_cpus - os.sched_getaffinity(0):
        parser.error(f"--plain-cpus: {sorted(bad)} not among this process' CPUs "
                     f"{sorted(os.sched_getaffinity(0))}")
    if min(args.small, args.per_batch, args.warm_runs, args.conc, args.conc_size, args.big) < 1:
        parser.error("sizes must be at least 1")

    from llmbatch.stack.model import ensure_model
    from llmbatch.stack.process import StackError

    model_path = str(ensure_model())
    cpuinfo = Path("/proc/cpuinfo").read_text()
    names = [x.split(":", 1)[1].strip() for x in cpuinfo.splitlines() if x.startswith("model name")]
    report: dict[str, Any] = {
        "cpu": {"model": names[0] if names else "?", "cores": os.cpu_count(), "avx512": "avx512" in cpuinfo},
        "engine": args.engine,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "load1_at_start": round(os.getloadavg()[0], 2),
    }
    began = time.monotonic()
    svc = Service(args, model_path)

    async def service_phases() -> None:
        try:
            await measure(svc, args, report)
        except BaseException:
            if svc.proc is not None:
                say(f"--- dispatcher log tail\n{svc.proc.tail()}")
            raise
        finally:
            await svc.stop()

    code = 0
    try:
        asyncio.run(service_phases())
    except (BenchError, StackError) as exc:
        if isinstance(exc, StackError) and exc.log_tail:
            say(exc.log_tail)
        say(f"error: {exc}")
        code = 1
    if code == 0 and svc.own_stack and not args.keep:  # logs and data of a failed run stay
        shutil.rmtree(svc.run_dir, ignore_errors=True)
    if code == 0 and args.engine == "vllm" and "plain" not in args.skip:
        say("[plain] vllm LLM.chat on the throughput prompts, fresh process, the engine's environment ...")
        report["plain"] = plain(args, model_path)
        if "plain-procs" not in args.skip:  # always the slower on CPU here; --skip plain-procs saves its run
            say("[plain] ... and with vLLM's own CPU processes (EngineCore + pinned worker) ...")
            report["plain_vllm_procs"] = plain(args, model_path, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    report["total_s"] = round(time.monotonic() - began, 1)
    report["load1_at_end"] = round(os.getloadavg()[0], 2)
    if code == 0:
        report["ratios"] = ratios(report)
    text = json.dumps(report, indent=2, default=str)
    if args.report is not None:
        args.report.write_text(text + "\n")
    if args.json or code != 0:
        print(text)
    if code == 0 and not args.json:
        show(report, args)
    return code


if __name__ == "__main__":
    sys.exit(main())
