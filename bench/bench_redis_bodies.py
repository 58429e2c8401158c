"""Benchmark: Redis memory held by queued inline batches, request bodies kept in the batch hash vs
kept on the requests topic only (``LLMBATCH_DISPATCHER__REQUEST_IN_REDIS_MAX_BYTES``).

    .venv/bin/python bench/bench_redis_bodies.py [--batches 500] [--lines 200] [--json]

Starts its own Redis (the stack's binary, a temporary data dir, appendfsync always as in production),
takes ``--batches`` inline batches of ``--lines`` chat lines each in through the dispatcher's own
intake path (``llmbatch.dispatcher.intake.commands.classify`` -> ``StateStore.intake_many``), once with every
body kept
(a limit above any record, the code before) and once with the default 16 KiB limit, each into an empty
database, and prints ``used_memory`` growth and the intake rate side by side. Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from llmbatch.dispatcher.domain.dlt import OriginalRecord  # noqa: E402
from llmbatch.dispatcher.domain.keys import Keys  # noqa: E402
from llmbatch.dispatcher.intake.commands import Accept, IntakeRules, classify  # noqa: E402
from llmbatch.dispatcher.state.store import StateStore  # noqa: E402
from llmbatch.schemas.batch import InlineLimits  # noqa: E402
from llmbatch.stack import services  # noqa: E402
from llmbatch.stack.process import stop_tree  # noqa: E402
from tests.support.dispatcher_kit import MODEL, batch_request, inline_lines, request_message  # noqa: E402


async def run(url: str, records: list[OriginalRecord], limit: int, prefix: str) -> dict[str, Any]:
    admin = redis.Redis.from_url(url)
    admin.flushall()
    before = int(admin.info("memory")["used_memory"])
    rules = IntakeRules(
        requests_topic="req",
        dlt_topic="req.dlt",
        group_id="g",
        served_models=frozenset({MODEL}),
        inline_limits=InlineLimits(max_requests=1000, max_bytes=16 << 20),
        request_in_redis_max_bytes=limit,
    )
    store = StateStore.from_url(url, keys=Keys(prefix))
    start = time.perf_counter()
    try:
        now = time.time()
        items = []
        for record in records:
            command = classify(record, rules, now)
            assert isinstance(command, Accept), command
            items.append(command.item)
        for i in range(0, len(items), 100):
            await store.intake_many(items[i : i + 100])
    finally:
        await store.close()
    seconds = time.perf_counter() - start
    used = int(admin.info("memory")["used_memory"]) - before
    return {
        "limit_bytes": limit,
        "used_memory_mib": round(used / 2**20, 2),
        "per_batch_kib": round(used / len(records) / 1024, 2),
        "batches_per_s": round(len(records) / seconds),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=500)
    parser.add_argument("--lines", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    records = []
    for n in range(args.batches):
        request = batch_request(f"mem-{n:05d}", requests=inline_lines(args.lines))
        key, value, headers = request_message(request)
        records.append(OriginalRecord("req", 0, n, key, value, tuple(headers), None, None))
    body = len(records[0].value or b"")
    run_dir = Path(tempfile.mkdtemp(prefix="bench-redis-bodies-"))
    rec = services.start_redis(run_dir)
    try:
        kept = asyncio.run(run(rec.address, records, 1 << 30, "kept"))
        topic = asyncio.run(run(rec.address, records, 16_384, "topic"))
    finally:
        stop_tree(rec.pid)
    result = {
        "batches": args.batches,
        "request_bytes": body,
        "bodies_in_redis": kept,
        "bodies_on_topic": topic,
        "memory_ratio": round(topic["used_memory_mib"] / max(kept["used_memory_mib"], 1e-9), 3),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{args.batches} queued inline batches of {args.lines} lines ({body:,} bytes per request record)"
        )
        for name in ("bodies_in_redis", "bodies_on_topic"):
            r = result[name]
            print(
                f"  {name:16} used_memory +{r['used_memory_mib']:8.2f} MiB "
                f"({r['per_batch_kib']:8.2f} KiB/batch), {r['batches_per_s']} batches/s"
            )
        print(f"  memory ratio (topic / redis): {result['memory_ratio']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
