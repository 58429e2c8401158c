"""Helpers for dispatcher tests: building request records, reading the results and DLT topics."""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from dispatcher.dlt import OriginalRecord
from schemas.batch import BatchRequest, CancelRequest
from schemas.cloudevents import Envelope, decode, encode
from schemas.engines import EngineModel, EngineRegistry
from schemas.events import RESULT_EVENT_TYPES
from schemas.job import EngineConfig

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SOURCE = "urn:test:upstream"

Header = tuple[str, bytes]


def registry(
    engine: EngineConfig | None = None, *, path: str = "/models/unused", models: tuple[str, ...] = (MODEL,)
) -> EngineRegistry:
    """``DispatcherSettings.engines`` serving ``models`` (default: :data:`MODEL`), each with ``engine``
    (default: the fake backend) loaded from ``path``."""
    config = engine if engine is not None else EngineConfig(backend="fake")
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
        from aiokafka import AIOKafkaConsumer

        consumer = AIOKafkaConsumer(
            self.topic,
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            **self.kafka_kwargs,
        )
        await consumer.start()
        try:
            out: list[Any] = []
            while True:
                batch = await consumer.getmany(timeout_ms=idle_ms, max_records=5000)
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


def settings_env(settings: Any, prefix: str = "LLMBATCH_") -> dict[str, str]:
    """Environment variables that reproduce ``settings`` (nested with ``__``; lists/dicts as JSON)."""
    import orjson
    from pydantic import BaseModel, SecretStr

    out: dict[str, str] = {}

    def walk(value: Any, path: list[str]) -> None:
        if isinstance(value, BaseModel):
            for name in type(value).model_fields:
                walk(getattr(value, name), [*path, name])
            return
        key = prefix + "__".join(p.upper() for p in path)
        if value is None:
            return
        if isinstance(value, SecretStr):
            out[key] = value.get_secret_value()
        elif isinstance(value, bool):
            out[key] = "true" if value else "false"
        elif isinstance(value, list | dict | BaseModel):
            out[key] = orjson.dumps(
                value, default=lambda v: v.model_dump(mode="json") if isinstance(v, BaseModel) else str(v)
            ).decode()
        else:
            out[key] = str(value)

    walk(settings, [])
    return out


class DispatcherProcess:
    """``python -m dispatcher`` in its own session, logs to a file; stopped by PID only."""

    def __init__(self, settings: Any, log_path: Any, **env: str) -> None:
        self.settings = settings
        self.log_path = log_path
        self.env = env
        self.proc: Any = None

    def start(self, **env: str) -> DispatcherProcess:
        import os
        import subprocess
        import sys

        full = {k: v for k, v in os.environ.items() if not k.startswith("LLMBATCH_")}
        full.update(settings_env(self.settings))
        full.update(self.env)
        full.update(env)
        full["PYTHONUNBUFFERED"] = "1"
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dispatcher"],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=full,
                start_new_session=True,
            )
        finally:
            log.close()
        return self

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        import signal

        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def terminate(self, timeout: float = 60) -> int:
        import signal

        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                return int(self.proc.wait(timeout))
            except Exception:
                self.kill9()
        return int(self.proc.returncode) if self.proc is not None else 0

    def tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])
