"""One chaos run: the local stack, dispatcher replicas, the workload sent while faults are injected, then
the results topic, the dead-letter topic and the result files read back and judged
(:func:`llmbatch.chaos.verdict.judge`).

``python -m llmbatch.chaos`` (``make chaos``) runs the full version; tests/e2e/test_chaos.py the short
one. Everything runs on the real Kafka, Redis, MinIO and Ray of a private local stack; jobs run the
fake engine (the faults, not the model, are under test).
"""

from __future__ import annotations

import asyncio
import shutil
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from llmbatch.chaos import readback
from llmbatch.chaos.faults import PROXIED, Faults, default_faults
from llmbatch.chaos.kafka_cluster import KafkaCluster
from llmbatch.chaos.processes import DispatcherProcess
from llmbatch.chaos.proxy import FaultProxy, behind_proxies
from llmbatch.chaos.readback import TopicReader
from llmbatch.chaos.run_settings import MODEL, chaos_settings, skewed_job_clock
from llmbatch.chaos.sending import send, upload
from llmbatch.chaos.verdict import Verdict, judge
from llmbatch.chaos.workload import workload
from llmbatch.stack import manager
from llmbatch.stack.ports import free_port
from llmbatch.stack.process import alive
from llmbatch.stack.state import StackState

DEADLINE_BOUND_S = 120.0
"""How long past its deadline a batch may take to end with every service up: the stop wait, a poll,
the publish."""


@dataclass
class ChaosConfig:
    """The size of a run and the faults in it (each kind in ``faults``, ``rounds`` times over)."""

    batches: int = 200
    malformed: int = 1000
    replicas: int = 2
    max_in_flight: int = 3
    shared_engines: bool = False  # True: the default path (warm Serve engines, the batch runner)
    faults: tuple[str, ...] | None = None  # None: default_faults(shared_engines)
    rounds: int = 2
    fault_every_s: float = 20.0
    down_s: float = 120.0  # how long a killed service stays down: outages of minutes, not seconds
    pause_s: float = 60.0  # how long a paused process (the tracker's leader, the runner) stays stopped
    kafka_brokers: int = 3  # 3: a KRaft cluster (min.insync.replicas 2) whose partition leader is killed
    job_clock_offset_s: float = 120.0  # the job side (runner replicas, Ray jobs) runs this far ahead
    send_over_s: float = 60.0  # the workload is spread over this long, faults run meanwhile
    # 200 batches as Ray jobs end at about 5 a minute on 2 cores (a Ray job each, max_in_flight 3)
    drain_timeout_s: float = 3600.0
    seed: int = 0
    run_dir: Path | None = None
    keep: bool = False


@dataclass
class ChaosResult:
    verdict: Verdict
    faults: dict[str, int]
    fault_log: list[str]
    drain_s: float
    not_alive: list[str] = field(default_factory=list)
    run_dir: Path | None = None
    job_clock_ahead_s: float | None = None
    """Median over completed batches of the job's manifest ``finished_at`` (the job side's clock) minus
    the terminal event's ``ce_time`` (the dispatcher's, later): the skew the jobs ran with, less the
    dispatcher's lag. None when no completed batch had a manifest."""

    @property
    def ok(self) -> bool:
        return self.verdict.ok and not self.not_alive

    def table(self) -> str:
        lines = [self.verdict.table()]
        lines += [f"faults {kind:<14}  {n:>8}" for kind, n in sorted(self.faults.items())]
        lines.append(f"{'time to drain (s)':<21}  {self.drain_s:>8.1f}")
        if self.job_clock_ahead_s is not None:
            lines.append(f"{'job clock ahead (s)':<21}  {self.job_clock_ahead_s:>8.1f}")
        lines += [f"  - not alive: {what}" for what in self.not_alive]
        if self.run_dir is not None:
            lines.append(f"logs and data kept in {self.run_dir}")
        return "\n".join(lines)


async def run(config: ChaosConfig) -> ChaosResult:
    """One run; the stack and replicas are stopped by PID at the end unless ``config.keep``."""
    import tempfile

    from llmbatch.adapters.topics import ensure_topics

    run = f"chaos{uuid.uuid4().hex[:6]}"
    run_dir = config.run_dir or Path(tempfile.mkdtemp(prefix="llmbatch-chaos-"))
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    cluster = KafkaCluster(run_dir, config.kafka_brokers) if config.kafka_brokers > 1 else None
    services = ["redis", "minio", "ray"] if cluster is not None else ["kafka", "redis", "minio", "ray"]
    stack = await asyncio.to_thread(manager.up, run_dir, services)
    replicas: list[DispatcherProcess] = []
    proxies: dict[str, FaultProxy] = {}
    results = dead = None
    result: ChaosResult | None = None
    try:
        settings = chaos_settings(stack, run, config.max_in_flight, config.shared_engines)
        if cluster is not None:
            await asyncio.to_thread(cluster.start)
            kafka = settings.kafka.model_copy(
                update={
                    "bootstrap_servers": cluster.bootstrap_servers,
                    "topics": settings.kafka.topics.model_copy(
                        update={"replication_factor": config.kafka_brokers}
                    ),
                }
            )
            settings = settings.model_copy(update={"kafka": kafka})
        if config.job_clock_offset_s:
            settings = skewed_job_clock(settings, config.job_clock_offset_s)
        kinds = config.faults or default_faults(config.shared_engines, kafka_brokers=config.kafka_brokers)
        settings = await behind_proxies(settings, proxies, {PROXIED[k] for k in kinds if k in PROXIED})
        records = workload(
            batches=config.batches,
            malformed=config.malformed,
            model=MODEL,
            now=datetime.now(UTC),
            run=run,
            seed=config.seed,
            input_bucket=settings.s3.input_bucket,
        )
        await ensure_topics(settings)
        await asyncio.to_thread(upload, settings, records)
        for i in range(config.replicas):
            opts = settings.dispatcher.model_copy(
                update={"instance_id": f"d{i}", "metrics_port": free_port()}
            )
            replica = DispatcherProcess(
                settings.model_copy(update={"dispatcher": opts}), run_dir / "logs" / f"dispatcher-d{i}.log"
            )
            replicas.append(replica.start())
        faults = Faults(
            run_dir,
            replicas,
            settings.ray.address,
            job_prefix=f"{run}-",
            down_s=config.down_s,
            pause_s=config.pause_s,
            proxies=proxies,
            kafka=cluster,
            requests_topic=settings.kafka.topics.requests,
        )
        sending = asyncio.create_task(send(settings, records, config.send_over_s))
        for _ in range(config.rounds):
            for kind in kinds:
                await asyncio.sleep(config.fault_every_s)
                if sending.done():
                    sending.result()  # the sender failed: stop here, with its error
                print(f"[chaos] {kind}: {await faults.inject(kind)}", flush=True)
        await sending
        began = time.monotonic()
        results = TopicReader(settings, settings.kafka.topics.results)
        dead = TopicReader(settings, settings.kafka.topics.dead_letter)
        while time.monotonic() - began < config.drain_timeout_s:
            if readback.drained(records, readback.seen(await results.poll())):
                break
            await asyncio.sleep(2)
        drain_s = time.monotonic() - began
        await asyncio.sleep(3)  # late re-deliveries and dead letters
        result_records, dead_records = await results.read_to_end(), await dead.read_to_end()
        answers = await asyncio.to_thread(readback.answers, settings, result_records)
        clock_ahead = await asyncio.to_thread(readback.job_clock_ahead, settings, result_records)
        # a batch's end may wait out one outage (Redis down: no state changes) on top of the stop wait
        bound = DEADLINE_BOUND_S + max(config.down_s, config.pause_s)
        verdict = judge(
            [r.sent for r in records],
            readback.seen(result_records),
            readback.marks(dead_records),
            answers,
            deadline_bound_s=bound,
        )
        stack_now = StackState.load(run_dir)
        not_alive = [f"dispatcher {p.log_path.name}" for p in replicas if not p.alive()]
        if cluster is not None:
            not_alive += [
                f"kafka node {n.node_id}" for n in cluster.nodes if n.node_id not in cluster.alive()
            ]
        not_alive += [
            f"{name} (pid {rec.pid})" for name, rec in stack_now.services.items() if not alive(rec.pid)
        ]
        result = ChaosResult(
            verdict, dict(faults.counts), faults.log, drain_s, not_alive, job_clock_ahead_s=clock_ahead
        )
        if config.keep or config.run_dir is not None or not result.ok:
            result.run_dir = run_dir
        return result
    finally:
        for reader in (results, dead):
            if reader is not None:
                await reader.close()
        for replica in replicas:
            replica.terminate(timeout=30)
        for proxy in proxies.values():
            await proxy.close()
        if cluster is not None and not config.keep:
            await asyncio.to_thread(cluster.stop)
        if not config.keep:
            await asyncio.to_thread(manager.down, run_dir)
            if result is not None and result.run_dir is None:  # a passing run in a temp dir
                await asyncio.to_thread(shutil.rmtree, run_dir, True)
