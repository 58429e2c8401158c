"""The OpenAI-compatible HTTP API end to end, driven by the official ``openai`` SDK: ``llmbatch api``
and a dispatcher as processes on the test stack (Kafka, Redis, MinIO, a Ray head), real vLLM on CPU
(SmolLM2-135M-Instruct). files.create -> batches.create -> batches.retrieve until done ->
files.content, every output body validated with the SDK's own ChatCompletion; list and cancel too; and
the same file sent as a Kafka event gives the same outputs (greedy decoding)."""

from __future__ import annotations

import json
import os
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from llmbatch.adapters.storage import make_client
from llmbatch.adapters.topics import ensure_topics
from llmbatch.api.tenancy.auth import hash_api_key
from llmbatch.chaos.processes import DispatcherProcess
from llmbatch.dispatcher.domain.keys import BatchKey
from llmbatch.schemas.events import EventType
from llmbatch.schemas.job import EngineConfig
from llmbatch.settings import KafkaSettings, RaySettings, RedisSettings, S3Settings
from llmbatch.settings.webhooks import WebhookSettings
from llmbatch.stack.ports import free_port
from tests.e2e.test_dispatcher_e2e import Env, buckets, world  # noqa: F401 (buckets is a fixture)
from tests.support.dispatcher_kit import batch_request, inline_lines, request_message, wait_for
from tests.support.webhook_receiver import Receiver

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1200)]
API_KEY = "sk-e2e-" + os.urandom(6).hex()
WEBHOOK_KEY = os.urandom(24).hex()
TERMINAL = {"completed", "failed", "expired", "cancelled"}


class ApiProcess:
    """``python -m llmbatch.api`` on a free loopback port, with the dispatcher's settings as its environment
    (a :class:`DispatcherProcess` of module ``api``: own session, stopped by PID)."""

    def __init__(self, settings: Any, log_path: Path) -> None:
        self.port = free_port()
        self.process = DispatcherProcess(
            settings,
            log_path,
            module="llmbatch.api",
            args=["--port", str(self.port), "--log-level", "warning"],
            LLMBATCH_API__KEYS=json.dumps({hash_api_key(API_KEY): "default"}),
        ).start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def wait_ready(self, within: float = 60) -> None:
        end = time.monotonic() + within
        while time.monotonic() < end:
            if not self.process.alive():
                raise AssertionError(f"the API exited: {self.process.tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/livez", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"the API did not answer /livez within {within} s")


def vllm_world(
    kafka: KafkaSettings,
    redis: RedisSettings,
    s3: S3Settings,
    ray: RaySettings,
    *,
    batch_size: int = 8,
    **opts: Any,
) -> Any:
    """A test world (:func:`tests.e2e.test_dispatcher_e2e.world`) on real vLLM with the local model."""
    from llmbatch.stack.model import ensure_model
    from llmbatch.stack.state import CACHE_DIR

    engine = EngineConfig(
        backend="vllm",
        enforce_eager=True,
        dtype="auto",
        max_model_len=1024,
        num_cpus_per_replica=1.0,
        batch_size=batch_size,
    )
    return world(
        kafka,
        redis,
        s3,
        ray,
        engine=engine,
        model_path=str(ensure_model()),
        job={"engine_cache_dir": str(CACHE_DIR / "engine-cache")},
        heartbeat_timeout_s=600,
        **opts,
    )


@pytest.fixture
def vllm_settings(
    kafka_settings: KafkaSettings,
    redis_settings: RedisSettings,
    buckets: S3Settings,  # noqa: F811
    ray_settings: RaySettings,
) -> Any:
    settings = vllm_world(kafka_settings, redis_settings, buckets, ray_settings)
    # webhooks on, for the API (endpoints) and the dispatcher (deliveries), to a receiver on loopback
    webhooks = WebhookSettings(
        signing_key=WEBHOOK_KEY, allow_networks=["127.0.0.1/32"], allow_http=True, retry_s=[1.0] * 20
    )
    return settings.model_copy(update={"webhooks": webhooks})


@pytest.fixture
def api(vllm_settings: Any, tmp_path: Path) -> Iterator[ApiProcess]:
    running = ApiProcess(vllm_settings, tmp_path / "api.log")
    try:
        running.wait_ready()
        yield running
    finally:
        running.process.stop_checked(timeout=20)  # fails the test when it had ended on its own


def _wait_done(client: Any, batch_id: str, within: float) -> Any:
    end = time.monotonic() + within
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in TERMINAL or time.monotonic() > end:
            return batch
        time.sleep(2)


def _texts(outputs: list[dict[str, Any]]) -> dict[str, str]:
    """custom_id -> the answer's text."""
    return {o["custom_id"]: o["response"]["body"]["choices"][0]["message"]["content"] for o in outputs}


async def test_the_openai_sdk_runs_a_batch_through_the_http_api_on_real_vllm(
    vllm_settings: Any, api: ApiProcess, tmp_path: Path
) -> None:
    import asyncio

    from openai import BadRequestError, OpenAI
    from openai.types import Batch, FileObject
    from openai.types.chat import ChatCompletion

    await ensure_topics(vllm_settings)
    e = Env(vllm_settings, tmp_path)
    e.spawn()
    client = OpenAI(base_url=api.base_url, api_key=API_KEY, max_retries=0, timeout=60)
    receiver = Receiver()
    receiver.up()
    try:
        # a webhook endpoint, made with the SDK's own call; its secret goes to the receiver, which verifies
        # every delivery with the SDK's client.webhooks.unwrap
        terminal: Any = ["batch.completed", "batch.failed", "batch.cancelled", "batch.expired"]
        made = await asyncio.to_thread(
            client.webhooks.create, url=receiver.url, event_types=terminal, name="e2e"
        )
        receiver.secret = made.signing_secret
        # loopback outside the operator's allow-list (127.0.0.1/32) is refused, naming the url
        with pytest.raises(BadRequestError) as refused:
            await asyncio.to_thread(
                client.webhooks.create, url="http://127.0.0.2:9/x", event_types=terminal, name="no"
            )
        assert refused.value.param == "url" and refused.value.code == "webhook_target_refused"
        lines = inline_lines(5, prefix="http")
        for line in lines:
            line["body"].update(max_tokens=8, temperature=0)  # greedy: comparable with the Kafka run
        data = b"".join(orjson.dumps(line) + b"\n" for line in lines)
        uploaded = await asyncio.to_thread(client.files.create, file=("in.jsonl", data), purpose="batch")
        assert FileObject.model_validate(uploaded.model_dump()).bytes == len(data)
        batch = await asyncio.to_thread(
            client.batches.create,
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={"suite": "e2e"},
            extra_body={"priority": 9},  # llmbatch's extension
        )
        e.batch_ids.add(batch.id)
        assert batch.status == "validating" and batch.input_file_id == uploaded.id
        assert batch.model_extra == {"priority": 9}
        # a second batch of the same file, cancelled at once: it waits behind the first (one job at a time)
        other = await asyncio.to_thread(
            client.batches.create,
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
        e.batch_ids.add(other.id)
        cancelling = await asyncio.to_thread(client.batches.cancel, other.id)
        assert cancelling.status in {"cancelling", "cancelled"}
        listed = await asyncio.to_thread(client.batches.list, limit=10)
        assert {batch.id, other.id} <= {b.id for b in listed.data}

        done = await asyncio.to_thread(_wait_done, client, batch.id, 900)
        Batch.model_validate(done.model_dump())
        assert done.status == "completed", done
        record = await e.store.get(BatchKey(batch.id))
        assert record is not None and record.get("priority") == "9"  # as the dispatcher took it in
        counts = done.request_counts
        assert counts is not None and (counts.total, counts.completed, counts.failed) == (5, 5, 0)
        assert done.output_file_id and done.completed_at and done.metadata == {"suite": "e2e"}
        content = await asyncio.to_thread(client.files.content, done.output_file_id)
        outputs = [orjson.loads(raw) for raw in content.text.splitlines() if raw.strip()]
        assert sorted(o["custom_id"] for o in outputs) == sorted(line["custom_id"] for line in lines)
        results = await asyncio.to_thread(client.files.list, purpose="batch_output")
        assert done.output_file_id in [f.id for f in results.data]
        for out in outputs:
            assert out["response"]["status_code"] == 200 and out["error"] is None
            completion = ChatCompletion.model_validate(out["response"]["body"])
            assert completion.choices[0].message.content
            assert completion.usage is not None and completion.usage.completion_tokens > 0

        cancelled = await asyncio.to_thread(_wait_done, client, other.id, 300)
        assert cancelled.status == "cancelled", cancelled

        # the same uploaded file as a batch.requested event on Kafka (what upstream services send)
        s3 = vllm_settings.s3
        request = batch_request(
            f"kafka-{uuid.uuid4().hex[:8]}",
            input_uri=f"s3://{s3.input_bucket}/default/files/{uploaded.id}.jsonl",
            priority=2,
        )
        await e.send(request_message(request))
        event = (await e.wait_terminal([request.batch_id], within=900))[request.batch_id][0]
        assert event.type is EventType.COMPLETED, event.data
        storage = make_client(s3)
        kafka_outputs = []
        for uri in event.data.output_uris:
            bucket, _, key = str(uri).removeprefix("s3://").partition("/")
            body = storage.get_object(bucket, key).read()
            kafka_outputs += [orjson.loads(raw) for raw in body.splitlines()]
        assert _texts(kafka_outputs) == _texts(outputs) and len(outputs) == 5
        # the tenant's key reads that Kafka batch and its output file through the API too
        seen = await asyncio.to_thread(client.batches.retrieve, request.batch_id)
        assert seen.status == "completed" and seen.output_file_id and seen.model_extra == {"priority": 2}, (
            seen
        )
        via_api = await asyncio.to_thread(client.files.content, seen.output_file_id)
        assert _texts([orjson.loads(raw) for raw in via_api.text.splitlines()]) == _texts(kafka_outputs)

        # the three ends reached the webhook endpoint, whichever way each batch came in, once each, with
        # the Kafka event's id
        wanted = {
            (batch.id, "batch.completed"),
            (other.id, "batch.cancelled"),
            (request.batch_id, "batch.completed"),
        }
        await wait_for(
            lambda: {(r.batch_id, r.type) for r in receiver.accepted} == wanted, 120, what="the webhooks"
        )
        assert len(receiver.ids()) == len(set(receiver.ids())) == 3 and receiver.refused == []
        kafka_event = next(r for r in receiver.accepted if r.batch_id == request.batch_id)
        assert kafka_event.webhook_id == event.id
    finally:
        receiver.down()
        client.close()
        await e.close()
