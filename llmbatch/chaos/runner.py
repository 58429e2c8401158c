"""One chaos run: the local stack, dispatcher replicas, the workload sent while faults are injected, then
the results topic, the dead-letter topic and the result files read back and judged
(:func:`llmbatch.chaos.verdict.judge`).

``python -m llmbatch.chaos`` (``make chaos``) runs the full version; tests/e2e/test_chaos.py the short
one. Everything runs on the real Kafka, Redis, MinIO and Ray of a private local stack; jobs run the
fake engine (the faults, not the model, are under test).
"""

from __future__ import annotations

import asyncio
import io
import logging
import shutil
import statistics
import sys
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson

from llmbatch.chaos.faults import PROXIED, Faults, default_faults
from llmbatch.chaos.kafka_cluster import KafkaCluster
from llmbatch.chaos.processes import DispatcherProcess
from llmbatch.chaos.proxy import FaultProxy, behind_proxies
from llmbatch.chaos.verdict import Kind, Seen, Verdict, judge
from llmbatch.chaos.workload import Record, workload
from llmbatch.dispatcher.job_options import JobOptions
from llmbatch.dispatcher.settings import DispatcherOptions, DispatcherSettings
from llmbatch.ray_job.backends import FAKE_BACKEND
from llmbatch.schemas.cloudevents import H_ID, decode
from llmbatch.schemas.engines import EngineModel, EngineRegistry, ReplicaResources
from llmbatch.schemas.events import RESULT_EVENT_TYPES, EventType
from llmbatch.schemas.job import EngineConfig, Manifest
from llmbatch.settings import TopicSettings
from llmbatch.stack import manager
from llmbatch.stack.ports import free_port
from llmbatch.stack.process import alive
from llmbatch.stack.state import StackState

log = logging.getLogger(__name__)

MODEL = "chaos/fake-model"
_STATUS = {
    EventType.ACCEPTED: "accepted",
    EventType.REJECTED: "rejected",
    EventType.COMPLETED: "completed",
    EventType.FAILED: "failed",
    EventType.CANCELLED: "cancelled",
    EventType.EXPIRED: "expired",
}


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


def chaos_settings(
    stack: Any, run: str, max_in_flight: int, shared_engines: bool = False
) -> DispatcherSettings:
    """Dispatcher settings on the run's stack: its own topics and key prefix, the fake engine, fast
    timers (leases, polls, heartbeats) so faults are noticed within seconds. ``shared_engines``: the
    batches run on the model's warm Serve engine (small ones on the batch runner), else each as a Ray
    job with an engine of its own."""
    base = manager.settings_for(stack)
    topics = TopicSettings(
        requests=f"{run}.req", results=f"{run}.res", dead_letter=f"{run}.req.dlt", partitions=3
    )
    engine = EngineConfig(backend=FAKE_BACKEND, batch_size=4, num_cpus_per_replica=0.25)
    return DispatcherSettings(
        _env_file=None,
        kafka=base.kafka.model_copy(update={"topics": topics}),
        redis=base.redis.model_copy(update={"key_prefix": run}),
        s3=base.s3,
        ray=base.ray,
        dispatcher=DispatcherOptions(
            group_id=f"{run}-g",
            session_timeout_ms=6000,
            heartbeat_interval_ms=1000,
            poll_interval_s=0.5,
            lease_ttl_s=4,
            retry_backoff_base_s=0.5,
            retry_backoff_max_s=4,
            io_backoff_base_s=0.2,
            io_backoff_max_s=2,
            log_json=True,
            max_in_flight=max_in_flight,
            shared_engines=shared_engines,
        ),
        engines=EngineRegistry(
            models={
                MODEL: EngineModel(
                    path="/models/unused", engine=engine, resources=ReplicaResources(num_cpus=0.25)
                )
            }
        ),
        job=JobOptions(
            python=sys.executable,
            progress_interval_s=0.5,
            ray_stop_wait_s=10,
            stop_wait_s=30,
            shard_max_seconds=2,
            shard_max_lines=10,
        ),
    )


LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")


def skewed_job_clock(settings: DispatcherSettings, offset_s: float) -> DispatcherSettings:
    """``settings`` whose jobs and batch-runner replicas see the wall clock ``offset_s`` ahead (libfaketime
    preloaded through the environment they are given: ``LLMBATCH_JOB__ENV_VARS``); the dispatchers, the
    engines and the services keep the true time. Their monotonic clock moves by the same constant, which
    leaves every interval as it was: excluding it (``FAKETIME_DONT_FAKE_MONOTONIC``) makes libfaketime
    0.9.10 pass a negative deadline to ``clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)``, so Python
    3.11's ``time.sleep`` fails with EINVAL (Ray's driver and Ray Data's executor both sleep)."""
    if not LIBFAKETIME.exists():
        raise RuntimeError(
            f"{LIBFAKETIME} is missing: the chaos suite skews the job side's clock with libfaketime "
            "(`make setup-test` installs it; apt-get install libfaketime)"
        )
    env = {
        **settings.job.env_vars,
        "LD_PRELOAD": str(LIBFAKETIME),
        "FAKETIME": f"{offset_s:+g}s",
        "FAKETIME_NO_CACHE": "1",
    }
    return settings.model_copy(update={"job": settings.job.model_copy(update={"env_vars": env})})


async def _send(settings: DispatcherSettings, records: list[Record], over_s: float) -> int:
    """Send ``records`` in order over about ``over_s`` seconds; a send the broker does not take (it is
    being killed) is tried again until it is (a re-sent record keeps its event id)."""
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(
        **{**settings.kafka.client_kwargs(), "request_timeout_ms": 15000},
        acks="all",
        max_request_size=8 << 20,
    )
    await producer.start()
    pause = over_s / max(1, len(records))
    retries = 0
    try:
        for record in records:
            value = record.value
            if value is not None and "expired" in record.sent.expect:
                # a deadline that cannot be met, counted from the send (the workload was made before)
                deadline = (datetime.now(UTC) + timedelta(seconds=3)).isoformat()
                value = orjson.dumps({**orjson.loads(value), "deadline": deadline})
            while True:
                try:
                    await producer.send_and_wait(
                        settings.kafka.topics.requests,
                        value=value,
                        key=record.key,
                        headers=list(record.headers),
                    )
                    break
                except Exception as exc:  # the broker is down for a while: wait, send again
                    retries += 1
                    log.info("send failed, again in 2 s: %s", exc)
                    await asyncio.sleep(2)
            await asyncio.sleep(pause)
    finally:
        await producer.stop()
    return retries


def _upload(settings: DispatcherSettings, records: Iterable[Record]) -> None:
    from llmbatch.adapters.storage import ensure_buckets, make_client

    client = make_client(settings.s3)
    ensure_buckets(client, settings.s3)
    for record in records:
        if record.upload is not None:
            key, body = record.upload
            client.put_object(settings.s3.input_bucket, key, io.BytesIO(body), len(body))


class _Reader:
    """Reads a topic from the beginning, incrementally (no group)."""

    def __init__(self, settings: DispatcherSettings, topic: str) -> None:
        self.settings, self.topic = settings, topic
        self.records: list[Any] = []
        self._consumer: Any = None

    async def poll(self) -> list[Any]:
        from aiokafka import AIOKafkaConsumer

        try:
            if self._consumer is None:
                self._consumer = AIOKafkaConsumer(
                    self.topic,
                    group_id=None,
                    enable_auto_commit=False,
                    auto_offset_reset="earliest",
                    **self.settings.kafka.client_kwargs(),
                )
                await self._consumer.start()
            batch = await self._consumer.getmany(timeout_ms=1000, max_records=10_000)
        except Exception as exc:  # the broker is being restarted: read on later
            log.info("reading %s failed: %s", self.topic, exc)
            await self.close()
            self.records = []  # a new consumer starts from the beginning again
            return self.records
        for records in batch.values():
            self.records.extend(records)
        return self.records

    async def read_to_end(self, within: float = 120.0) -> list[Any]:
        """Everything on the topic now: polls until every partition's position reached the end
        offsets asked for first (one poll may bring only part of a topic with large records)."""
        loop = asyncio.get_running_loop()
        end_at = loop.time() + within
        await self.poll()
        while self._consumer is None or not self._consumer.assignment():
            if loop.time() > end_at:
                raise TimeoutError(f"{self.topic}: no partitions assigned within {within:.0f} s")
            await self.poll()
        consumer = self._consumer
        ends = await consumer.end_offsets(list(consumer.assignment()))
        while True:
            positions = {tp: await consumer.position(tp) for tp in ends}
            if all(positions[tp] >= end for tp, end in ends.items()):
                return self.records
            if loop.time() > end_at:
                raise TimeoutError(f"{self.topic}: not read to its end within {within:.0f} s")
            await self.poll()

    async def close(self) -> None:
        if self._consumer is not None:
            consumer, self._consumer = self._consumer, None
            try:
                await consumer.stop()
            except Exception as exc:
                log.debug("consumer stop: %s", exc)


def _seen(records: list[Any]) -> list[Seen]:
    out: list[Seen] = []
    for r in records:
        env = decode(r.key, r.value, r.headers, expect=RESULT_EVENT_TYPES)
        status = _STATUS.get(env.type)
        if status is not None:
            request_id = getattr(env.data, "request_id", None)
            out.append(Seen(status, env.batch_id, env.id, request_id, at=env.time.timestamp()))
    return out


def _drained(sent: list[Record], seen: list[Seen]) -> bool:
    """Every batch is rejected or has a terminal event, every duplicate is answered."""
    terminal = {s.batch_id for s in seen if s.status in {"completed", "failed", "cancelled", "expired"}}
    answered = {s.request_id for s in seen if s.status == "rejected"}
    for record in sent:
        s = record.sent
        if s.kind is Kind.BATCH and s.batch_id not in terminal and s.event_id not in answered:
            return False
        if s.kind is Kind.DUPLICATE and s.event_id not in answered:
            return False
    return True


def _marks(records: list[Any]) -> set[str]:
    marks: set[str] = set()
    for r in records:
        if r.key:
            marks.add(r.key.decode(errors="replace"))
        marks.update(v.decode(errors="replace") for k, v in (r.headers or ()) if k == H_ID and v)
    return marks


def _answers(settings: DispatcherSettings, results: list[Any]) -> dict[str, list[str]]:
    """batch id -> the custom_ids of its output and error lines, for completed batches."""
    from llmbatch.adapters.storage import make_client

    client = make_client(settings.s3)
    out: dict[str, list[str]] = {}
    for r in results:
        env = decode(r.key, r.value, r.headers, expect=RESULT_EVENT_TYPES)
        if env.type is not EventType.COMPLETED or env.batch_id in out:
            continue
        ids: list[str] = []
        for uri in [*env.data.output_uris, *env.data.error_uris]:
            bucket, _, key = str(uri)[5:].partition("/")
            for line in client.get_object(bucket, key).read().splitlines():
                if line.strip():
                    ids.append(str(orjson.loads(line).get("custom_id")))
        out[env.batch_id] = ids
    return out


def _job_clock_ahead(settings: DispatcherSettings, results: list[Any]) -> float | None:
    """The median of (manifest ``finished_at`` - terminal ``ce_time``) over completed batches: how far
    ahead of the dispatcher the clock that wrote the manifests ran (:attr:`ChaosResult.job_clock_ahead_s`)."""
    from llmbatch.adapters.storage import make_client

    client = make_client(settings.s3)
    ahead: list[float] = []
    for r in results:
        env = decode(r.key, r.value, r.headers, expect=RESULT_EVENT_TYPES)
        if env.type is not EventType.COMPLETED or env.data.manifest_uri is None:
            continue
        bucket, _, key = str(env.data.manifest_uri)[5:].partition("/")
        manifest = Manifest.model_validate_json(client.get_object(bucket, key).read())
        ahead.append((manifest.timings.finished_at - env.time).total_seconds())
    return statistics.median(ahead) if ahead else None


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
        await asyncio.to_thread(_upload, settings, records)
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
        sending = asyncio.create_task(_send(settings, records, config.send_over_s))
        for _ in range(config.rounds):
            for kind in kinds:
                await asyncio.sleep(config.fault_every_s)
                if sending.done():
                    sending.result()  # the sender failed: stop here, with its error
                print(f"[chaos] {kind}: {await faults.inject(kind)}", flush=True)
        await sending
        began = time.monotonic()
        results = _Reader(settings, settings.kafka.topics.results)
        dead = _Reader(settings, settings.kafka.topics.dead_letter)
        while time.monotonic() - began < config.drain_timeout_s:
            if _drained(records, _seen(await results.poll())):
                break
            await asyncio.sleep(2)
        drain_s = time.monotonic() - began
        await asyncio.sleep(3)  # late re-deliveries and dead letters
        result_records, dead_records = await results.read_to_end(), await dead.read_to_end()
        answers = await asyncio.to_thread(_answers, settings, result_records)
        clock_ahead = await asyncio.to_thread(_job_clock_ahead, settings, result_records)
        # a batch's end may wait out one outage (Redis down: no state changes) on top of the stop wait
        bound = DEADLINE_BOUND_S + max(config.down_s, config.pause_s)
        verdict = judge(
            [r.sent for r in records],
            _seen(result_records),
            _marks(dead_records),
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
