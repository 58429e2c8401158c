"""Helpers for dispatcher tests: building request records, reading the results and DLT topics."""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from llmbatch.chaos.processes import DispatcherProcess as DispatcherProcess
from llmbatch.chaos.processes import settings_env as settings_env
from llmbatch.dispatcher.domain.dlt import OriginalRecord
from llmbatch.ray_job.engines.backends import FAKE_BACKEND
from llmbatch.schemas.batch import BatchRequest, CancelRequest
from llmbatch.schemas.cloudevents import Envelope, decode, encode
from llmbatch.schemas.engines import EngineModel, EngineRegistry
from llmbatch.schemas.events import RESULT_EVENT_TYPES
from llmbatch.schemas.job import EngineConfig

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SOURCE = "urn:test:upstream"

Header = tuple[str, bytes]


def registry(
    engine: EngineConfig | None = None, *, path: str = "/models/unused", models: tuple[str, ...] = (MODEL,)
) -> EngineRegistry:
    """``DispatcherSettings.engines`` serving ``models`` (default: :data:`MODEL`), each with ``engine``
    (default: the fake backend) loaded from ``path``."""
    config = engine if engine is not None else EngineConfig(backend=FAKE_BACKEND)
    return EngineRegistry(models={m: EngineModel(path=path, engine=config) for m in models})


def registry_env(engines: EngineRegistry | None = None) -> dict[str, str]:
    """``LLMBATCH_ENGINES__MODELS`` of ``engines`` (default: :func:`registry`), for a dispatcher process."""
    import json

    models = (engines or registry()).model_dump(mode="json", exclude_defaults=True)["models"]
    return {"LLMBATCH_ENGINES__MODELS": json.dumps(models)}


def inline_lines(n: int, *, model: str = MODEL, prefix: str = "req") -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"{prefix}-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": f"Say {i}"}], "max_tokens": 8},
        }
        for i in range(n)
    ]


def batch_request(batch_id: str | None = None, **overrides: Any) -> BatchRequest:
    data: dict[str, Any] = {
        "batch_id": batch_id or f"b-{uuid.uuid4().hex[:12]}",
        "model": MODEL,
        "endpoint": "/v1/chat/completions",
        "requests": inline_lines(3),
        "priority": 5,
        "metadata": {"team": "test"},
    }
    data.update(overrides)
    if "input_uri" in overrides:
        data.pop("requests", None)
    return BatchRequest.model_validate(data)


def request_message(
    request: BatchRequest | CancelRequest,
    *,
    event_id: str | None = None,
    source: str = SOURCE,
    extra_headers: list[Header] | None = None,
    traceparent: str | None = None,
) -> tuple[bytes, bytes, list[Header]]:
    envelope = Envelope.new(
        request,
        source=source,
        id=event_id or str(uuid.uuid4()),
        traceparent=traceparent,
        extra_headers=extra_headers or [],
    )
    return encode(envelope)


def origin(
    key: bytes | None,
    value: bytes | None,
    headers: list[Header],
    *,
    topic: str = "llm.batch.requests.v1",
    partition: int = 0,
    offset: int = 0,
) -> OriginalRecord:
    return OriginalRecord(topic, partition, offset, key, value, tuple(headers), 1_700_000_000_000, 0)


@dataclass
class TopicReader:
    """Reads a whole topic from the beginning (no group) and keeps what it saw."""

    kafka_kwargs: dict[str, Any]
    topic: str
    records: list[Any] = field(default_factory=list)

    async def read_all(self, idle_ms: int = 1500) -> list[Any]:
        """Every record on the topic, read until none comes for ``idle_ms``."""
        return await self._read(idle_ms, to_end=False)

    async def read_to_end(self, stall_ms: int = 1500) -> list[Any]:
        """Every record on the topic when called: read from the beginning up to the end offsets it has
        then, without :meth:`read_all`'s idle wait (for a test that already knows every record it needs
        is written, e.g. a dead letter once its request's offset is committed). Stops early, with what it
        has, when no record comes for ``stall_ms``."""
        return await self._read(stall_ms, to_end=True)

    async def _read(self, wait_ms: int, *, to_end: bool) -> list[Any]:
        from aiokafka import AIOKafkaConsumer

        consumer = AIOKafkaConsumer(
            self.topic,
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            **self.kafka_kwargs,
        )
        await consumer.start()  # without a group, it is given every partition of the topic
        try:
            parts = sorted(consumer.assignment())
            end = await consumer.end_offsets(parts) if to_end else None
            out: list[Any] = []
            while end is None or [tp for tp in parts if await consumer.position(tp) < end[tp]]:
                batch = await consumer.getmany(timeout_ms=wait_ms, max_records=5000)
                if not batch:
                    break
                for recs in batch.values():
                    out.extend(recs)
            self.records = out
            return out
        finally:
            await consumer.stop()


def decode_results(records: list[Any]) -> list[Envelope[Any]]:
    return [decode(r.key, r.value, r.headers, expect=RESULT_EVENT_TYPES) for r in records]


def terminal_ids(envelopes: list[Envelope[Any]]) -> dict[str, set[str]]:
    """batch_id -> the set of terminal ce_ids seen (exactly-one means a set of size one)."""
    out: dict[str, set[str]] = defaultdict(set)
    for env in envelopes:
        if env.is_terminal:
            out[env.batch_id].add(env.id)
    return out


def terminal_events(envelopes: list[Envelope[Any]]) -> dict[str, list[Envelope[Any]]]:
    out: dict[str, list[Envelope[Any]]] = defaultdict(list)
    for env in envelopes:
        if env.is_terminal:
            out[env.batch_id].append(env)
    return out


async def wait_for(check: Any, within: float, interval: float = 0.5, what: str = "condition") -> Any:
    """Poll an (async or sync) predicate until it returns a truthy value; fail after ``timeout``."""
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    last: Any = None
    while loop.time() < end:
        last = check()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {within:.0f}s waiting for {what} (last: {last!r})")


# --- the dispatcher as a separate process (kill -9 tests) -------------------------------------------


# settings_env and DispatcherProcess (the dispatcher as a separate process) live with the chaos suite,
# which runs replicas too: llmbatch.chaos.processes


def assert_task_alive(task: asyncio.Task[Any] | None, what: str) -> None:
    """Fails the test when a task that runs until stopped has ended on its own: with its exception as
    the cause, so the test shows why it died."""
    if task is None or not task.done():
        return
    error = None if task.cancelled() else task.exception()
    raise AssertionError(f"{what} ended before it was stopped ({error!r})") from error
