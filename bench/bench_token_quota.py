"""Benchmark: what the enqueued-token quota costs at intake, and that it holds exactly.

Starts its own Kafka and Redis (a private folder, stopped by PID at the end) and runs the dispatcher's
consumer (the intake half, real Kafka and Redis) three times, each on fresh topics and keys, over the
same ``--batches`` inline batches of one tenant published before it starts:

- ``no limit``: no quota configured;
- ``limit, all fit``: a limit above every batch's tokens together;
- ``limit, half fit``: a limit of half of them: exactly that many are accepted, the rest refused
  (dead letter and ``rejected`` answer ``token_limit_exceeded``).

Prints batches taken in per second (consumer start -> every offset committed; a warm-up run of 50
first) for each, the ratio to ``no limit``, and the accepted / refused counts with what the limit
allows.

    .venv/bin/python bench/bench_token_quota.py [--batches 2000] [--lines 4] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.service.kafka_redis import kafka_and_redis  # noqa: E402
from llmbatch.adapters.topics import ensure_topics  # noqa: E402
from llmbatch.dispatcher.domain.quota import estimate_inline  # noqa: E402
from llmbatch.dispatcher.domain.states import State  # noqa: E402
from llmbatch.settings import KafkaSettings, LLMBatchSettings, RedisSettings, TenantSettings  # noqa: E402
from tests.support.consumer_harness import Harness, make_settings  # noqa: E402
from tests.support.dispatcher_kit import batch_request, inline_lines, request_message  # noqa: E402


async def one_run(base: LLMBatchSettings, limit: int | None, batches: int, lines: int) -> dict[str, Any]:
    settings = make_settings(base)
    if limit is not None:
        settings = settings.model_copy(
            update={"tenants": TenantSettings(max_enqueued_tokens={"acme": limit})}
        )
    harness = Harness(settings)
    body = inline_lines(lines)
    messages = [
        request_message(batch_request(f"q{n:06d}", tenant="acme", requests=body)) for n in range(batches)
    ]
    await ensure_topics(settings)
    await harness.send(messages)  # all there before the consumer starts
    started = time.perf_counter()
    await harness.start()
    try:
        while await harness.committed() < batches:
            harness.assert_alive()
            await asyncio.sleep(0.2)
        elapsed = time.perf_counter() - started
        queued = await harness.store.count(State.QUEUED)
        refused = await harness.store.count(State.DEAD_LETTERED)
        held = int(await harness.store.client.get(harness.store.keys.quota_tokens("acme")) or 0)
    finally:
        await harness.stop()
    return {
        "seconds": round(elapsed, 2),
        "batches_per_s": round(batches / elapsed, 1),
        "accepted": queued,
        "refused": refused,
        "tokens_held": held,
    }


async def run(args: argparse.Namespace, kafka: str, redis_url: str) -> dict[str, Any]:
    base = LLMBatchSettings(kafka=KafkaSettings(bootstrap_servers=kafka), redis=RedisSettings(url=redis_url))
    per_batch = estimate_inline(line["body"] for line in inline_lines(args.lines))
    half = args.batches // 2
    report: dict[str, Any] = {"batches": args.batches, "tokens_per_batch": per_batch}
    await one_run(base, None, 50, args.lines)  # warm-up (imports, the broker's first group), not reported
    report["no limit"] = await one_run(base, None, args.batches, args.lines)
    report["limit, all fit"] = await one_run(base, per_batch * args.batches, args.batches, args.lines)
    report["limit, half fit"] = await one_run(base, per_batch * half, args.batches, args.lines)
    report["limit, half fit"]["allowed"] = half
    free = report["no limit"]["batches_per_s"]
    for mode in ("limit, all fit", "limit, half fit"):
        report[mode]["rate_vs_no_limit"] = round(report[mode]["batches_per_s"] / free, 3)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--lines", type=int, default=4)
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args()
    with kafka_and_redis("bench-token-quota-") as (kafka, redis_url):
        report = asyncio.run(run(args, kafka, redis_url))
    print(json.dumps(report, indent=2))
    half = report["limit, half fit"]
    exact = half["accepted"] == half["allowed"] and half["accepted"] + half["refused"] == args.batches
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
