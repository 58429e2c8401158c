"""A webhook receiver that is down for a while (10 minutes by default) gets every event afterwards, each
once by id: the proof of issue 54's webhook promise on real Kafka and Redis.

Starts its own Kafka and Redis (a private folder, stopped by PID at the end) and runs the dispatcher's
webhooks part (:class:`llmbatch.dispatcher.webhooks.runner.Webhooks`, the code a dispatcher runs) in
this process, with the product's retry schedule unless ``--retry-s`` says otherwise. Batch events are
published to the results topic across the outage; half way through it the webhooks part is stopped
and started again (its queue is in Redis, its offsets in Kafka). The receiver checks every delivery
with the official ``openai`` SDK (``client.webhooks.unwrap``). Prints a JSON report: events sent,
delivered, duplicates, dead, and when the last one arrived after the receiver came back.

    .venv/bin/python bench/webhook_outage.py                 # 10 minutes down, the default schedule
    .venv/bin/python bench/webhook_outage.py --down-s 60 --retry-s '[5,30,60]' --events 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from aiokafka import AIOKafkaProducer  # noqa: E402

from bench.service.kafka_redis import kafka_and_redis  # noqa: E402
from llmbatch.adapters.topics import ensure_topics  # noqa: E402
from llmbatch.dispatcher.domain.keys import Keys  # noqa: E402
from llmbatch.dispatcher.metrics import Metrics  # noqa: E402
from llmbatch.dispatcher.state.store import StateStore  # noqa: E402
from llmbatch.dispatcher.webhooks.runner import Webhooks  # noqa: E402
from llmbatch.dispatcher.webhooks.store import WebhookStore  # noqa: E402
from llmbatch.schemas import Envelope, encode  # noqa: E402
from llmbatch.schemas.events import BatchCancelled, BatchCompleted, BatchExpired, BatchFailed  # noqa: E402
from llmbatch.schemas.webhooks import WebhookEndpoint, endpoint_secret  # noqa: E402
from llmbatch.settings import KafkaSettings, TopicSettings  # noqa: E402
from llmbatch.settings.webhooks import DEFAULT_RETRY_S, WebhookSettings  # noqa: E402
from tests.support.webhook_receiver import Receiver  # noqa: E402

KINDS: list[Any] = [BatchCompleted, BatchFailed, BatchCancelled, BatchExpired]


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def event(n: int) -> Any:
    now = datetime.now(UTC)
    kind = KINDS[n % len(KINDS)]
    extra = {"error": {"code": "engine_error", "message": "x"}} if kind is BatchFailed else {}
    return kind(batch_id=f"b-{n:04d}", tenant="acme", model="m", accepted_at=now, finished_at=now, **extra)


async def run(args: argparse.Namespace, kafka_address: str, redis_url: str) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    kafka = KafkaSettings(
        bootstrap_servers=kafka_address,
        topics=TopicSettings(requests=f"req-{tag}", results=f"res-{tag}", dead_letter=f"req-{tag}.dlt"),
    )
    await ensure_topics(kafka)
    store = StateStore.from_url(redis_url, keys=Keys(f"w{tag}"))
    settings = WebhookSettings(
        signing_key=os.urandom(24).hex(),
        allow_networks=["127.0.0.1/32"],
        allow_http=True,
        retry_s=args.retry_s,
    )
    metrics = Metrics()
    receiver = Receiver()
    endpoint = WebhookEndpoint(
        id=f"whep_{uuid.uuid4().hex[:24]}", tenant="acme", url=receiver.url, created_at=int(time.time()) - 1
    )
    receiver.secret = endpoint_secret(settings.key_bytes(), endpoint.id, 1)

    async def start() -> tuple[Webhooks, list[asyncio.Task[None]]]:
        hooks = Webhooks(
            settings, kafka, redis=store.client, keys=store.keys, group_id=f"g-{tag}", metrics=metrics
        )
        await hooks.start()
        return hooks, hooks.tasks()

    async def stop(running: tuple[Webhooks, list[asyncio.Task[None]]]) -> None:
        hooks, tasks = running
        for task in tasks:
            if task.done():
                raise RuntimeError(f"{task.get_name()} died: {task.exception()!r}")
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await hooks.stop()

    producer = AIOKafkaProducer(**kafka.client_kwargs(), acks="all")
    await producer.start()
    sent: list[str] = []
    try:
        await WebhookStore(store.client, store.keys).put_endpoint(endpoint)
        running = await start()
        started = time.monotonic()
        say(f"receiver down for {args.down_s:.0f} s; {args.events} events across it; retry_s={args.retry_s}")
        restarted = False
        for n in range(args.events):
            envelope = Envelope.new(event(n), source="urn:bench:webhook-outage")
            key, value, headers = encode(envelope)
            await producer.send_and_wait(kafka.topics.results, value, key=key, headers=headers)
            sent.append(envelope.id)
            until = started + (n + 1) * args.down_s / args.events
            if not restarted and time.monotonic() - started >= args.down_s / 2:
                say("the webhooks part restarts (queue in Redis, offsets in Kafka)")
                await stop(running)
                running = await start()
                restarted = True
            await asyncio.sleep(max(0.0, until - time.monotonic()))
        receiver.up()
        up_at = time.monotonic()
        say(f"receiver up after {up_at - started:.0f} s; {len(receiver.accepted)} delivered so far")
        deadline = up_at + sum(args.retry_s) + 120
        last_at = up_at
        while len(set(receiver.ids()) & set(sent)) < len(sent) and time.monotonic() < deadline:
            before = len(receiver.accepted)
            await asyncio.sleep(1.0)
            if len(receiver.accepted) > before:
                last_at = time.monotonic()
        await asyncio.sleep(5.0)  # a duplicate would come now
        await stop(running)
        ids = receiver.ids()
        dead = await WebhookStore(store.client, store.keys).dead()
        report = {
            "down_s": round(up_at - started, 1),
            "events": len(sent),
            "delivered": len(set(ids) & set(sent)),
            "duplicates": len(ids) - len(set(ids)),
            "refused_by_receiver": len(receiver.refused),
            "dead": len(dead),
            "failed_attempts": metrics.registry.get_sample_value(
                "llmbatch_webhook_deliveries_total", {"outcome": "retried"}
            )
            or 0,
            "last_delivery_after_up_s": round(last_at - up_at, 1),
            "retry_s": args.retry_s,
        }
        return report
    finally:
        receiver.down()
        await producer.stop()
        keys = [k async for k in store.client.scan_iter(match=f"{store.keys.prefix}:*")]
        if keys:
            await store.client.delete(*keys)
        await store.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--down-s", type=float, default=600.0, help="how long the receiver is down")
    parser.add_argument("--events", type=int, default=20, help="events published across the outage")
    parser.add_argument(
        "--retry-s", type=json.loads, default=list(DEFAULT_RETRY_S), help="the retry waits, as JSON"
    )
    args = parser.parse_args()
    with kafka_and_redis("bench-webhook-outage-") as (kafka, redis_url):
        report = asyncio.run(run(args, kafka, redis_url))
    print(json.dumps(report, indent=2))
    ok = report["delivered"] == report["events"] and report["duplicates"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
