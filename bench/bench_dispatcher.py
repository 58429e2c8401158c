"""Benchmark: the dispatcher's intake throughput, accept latency, memory, and event -> RUNNING overhead.

    eval "$(.venv/bin/llmbatch stack env)"      # Kafka, Redis, MinIO, Ray of `llmbatch stack up`
    .venv/bin/python bench/bench_dispatcher.py [--events 10000] [--singles 5] [--json] [--compare-fsync]

Phase 1 (intake): ``--events`` small ``batch.requested`` events (one inline request each) are
pre-loaded on a fresh requests topic; then ``python -m llmbatch.dispatcher`` starts with job launches limited
(its Ray address points at a closed port, so the tracker never starts a job and costs nothing) and
accepts everything into ``queued``. Reported: events/s accepted (first to last acceptance, from the
``accepted_at`` the dispatcher stores), p50/p99 accept latency (record fetched -> state durable in
Redis and ``accepted`` event acknowledged, from the ``llmbatch_dispatcher_accept_latency_seconds``
histogram, interpolated within buckets), the dispatcher's peak RSS.

Phase 2 (overhead): single small batches, one at a time, against the real Ray head with the fake
engine: event (record timestamp) -> submitted to Ray, and event -> RUNNING (as seen by the
dispatcher; Ray's own start time also shown). p50 over ``--singles`` batches.

Targets (issue 5): >= 2,000 events/s, p99 < 100 ms, RSS < 300 MB, overhead < 2 s. Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from llmbatch.ray_job.engines.backends import FAKE_BACKEND

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
from aiokafka import AIOKafkaProducer  # noqa: E402

from llmbatch.adapters.storage import ensure_buckets, make_client  # noqa: E402
from llmbatch.adapters.topics import ensure_topics  # noqa: E402
from llmbatch.dispatcher.domain.keys import batch_key  # noqa: E402
from llmbatch.dispatcher.job_options import JobOptions  # noqa: E402
from llmbatch.dispatcher.settings import DispatcherOptions, DispatcherSettings  # noqa: E402
from llmbatch.dispatcher.state.store import StateStore  # noqa: E402
from llmbatch.schemas.job import EngineConfig  # noqa: E402
from llmbatch.settings import LLMBatchSettings, RaySettings, TopicSettings  # noqa: E402
from llmbatch.stack.ports import free_port  # noqa: E402
from tests.support.dispatcher_kit import (  # noqa: E402
    DispatcherProcess,
    batch_request,
    inline_lines,
    registry,
    request_message,
)


def world(base: LLMBatchSettings, ray: RaySettings, **opts: Any) -> DispatcherSettings:
    tag = uuid.uuid4().hex[:8]
    topics = TopicSettings(
        requests=f"bench-req-{tag}",
        results=f"bench-res-{tag}",
        dead_letter=f"bench-req-{tag}.dlt",
        partitions=3,
    )
    options: dict[str, Any] = dict(
        group_id=f"bench-{tag}",
        metrics_port=free_port(),
        log_level="WARNING",
        max_queued=1_000_000,
        poll_interval_s=1.0,
        max_in_flight=1,
        shared_engines=False,  # intake and launch overhead of the Ray-job path
    )
    options.update(opts)
    return DispatcherSettings(
        kafka=base.kafka.model_copy(update={"topics": topics}),
        redis=base.redis.model_copy(update={"key_prefix": f"bench{tag}"}),
        s3=base.s3,
        ray=ray,
        dispatcher=DispatcherOptions(**options),
        job=JobOptions(python=sys.executable, progress_interval_s=1.0),
        engines=registry(EngineConfig(backend=FAKE_BACKEND, batch_size=4, num_cpus_per_replica=0.5)),
    )


async def preload(settings: DispatcherSettings, n: int) -> float:
    producer = AIOKafkaProducer(
        acks="all", linger_ms=20, max_batch_size=256 * 1024, **settings.kafka.client_kwargs()
    )
    await producer.start()
    start = time.perf_counter()
    try:
        futures = []
        one_line = inline_lines(1)
        for i in range(n):
            key, value, headers = request_message(batch_request(f"bench-{i:06d}", requests=one_line))
            futures.append(
                await producer.send(settings.kafka.topics.requests, value=value, key=key, headers=headers)
            )
        await asyncio.gather(*futures)
    finally:
        await producer.stop()
    return time.perf_counter() - start


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


def histogram_quantiles(text: str, name: str, qs: list[float]) -> dict[float, float]:
    buckets: list[tuple[float, float]] = []
    for line in text.splitlines():
        if line.startswith(f"{name}_bucket{{"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float("inf") if bound == "+Inf" else float(bound), float(line.rsplit(" ", 1)[1])))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0.0
    out: dict[float, float] = {}
    for q in qs:
        rank, prev_le, prev_count = q * total, 0.0, 0.0
        for le, count in buckets:
            if count >= rank:
                if le == float("inf"):
                    out[q] = prev_le
                else:
                    width = count - prev_count
                    frac = (rank - prev_count) / width if width else 1.0
                    out[q] = prev_le + (le - prev_le) * frac
                break
            prev_le, prev_count = le, count
    return out


async def phase_intake(base: LLMBatchSettings, n: int, run_dir: Path) -> dict[str, Any]:
    dead_ray = RaySettings(address=f"http://127.0.0.1:{free_port()}")  # launches limited to none
    settings = world(base, dead_ray)
    await ensure_topics(settings)
    produce_s = await preload(settings, n)
    store = StateStore.from_settings(settings.redis)
    proc = DispatcherProcess(settings, run_dir / "intake.log").start()
    ps = psutil.Process(proc.pid)
    peak_rss = 0
    t0 = time.perf_counter()
    cpu0 = None
    try:
        while True:
            peak_rss = max(peak_rss, ps.memory_info().rss)
            counts = await store.counts()  # one batch may have moved on to "submitted"
            queued = sum(counts.values())
            if queued and cpu0 is None:
                times = ps.cpu_times()
                cpu0 = times.user + times.system
            if queued >= n:
                times = ps.cpu_times()
                cpu_s = times.user + times.system - (cpu0 or 0.0)
                break
            if not proc.alive() or time.perf_counter() - t0 > 600:
                raise RuntimeError(f"dispatcher stalled at {queued}/{n}:\n{proc.tail()}")
            await asyncio.sleep(0.1)
        wall_s = time.perf_counter() - t0
        await asyncio.sleep(1.5)
        peak_rss = max(peak_rss, ps.memory_info().rss)
        metrics = scrape(settings.dispatcher.metrics_port or 0)
        ids = [batch_key(None, f"bench-{i:06d}") for i in range(n)]
        stamps: list[float] = []
        for start in range(0, n, 1000):
            records = await store.get_many(ids[start : start + 1000])
            stamps += [float(r.fields["accepted_at"]) for r in records if r is not None]
    finally:
        proc.terminate()
        await store.close()
    q = histogram_quantiles(metrics, "llmbatch_dispatcher_accept_latency_seconds", [0.5, 0.99])
    span = max(stamps) - min(stamps)
    return {
        "events": n,
        "accepted": len(stamps),
        "preload_s": round(produce_s, 2),
        "accept_span_s": round(span, 3),
        "events_per_s": round(len(stamps) / span, 1) if span > 0 else None,
        "wall_from_start_s": round(wall_s, 2),
        "accept_latency_p50_ms": round(q.get(0.5, 0.0) * 1000, 2),
        "accept_latency_p99_ms": round(q.get(0.99, 0.0) * 1000, 2),
        "dispatcher_peak_rss_mb": round(peak_rss / 2**20, 1),
        "dispatcher_cpu_s": round(cpu_s, 2),
        "events_per_cpu_s": round(len(stamps) / cpu_s, 1) if cpu_s > 0 else None,
        "load_avg_1m": round(psutil.getloadavg()[0], 2),
    }


async def phase_overhead(
    base: LLMBatchSettings, ray: RaySettings, singles: int, run_dir: Path
) -> dict[str, Any]:
    settings = world(base, ray)
    ensure_buckets(make_client(settings.s3), settings.s3)
    await ensure_topics(settings)
    store = StateStore.from_settings(settings.redis)
    proc = DispatcherProcess(settings, run_dir / "overhead.log").start()
    producer = AIOKafkaProducer(acks="all", **settings.kafka.client_kwargs())
    await producer.start()
    submitted, running, ray_start = [], [], []
    try:
        await asyncio.sleep(8)  # group join, first lease
        for i in range(singles):
            request = batch_request(f"single-{uuid.uuid4().hex[:8]}-{i}")
            key, value, headers = request_message(request)
            meta = await producer.send_and_wait(
                settings.kafka.topics.requests, value=value, key=key, headers=headers
            )
            sent = meta.timestamp / 1000
            deadline = time.time() + 300
            while time.time() < deadline:
                record = await store.get(batch_key(request.tenant, request.batch_id))
                if record is not None and record.state.is_terminal:
                    break
                await asyncio.sleep(0.2)
            else:
                raise RuntimeError(f"batch {request.batch_id} did not finish:\n{proc.tail()}")
            if record is None or record.number("running_at") is None:
                raise RuntimeError(f"batch {request.batch_id} never ran: {record}")
            submitted.append((record.number("submitted_at") or 0) - sent)
            running.append((record.number("running_at") or 0) - sent)
            ray_start.append((record.number("attempt_started_at") or 0) - sent)
    finally:
        await producer.stop()
        proc.terminate()
        await store.close()
    return {
        "singles": singles,
        "event_to_submitted_p50_s": round(statistics.median(submitted), 3),
        "event_to_running_p50_s": round(statistics.median(running), 3),
        "event_to_ray_start_p50_s": round(statistics.median(ray_start), 3),
        "event_to_running_all_s": [round(x, 2) for x in running],
    }


async def compare_fsync(base: LLMBatchSettings, n: int, run_dir: Path) -> dict[str, Any]:
    """The intake phase under each Redis ``appendfsync`` policy, one after the other."""
    import redis.asyncio as aioredis

    password = base.redis.password.get_secret_value() if base.redis.password else None
    # a plain connection refuses TLS keywords: name the CA only for a TLS url
    tls: dict[str, Any] = {"ssl_ca_certs": str(base.redis.ssl_ca_certs)} if base.redis.ssl_ca_certs else {}
    client = aioredis.Redis.from_url(base.redis.url, password=password, **tls)
    original = str((await client.config_get("appendfsync"))["appendfsync"])
    out: dict[str, Any] = {}
    try:
        for policy in ("everysec", "always"):
            await client.config_set("appendfsync", policy)
            out[policy] = await phase_intake(base, n, run_dir)
    finally:
        await client.config_set("appendfsync", original)
        await client.aclose()
    out["ratio"] = round(out["always"]["events_per_s"] / max(out["everysec"]["events_per_s"], 1e-9), 2)
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=10_000)
    parser.add_argument("--singles", type=int, default=5)
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--compare-fsync",
        action="store_true",
        help="run the intake phase with Redis appendfsync everysec, then always (CONFIG SET on the "
        "stack's Redis, restored after) and print both and their ratio",
    )
    args = parser.parse_args()
    base = LLMBatchSettings()
    run_dir = Path(tempfile.mkdtemp(prefix="bench-dispatcher-"))
    out: dict[str, Any] = {}
    if args.compare_fsync:
        out["fsync"] = await compare_fsync(base, args.events, run_dir)
        out["intake"] = out["fsync"]["always"]
    else:
        out["intake"] = await phase_intake(base, args.events, run_dir)
    if not args.skip_overhead:
        out["overhead"] = await phase_overhead(base, base.ray, args.singles, run_dir)
    out["cpus"] = psutil.cpu_count()
    out["logs"] = str(run_dir)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    if "fsync" in out:
        f = out["fsync"]
        print(
            f"appendfsync everysec: {f['everysec']['events_per_s']} events/s, p99 "
            f"{f['everysec']['accept_latency_p99_ms']} ms; always: {f['always']['events_per_s']} events/s, "
            f"p99 {f['always']['accept_latency_p99_ms']} ms; always/everysec throughput {f['ratio']}"
        )
    intake = out["intake"]
    print(
        f"intake: {intake['accepted']}/{intake['events']} events accepted at "
        f"{intake['events_per_s']} events/s "
        f"(target >= 2000); accept latency p50 {intake['accept_latency_p50_ms']} ms, "
        f"p99 {intake['accept_latency_p99_ms']} ms (target < 100); peak RSS "
        f"{intake['dispatcher_peak_rss_mb']} MB (target < 300)"
    )
    if "overhead" in out:
        o = out["overhead"]
        print(
            f"overhead over {o['singles']} single batches (p50): "
            f"event -> submitted {o['event_to_submitted_p50_s']} s, "
            f"event -> RUNNING {o['event_to_running_p50_s']} s (Ray start {o['event_to_ray_start_p50_s']} s; "
            "target < 2 s)"
        )
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main())
