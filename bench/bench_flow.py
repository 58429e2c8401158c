"""Benchmark: many small batches through the whole service at once, and what each one costs the service
(issue 53 item 2). Fake engine (the answers cost nothing: what is left is the service's own cost),
dispatcher defaults, the stack's engine entry, one run.

    .venv/bin/python bench/bench_flow.py [--batches 300] [--lines 4] [--rate 0] [--fake-delay-s 0]
        [--json] [--report PATH]

Starts a private local stack and a dispatcher process as ``bench/bench_service.py`` does (its harness),
warms the path with one batch, then publishes ``--batches`` batches of ``--lines`` inline lines, all at
once (a burst) or ``--rate`` a minute (a steady flow), and waits for every terminal event. Prints:

- batches per minute: batches / (first accepted -> last terminal event), and p50 / p90 / max
  accepted -> terminal (the dispatcher's ``ce_time``s). Targets: >= 600 per minute, p50 < 10 s.
- per batch: Redis commands (``INFO commandstats`` of the stack's Redis, by command, before and after)
  and the connections Redis accepted,
  Kafka records (the requests published plus every event on the results topic), and the CPU
  milliseconds of each process of the machine (the dispatcher, the batch runner's replicas, Kafka,
  Redis, MinIO, Ray's and Serve's own processes), from their CPU times before and after.

Everything started is stopped by PID (the private run folder is removed after a successful run). Not a
test.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.bench_ray_job import prompts  # noqa: E402
from bench.service.common import add_fake_engine_args, fake_engine_entry, say  # noqa: E402
from bench.service.cpu import cpu_snapshot  # noqa: E402
from bench.service.harness import Service, run_main  # noqa: E402

if TYPE_CHECKING:
    from llmbatch.settings import RedisSettings

T = TypeVar("T")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, default=300, help="batches published at once")
    parser.add_argument("--lines", type=int, default=4, help="inline lines per batch")
    parser.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="batches per minute, published evenly (a steady flow); 0: all at once (a burst)",
    )
    add_fake_engine_args(parser, delay_s=0.0, timeout_s=1800.0, waits="every batch")
    args = parser.parse_args()
    for name in ("batches", "lines"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.rate < 0:
        parser.error("--rate must be 0 (all at once) or a number of batches per minute")
    return fake_engine_entry(args)


async def redis_calls(redis: RedisSettings) -> tuple[dict[str, int], int, int]:
    """Calls so far of every Redis command (``INFO commandstats``), the connections Redis has accepted
    so far (``total_connections_received``) and the bytes of memory it uses (``used_memory``)."""
    from llmbatch.dispatcher.state.store import StateStore

    store = StateStore.from_settings(redis)
    try:
        stats = await store.client.info("commandstats")
        connections = int((await store.client.info("stats"))["total_connections_received"])
        memory = int((await store.client.info("memory"))["used_memory"])
    finally:
        await store.client.aclose()
    calls = {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}
    return calls, connections, memory


def per_batch(
    before: Mapping[str, float], after: Mapping[str, float], n: int, scale: float = 1.0
) -> dict[str, float]:
    delta = {k: (after.get(k, 0) - before.get(k, 0)) * scale / n for k in after}
    return {k: round(v, 2) for k, v in sorted(delta.items(), key=lambda kv: -kv[1]) if v > 0}


def cpu_by_label(snapshot: dict[int, tuple[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for label, seconds in snapshot.values():
        label = label.split(" ", 1)[0] if label.startswith("redis-server") else label  # no port: one row
        out[label] = out.get(label, 0.0) + seconds
    return out


async def paced(n: int, rate: float, submit: Callable[[int], Coroutine[Any, Any, T]]) -> list[T]:
    """``submit(i)`` for ``i`` in ``range(n)``: all at once (``rate`` 0) or one every ``60 / rate``
    seconds, on a schedule that does not drift (a late send is not made up by the ones after it waiting
    less); their results in order."""
    if not rate:
        return list(await asyncio.gather(*(submit(i) for i in range(n))))
    began, pending = time.monotonic(), []
    for i in range(n):
        await asyncio.sleep(max(0.0, began + i * 60.0 / rate - time.monotonic()))
        pending.append(asyncio.create_task(submit(i)))
    return list(await asyncio.gather(*pending))


async def flow(svc: Service, args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"setup": await svc.start()}
    say("[warm-up] one batch (the runner's replicas, the engine, the paths) ...")
    report["warmup"] = await svc.phase("warm", [(prompts(args.lines), 5)])
    texts = prompts(args.lines)
    (redis0, conn0, mem0), cpu0, events0 = (
        await redis_calls(svc.need()[3].redis),
        cpu_by_label(cpu_snapshot()),
        svc.ledger.events,
    )
    how = f"at {args.rate:g} per minute" if args.rate else "at once"
    say(f"[flow] {args.batches} batches of {args.lines} lines {how} ...")
    subs = await paced(args.batches, args.rate, lambda i: svc.submit(texts, priority=5, name=f"f{i}"))
    await svc.wait(subs, "the flow")
    (redis1, conn1, mem1), cpu1, events1 = (
        await redis_calls(svc.need()[3].redis),
        cpu_by_label(cpu_snapshot()),
        svc.ledger.events,
    )
    accepted = [svc.ledger.accepted[s.batch_id].time.timestamp() for s in subs]
    terminal = [svc.ledger.terminal[s.batch_id].time.timestamp() for s in subs]
    latencies = sorted(t - a for a, t in zip(accepted, terminal, strict=True))
    wall = max(terminal) - min(accepted)
    n = len(subs)
    redis = per_batch(redis0, redis1, n)
    report["flow"] = {
        "batches": n,
        "lines_per_batch": args.lines,
        "rate_per_min": args.rate or None,
        "wall_s": round(wall, 2),
        "batches_per_min": round(n / wall * 60, 1),
        "p50_accepted_to_terminal_s": round(statistics.median(latencies), 2),
        "p90_accepted_to_terminal_s": round(latencies[int(0.9 * (n - 1))], 2),
        "max_accepted_to_terminal_s": round(latencies[-1], 2),
        "redis_commands_per_batch": round(sum(redis.values()), 1),
        "redis_by_command": dict(list(redis.items())[:15]),
        # the bench's own two readings connect once each
        "redis_connections_per_batch": round((conn1 - conn0 - 1) / n, 2),
        # what a finished batch leaves in Redis (its state, the runner's run record) until they expire
        "redis_bytes_per_batch": round((mem1 - mem0) / n),
        "kafka_records_per_batch": round((n + events1 - events0) / n, 2),
        "cpu_ms_per_batch": dict(list(per_batch(cpu0, cpu1, n, scale=1000.0).items())[:15]),
    }
    return report


def show(report: dict[str, Any]) -> None:
    f = report["flow"]
    how = f"at {f['rate_per_min']:g}/min" if f["rate_per_min"] else "at once"
    print(
        f"{f['batches']} batches of {f['lines_per_batch']} lines {how} (fake engine): "
        f"{f['batches_per_min']} batches/min ({f['wall_s']} s first accepted -> last terminal); "
        f"accepted -> terminal p50 {f['p50_accepted_to_terminal_s']} s, "
        f"p90 {f['p90_accepted_to_terminal_s']} s, max {f['max_accepted_to_terminal_s']} s"
    )
    redis, kafka = f["redis_commands_per_batch"], f["kafka_records_per_batch"]
    conns = f["redis_connections_per_batch"]
    kept = f["redis_bytes_per_batch"]
    print(
        f"per batch: {redis} Redis commands, {conns} Redis connections, {kept} bytes kept in Redis, "
        f"{kafka} Kafka records"
    )
    print("  Redis commands by name: " + ", ".join(f"{k} {v}" for k, v in f["redis_by_command"].items()))
    print("  CPU ms by process: " + ", ".join(f"{k} {v}" for k, v in f["cpu_ms_per_batch"].items()))
    for name, target, met in (
        ("batches per minute", ">= 600", f["batches_per_min"] >= 600),
        ("p50 accepted -> terminal (s)", "< 10", f["p50_accepted_to_terminal_s"] < 10),
    ):
        print(f"  {name:32} target {target:7} {'met' if met else 'NOT met'}")


def main() -> int:
    return run_main(parse_args(), flow, show)


if __name__ == "__main__":
    sys.exit(main())
