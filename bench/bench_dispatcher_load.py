"""Benchmark: the dispatcher alone at the highest rate this machine allows (issue 53 item 5's load test).

    .venv/bin/python bench/bench_dispatcher_load.py [--batches 3000] [--lines 4] [--rate 0]
        [--replicas 1[,2,3]] [--cpu-per-replica CORES] [--setting LLMBATCH_X=VALUE ...]
        [--json] [--report PATH] [--keep]

Starts Kafka, Redis and MinIO (a private run folder, no Ray) and one dispatcher process (``--replicas``: a run
for each count given, one after the other, each on fresh services) with the service's
defaults (shared engines, the short path) whose job backend is ``bench/service/instant_backend.py``: each
attempt runs at once inside the dispatcher's process as the batch runner would run it (its inline lines,
a shard, a manifest and progress on the real MinIO and Redis) on the fake engine. Warms the path with one
batch, then publishes ``--batches`` batches of ``--lines`` inline lines, all at once (``--rate 0``, the
most the dispatcher can take) or ``--rate`` a minute, and waits for every terminal event.
``--cpu-per-replica`` puts each dispatcher process in a cgroup of its own with that many cores at most
(needs root): more replicas then bring more CPU, as more machines would, instead of sharing this one's
two cores. Prints:

- batches per minute (first accepted -> last terminal) and p50 / p90 accepted -> terminal;
- per batch: Redis commands (``INFO commandstats``), Kafka records (requests and events), the dispatcher's
  own CPU milliseconds (its process's CPU time less what the attempts' threads spent), the attempts'
  (one small job's work: S3 writes, progress), and Kafka's, Redis's and MinIO's;
- the dispatcher's peak RSS; with several replicas, each one's CPU per batch, its shards at the end and
  which one was the launching leader then.

Everything started is stopped by PID (the run folder is removed after a successful run unless
``--keep``). Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from bench.bench_flow import cpu_by_label, paced, per_batch, redis_calls  # noqa: E402
from bench.bench_ray_job import input_lines, prompts  # noqa: E402
from bench.service.common import BenchError, say  # noqa: E402
from bench.service.cpu import cpu_snapshot  # noqa: E402
from bench.service.cpu_quota import CpuQuota  # noqa: E402
from bench.service.ledger import Ledger  # noqa: E402
from llmbatch.demo.run import DispatcherProcess  # noqa: E402

SERVICES = ("kafka", "redis", "minio")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, default=3000, help="batches published")
    parser.add_argument("--lines", type=int, default=4, help="inline lines per batch")
    parser.add_argument("--rate", type=float, default=0.0, help="batches per minute; 0: all at once")
    parser.add_argument(
        "--replicas",
        type=lambda text: [int(x) for x in text.split(",")],
        default=[1],
        help="dispatcher replicas, one run per count (e.g. 1,2,3), one after the other",
    )
    parser.add_argument(
        "--cpu-per-replica",
        type=float,
        default=None,
        help="cores each dispatcher process may use (a cgroup each; needs root), e.g. 0.3",
    )
    parser.add_argument(
        "--setting",
        action="append",
        default=[],
        metavar="LLMBATCH_X=VALUE",
        help="a setting of the dispatcher processes (repeatable), e.g. a quota: "
        'LLMBATCH_TENANTS__MAX_ENQUEUED_TOKENS={"*": 1000000000}',
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for every batch")
    parser.add_argument("--keep", action="store_true", help="leave the services running afterwards")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--report", type=Path, help="also write the report here as JSON")
    args = parser.parse_args()
    for name in ("batches", "lines"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.rate < 0:
        parser.error("--rate must be 0 (all at once) or a number of batches per minute")
    if not args.replicas or min(args.replicas) < 1:
        parser.error("--replicas takes counts of at least 1, e.g. 1,2,3")
    return args


class InstantDispatcher(DispatcherProcess):
    """``bench/service/instant_dispatcher.py`` in its own session (stopped by PID, as the demo's)."""

    def __init__(
        self, env: dict[str, str], log_path: Path, metrics_port: int, cpu_file: Path, shared: Path
    ) -> None:
        import subprocess

        self.log_path, self.port, self.cpu_file = log_path, metrics_port, cpu_file
        log_path.parent.mkdir(parents=True, exist_ok=True)
        script = ROOT / "bench" / "service" / "instant_dispatcher.py"
        with log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(script), str(cpu_file), str(shared)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )

    def attempts_cpu_s(self) -> float:
        try:
            return float(json.loads(self.cpu_file.read_text())["cpu_s"])
        except (OSError, ValueError, KeyError):
            return 0.0


def settings_of(pairs: list[str]) -> dict[str, str]:
    """``--setting`` values as environment entries; a value that is not ``LLMBATCH_<NAME>=...`` stops."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not re.fullmatch(r"LLMBATCH_[A-Z0-9_]+", key):
            raise SystemExit(f"--setting: expected LLMBATCH_<NAME>=<value>, got {pair[:80]!r}")
        out[key] = value
    return out


def environment(state: Any, tag: str, port: int) -> dict[str, str]:
    from llmbatch.ray_job.engines.backends import FAKE_BACKEND
    from llmbatch.schemas.engines import EngineModel, EngineRegistry
    from llmbatch.schemas.job import EngineConfig
    from llmbatch.stack.dispatcher_env import dispatcher_environ
    from llmbatch.stack.model import SERVED_MODEL

    registry = EngineRegistry(
        models={SERVED_MODEL: EngineModel(path="fake", engine=EngineConfig(backend=FAKE_BACKEND))}
    )
    models = registry.model_dump(mode="json", exclude_defaults=True)["models"]
    env = dispatcher_environ(state, None)
    minio = state.services["minio"].extra
    env.update(
        {
            "LLMBATCH_ENGINES__MODELS": json.dumps(models),
            "LLMBATCH_DISPATCHER__SHARED_ENGINES": "true",
            "LLMBATCH_DISPATCHER__DEPLOY_ENGINES": "false",
            "LLMBATCH_DISPATCHER__INSTANCE_ID": f"load-{tag}",
            "LLMBATCH_DISPATCHER__GROUP_ID": f"load-{tag}",
            "LLMBATCH_DISPATCHER__METRICS_HOST": "127.0.0.1",
            "LLMBATCH_DISPATCHER__METRICS_PORT": str(port),
            "LLMBATCH_DISPATCHER__LOG_JSON": "true",
            "LLMBATCH_REDIS__KEY_PREFIX": f"load{tag}",
            "LLMBATCH_KAFKA__TOPICS__REQUESTS": f"load-{tag}.requests",
            "LLMBATCH_KAFKA__TOPICS__RESULTS": f"load-{tag}.results",
            "LLMBATCH_KAFKA__TOPICS__DEAD_LETTER": f"load-{tag}.requests.dlt",
            # the attempts run in this process: they take S3 keys from its environment, as a node's job
            "AWS_ACCESS_KEY_ID": minio["access_key"],
            "AWS_SECRET_ACCESS_KEY": minio["secret_key"],
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


async def run(args: argparse.Namespace, run_dir: Path, replicas: int = 1) -> dict[str, Any]:
    """One run on fresh services: ``replicas`` dispatcher processes (one consumer group, one tracker
    lease), the warm-up, then the load; its figures."""
    from llmbatch.dispatcher.ops.engines_cli import only_llmbatch_env
    from llmbatch.dispatcher.settings import DispatcherSettings
    from llmbatch.producer import BatchClient, ensure_topics
    from llmbatch.stack import manager
    from llmbatch.stack.model import SERVED_MODEL
    from llmbatch.stack.ports import free_port

    say(f"[stack] starting {', '.join(SERVICES)} in {run_dir} ...")
    state = await asyncio.to_thread(manager.up, run_dir, SERVICES)
    procs: list[InstantDispatcher] = []
    ledger, tasks, closers = Ledger(), [], []
    quotas: list[CpuQuota] = []
    try:
        tag = uuid.uuid4().hex[:8]
        for r in range(replicas):
            port = free_port()
            env = environment(state, tag, port)
            env["LLMBATCH_DISPATCHER__INSTANCE_ID"] = f"load-{tag}-{r}"
            env.update(settings_of(args.setting))
            log_path = run_dir / "logs" / f"load-dispatcher-{r}.log"
            cpu_file = run_dir / f"attempts-cpu-{r}.json"
            procs.append(InstantDispatcher(env, log_path, port, cpu_file, run_dir / "attempts"))
            if args.cpu_per_replica is not None:
                quotas.append(CpuQuota(f"llmbatch-bench-{tag}-{r}", args.cpu_per_replica))
                quotas[-1].add(procs[-1].proc.pid)
        with only_llmbatch_env(env):
            dsettings = DispatcherSettings(_env_file=None)
        proc = procs[0]
        say(f"[dispatcher] starting {replicas} ...")
        for each in procs:
            await asyncio.to_thread(each.wait_ready, 120.0)
        client = BatchClient(manager.settings_for(state, dsettings))
        closers.append(client.close)
        await client.ensure_buckets()
        await ensure_topics(client.settings)
        ledger.task = asyncio.create_task(ledger.follow(client))
        tasks.append(ledger.task)
        lines = input_lines(prompts(args.lines), 8)

        async def submit(name: str) -> str:
            handle = await client.submit(
                lines, model=SERVED_MODEL, batch_id=f"load-{name}-{uuid.uuid4().hex[:8]}"
            )
            return str(handle.batch_id)

        async def settle(ids: list[str], what: str) -> None:
            await ledger.until(lambda: all(i in ledger.terminal for i in ids), args.timeout, proc, what)

        say("[warm-up] one batch ...")
        await settle([await submit("warm")], "the warm-up batch")
        pids = [psutil.Process(each.proc.pid) for each in procs]

        def dispatcher_cpu() -> tuple[list[float], float]:
            """CPU seconds of each dispatcher process, and of the attempts run in them all."""
            times = [p.cpu_times() for p in pids]
            return [t.user + t.system for t in times], sum(each.attempts_cpu_s() for each in procs)

        (redis0, conn0, mem0), cpu0, events0 = (
            await redis_calls(dsettings.redis),
            cpu_by_label(cpu_snapshot()),
            ledger.events,
        )
        disp0, att0 = dispatcher_cpu()
        how = f"at {args.rate:g} per minute" if args.rate else "at once"
        say(f"[load] {args.batches} batches of {args.lines} lines {how} ...")
        ids = await paced(args.batches, args.rate, lambda i: submit(f"b{i}"))
        await settle(ids, "the load")
        await asyncio.sleep(1.5)  # the attempts' CPU file is written every second
        (redis1, conn1, mem1), cpu1, events1 = (
            await redis_calls(dsettings.redis),
            cpu_by_label(cpu_snapshot()),
            ledger.events,
        )
        disp1, att1 = dispatcher_cpu()
        rss_mb = max(p.memory_info().rss for p in pids) / 2**20
        trackers = [await tracker_of(each.port) for each in procs]
    finally:
        for task in tasks:
            task.cancel()
        for close in closers:
            await close()
        for each in procs:
            await asyncio.to_thread(each.stop)
        for quota in quotas:
            quota.remove()
        if not args.keep:
            await asyncio.to_thread(manager.down, run_dir, SERVICES)
    accepted = [ledger.accepted[i].time.timestamp() for i in ids]
    terminal = [ledger.terminal[i].time.timestamp() for i in ids]
    statuses = {str(ledger.terminal[i].data.status) for i in ids}
    if statuses != {"completed"}:
        raise BenchError(f"not every batch completed: {statuses}")
    latencies = sorted(t - a for a, t in zip(accepted, terminal, strict=True))
    n, wall = len(ids), max(terminal) - min(accepted)
    redis = per_batch(redis0, redis1, n)
    others = per_batch(cpu0, cpu1, n, scale=1000.0)
    per_replica = [b - a for a, b in zip(disp0, disp1, strict=True)]
    dispatcher_s, attempts_s = sum(per_replica), att1 - att0
    return {
        "replicas": replicas,
        "batches": n,
        "lines_per_batch": args.lines,
        "rate_per_min": args.rate or None,
        "wall_s": round(wall, 2),
        "batches_per_min": round(n / wall * 60, 1),
        "p50_accepted_to_terminal_s": round(statistics.median(latencies), 2),
        "p90_accepted_to_terminal_s": round(latencies[int(0.9 * (n - 1))], 2),
        "redis_commands_per_batch": round(sum(redis.values()), 1),
        "redis_by_command": dict(list(redis.items())[:12]),
        "redis_connections_per_batch": round((conn1 - conn0 - 1) / n, 2),
        "kafka_records_per_batch": round((n + events1 - events0) / n, 2),
        # what a finished batch keeps in Redis until finished_ttl_s (7 days by default)
        "redis_bytes_per_batch": round((mem1 - mem0) / n),
        "cpu_ms_per_batch": {
            "dispatcher (own)": round((dispatcher_s - attempts_s) * 1000 / n, 2),
            "attempts (in the dispatcher's process)": round(attempts_s * 1000 / n, 2),
            **{k: v for k, v in others.items() if k.startswith(("java", "redis-server", "minio"))},
        },
        "dispatcher_rss_mb": round(rss_mb, 1),  # the largest replica's
        # each process's whole CPU (its attempts' included) per batch of the run, and its shards at the end
        "replica_cpu_ms_per_batch": [round(x * 1000 / n, 2) for x in per_replica],
        "replica_shards": [shards for shards, _ in trackers],
        "replica_leads": [leads for _, leads in trackers],  # the launching leader at the end
        "cpu_per_replica": args.cpu_per_replica,
        "cores": os.cpu_count(),
    }


async def tracker_of(port: int) -> tuple[int | None, bool | None]:
    """The tracker shards a dispatcher holds and whether it is the launching leader (its
    ``llmbatch_dispatcher_tracker_shards`` and ``llmbatch_dispatcher_tracker_leader``)."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=5.0) as http:
            text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
    except httpx.HTTPError:
        return None, None
    gauges: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in {"llmbatch_dispatcher_tracker_shards", "llmbatch_dispatcher_tracker_leader"}:
            gauges[name] = int(float(value))
    shards = gauges.get("llmbatch_dispatcher_tracker_shards")
    leader = gauges.get("llmbatch_dispatcher_tracker_leader")
    return shards, None if leader is None else leader == 1


def show(f: dict[str, Any]) -> None:
    how = f"at {f['rate_per_min']:g}/min" if f["rate_per_min"] else "at once"
    print(
        f"the dispatcher alone ({f['replicas']} replica(s)), {f['batches']} batches of "
        f"{f['lines_per_batch']} lines {how}: "
        f"{f['batches_per_min']} batches/min ({f['wall_s']} s first accepted -> last terminal); "
        f"accepted -> terminal p50 {f['p50_accepted_to_terminal_s']} s, "
        f"p90 {f['p90_accepted_to_terminal_s']} s"
    )
    print(
        f"per batch: {f['redis_commands_per_batch']} Redis commands, {f['redis_connections_per_batch']} "
        f"Redis connections, {f['redis_bytes_per_batch']} bytes kept in Redis, "
        f"{f['kafka_records_per_batch']} Kafka records; "
        f"dispatcher RSS {f['dispatcher_rss_mb']} MB"
    )
    print("  Redis commands by name: " + ", ".join(f"{k} {v}" for k, v in f["redis_by_command"].items()))
    print("  CPU ms: " + ", ".join(f"{k} {v}" for k, v in f["cpu_ms_per_batch"].items()))
    quota = f" (each at most {f['cpu_per_replica']:g} cores)" if f["cpu_per_replica"] else ""
    print(
        f"  each replica{quota}: CPU ms per batch {f['replica_cpu_ms_per_batch']}, "
        f"shards {f['replica_shards']}, launching leader {f.get('replica_leads')}"
    )


def main() -> int:
    args = parse_args()
    run_dir = ROOT / "run" / f"bench-load-{uuid.uuid4().hex[:8]}"
    from llmbatch.stack.process import StackError

    began = time.monotonic()
    runs = []
    for replicas in args.replicas:  # one after the other, each on fresh services
        try:
            runs.append(asyncio.run(run(args, run_dir / f"replicas-{replicas}", replicas)))
        except (BenchError, StackError) as exc:
            say(f"error: {exc}")
            say(f"(logs in {run_dir / f'replicas-{replicas}' / 'logs'})")
            return 1
    report: dict[str, Any] = {"runs": runs, "total_s": round(time.monotonic() - began, 1)}
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    if args.report is not None:
        args.report.write_text(json.dumps(report, indent=2) + "\n")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for one in runs:
            show(one)
    return 0


if __name__ == "__main__":
    sys.exit(main())
