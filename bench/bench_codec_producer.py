"""Benchmark: CloudEvents codec throughput and producer publish throughput.

    python bench/bench_codec_producer.py                 # codec only, plus publish if a broker answers
    python bench/bench_codec_producer.py --local-stack   # start the project's Kafka for the publish part
    LLMBATCH_KAFKA__BOOTSTRAP_SERVERS=host:9092 python bench/bench_codec_producer.py --publish-events 20000

Codec: events per CPU-second for a typical ``batch.requested`` event (file input, metadata) and an inline one
(10 chat requests), encode and decode, plus the alternatives the codec could have used (pydantic's
Rust JSON vs orjson) so the choice stays measured. Publish: events/s with ``acks=all`` one at a time
(latency bound) and pipelined (throughput bound), against a real broker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmbatch.schemas import BatchRequest, Envelope, decode, encode  # noqa: E402
from llmbatch.schemas.cloudevents import Header  # noqa: E402
from llmbatch.schemas.events import EVENT_DATA_MODELS, EventType  # noqa: E402
from llmbatch.settings import LLMBatchSettings, TopicSettings  # noqa: E402

TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def typical_request(batch_id: str = "nightly-eval-2026-03-01") -> BatchRequest:
    return BatchRequest.model_validate(
        {
            "batch_id": batch_id,
            "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
            "endpoint": "/v1/chat/completions",
            "input_uri": "s3://llmbatch-input/default/inputs/"
            "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08.jsonl",
            "completion_window": "24h",
            "priority": 5,
            "metadata": {"team": "search", "job": "nightly-eval", "owner": "svc-eval"},
            "tenant": "default",
        }
    )


def inline_request(n: int = 10) -> BatchRequest:
    return BatchRequest.model_validate(
        {
            "batch_id": "inline-batch-1",
            "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
            "endpoint": "/v1/chat/completions",
            "requests": [
                {
                    "custom_id": f"req-{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "messages": [
                            {"role": "system", "content": "You are concise."},
                            {"role": "user", "content": f"Summarise document number {i} in one line."},
                        ],
                        "max_tokens": 64,
                        "temperature": 0.0,
                    },
                }
                for i in range(n)
            ],
        }
    )


def rate(fn: Callable[[], Any], *, seconds: float, repeats: int) -> tuple[float, float]:
    """Median and best calls per CPU-second over ``repeats`` runs of about ``seconds`` each.

    Process CPU time, not wall time: the codec is single-threaded CPU work, and CPU time keeps the
    numbers comparable on a shared machine where other processes take turns on the cores.
    """
    fn()
    results = []
    for _ in range(repeats):
        count, start = 0, time.process_time()
        deadline = start + seconds
        while True:
            for _ in range(100):
                fn()
            count += 100
            now = time.process_time()
            if now >= deadline:
                break
        results.append(count / (now - start))
    return statistics.median(results), max(results)


def _cases(
    env: Envelope[BatchRequest], data: BatchRequest, key: bytes, value: bytes, headers: list[Header]
) -> dict[str, Callable[[], Any]]:
    """What the codec bench times for one request (closures over this call, not over a loop)."""
    model = EVENT_DATA_MODELS[EventType.BATCH_REQUESTED]
    return {
        "encode": lambda: encode(env),
        "decode": lambda: decode(key, value, headers),
        "round_trip": lambda: decode(*encode(env)),
        # alternatives (not used by the codec), kept to justify its choice
        "alt_encode_orjson_dump": lambda: orjson.dumps(data.model_dump(mode="json")),
        "alt_encode_pydantic_json": lambda: data.model_dump_json(),
        "alt_decode_orjson_then_validate": lambda: model.model_validate(orjson.loads(value)),
        "alt_decode_pydantic_json": lambda: model.model_validate_json(value),
    }


def codec_bench(seconds: float, repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, data in (("typical", typical_request()), ("inline10", inline_request(10))):
        env = Envelope.new(data, source="urn:llmbatch:producer:bench", traceparent=TRACE)
        key, value, headers = encode(env)
        assert decode(key, value, headers) == env
        cases = _cases(env, data, key, value, headers)
        out[label] = {
            "value_bytes": len(value),
            "header_bytes": sum(len(n) + len(v) for n, v in headers),
            **{name: round(rate(fn, seconds=seconds, repeats=repeats)[0]) for name, fn in cases.items()},
        }
    return out


async def publish_bench(settings: LLMBatchSettings, events: int) -> dict[str, Any]:
    from llmbatch.adapters.kafka import Publisher
    from llmbatch.producer import ensure_topics

    suffix = uuid.uuid4().hex[:8]
    topics = TopicSettings(
        requests=f"bench-requests-{suffix}",
        results=f"bench-results-{suffix}",
        dead_letter=f"bench-dlt-{suffix}",
        partitions=3,
    )
    kafka = settings.kafka.model_copy(update={"topics": topics})
    await ensure_topics(kafka)
    envelopes = [Envelope.new(typical_request(f"bench-{i}"), source="urn:bench") for i in range(events)]
    out: dict[str, Any] = {"bootstrap_servers": kafka.bootstrap_servers, "events": events}
    for label, linger in (("pipelined_linger5ms", 5), ("pipelined_linger0", 0)):
        publisher = Publisher(kafka, publish_timeout_s=300, linger_ms=linger)
        await publisher.start()
        try:
            await publisher.publish_many(topics.requests, envelopes[:100])  # warm-up
            start = time.perf_counter()
            chunk = 1000
            for i in range(0, events, chunk):
                await publisher.publish_many(topics.requests, envelopes[i : i + chunk])
            elapsed = time.perf_counter() - start
        finally:
            await publisher.stop()
        out[label] = round(events / elapsed)
    sequential = min(events, 1000)
    publisher = Publisher(kafka, publish_timeout_s=60)
    await publisher.start()
    try:
        start = time.perf_counter()
        for envelope in envelopes[:sequential]:
            await publisher.publish(topics.requests, envelope)
        elapsed = time.perf_counter() - start
    finally:
        await publisher.stop()
    out["sequential_acks_all"] = round(sequential / elapsed)
    out["sequential_latency_ms"] = round(elapsed / sequential * 1000, 2)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=1.0, help="per codec measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--publish-events", type=int, default=10_000)
    parser.add_argument("--local-stack", action="store_true", help="start the project's Kafka for the run")
    parser.add_argument("--skip-publish", action="store_true")
    args = parser.parse_args()

    codec = codec_bench(args.seconds, args.repeats)
    report: dict[str, Any] = {"python": sys.version.split()[0], "codec_events_per_s": codec}
    if not args.skip_publish:
        run_dir = None
        settings = LLMBatchSettings()
        if args.local_stack:
            from llmbatch.stack import manager

            run_dir = Path(tempfile.mkdtemp(prefix="llmbatch-bench-"))
            state = manager.up(run_dir, ["kafka"])
            settings = manager.settings_for(state)
        try:
            report["publish_events_per_s"] = asyncio.run(publish_bench(settings, args.publish_events))
        except Exception as exc:  # a benchmark without a broker still reports the codec part
            report["publish_events_per_s"] = f"skipped: {type(exc).__name__}: {exc}"
        finally:
            if run_dir is not None:
                manager.down(run_dir, ["kafka"])
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
