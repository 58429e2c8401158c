"""Producer SDK and CLI against the real stack (Apache Kafka + MinIO from the ``settings`` fixture).

Each module run uses its own topics and tenant so it never sees other tests' records.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from typer.testing import CliRunner

from llmbatch.adapters import storage
from llmbatch.producer import (
    BatchClient,
    ClientOptions,
    InvalidInput,
    ResultsNotFound,
    WaitTimeout,
    cli,
    ensure_topics,
)
from llmbatch.schemas import (
    BatchAccepted,
    BatchCompleted,
    BatchFailed,
    BatchProgress,
    BatchRequest,
    CancelRequest,
    Endpoint,
    Envelope,
    ErrorObject,
    EventType,
    InlineLimits,
    RequestCounts,
    Usage,
    decode,
    encode,
    stable_event_id,
)
from llmbatch.settings import LLMBatchSettings, TopicSettings
from tests.support.dispatcher_kit import wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
runner = CliRunner()


# ------------------------------------------------------------------------------ fixtures & helpers


@pytest.fixture(scope="module")
def psettings(settings: LLMBatchSettings) -> LLMBatchSettings:
    """The stack's settings with topics private to this module."""
    suffix = uuid.uuid4().hex[:8]
    topics = TopicSettings(
        requests=f"it-requests-{suffix}",
        results=f"it-results-{suffix}",
        dead_letter=f"it-dlt-{suffix}",
        partitions=3,
        replication_factor=1,
    )
    return settings.model_copy(update={"kafka": settings.kafka.model_copy(update={"topics": topics})})


@pytest.fixture(scope="module")
async def prepared(psettings: LLMBatchSettings) -> LLMBatchSettings:
    created = await ensure_topics(psettings)
    assert sorted(created) == sorted(
        [psettings.kafka.topics.requests, psettings.kafka.topics.results, psettings.kafka.topics.dead_letter]
    )
    storage.ensure_buckets(storage.make_client(psettings.s3), psettings.s3)
    return psettings


@pytest.fixture
async def client(prepared: LLMBatchSettings) -> AsyncIterator[BatchClient]:
    async with BatchClient(prepared, options=ClientOptions(source="urn:test:producer")) as c:
        yield c


@pytest.fixture
def tenant() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


def line(custom_id: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": f"Say {custom_id}"}], "max_tokens": 8, **body},
    }


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_bytes(b"".join((r if isinstance(r, bytes) else orjson.dumps(r)) + b"\n" for r in rows))
    return path


async def read_at(settings: LLMBatchSettings, topic: str, partition: int, offset: int) -> Any:
    consumer = AIOKafkaConsumer(**settings.kafka.client_kwargs(), group_id=None, enable_auto_commit=False)
    await consumer.start()
    try:
        tp = TopicPartition(topic, partition)
        consumer.assign([tp])
        consumer.seek(tp, offset)
        return await asyncio.wait_for(consumer.getone(), 20)
    finally:
        await consumer.stop()


async def topic_partitions(settings: LLMBatchSettings, topic: str) -> list[TopicPartition]:
    admin = AIOKafkaAdminClient(**settings.kafka.client_kwargs())
    await admin.start()
    try:
        (described,) = await admin.describe_topics([topic])
    finally:
        await admin.close()
    tps = [TopicPartition(topic, p["partition"]) for p in described["partitions"]]
    assert tps, f"topic {topic} has no partitions"
    return sorted(tps)


async def all_records(settings: LLMBatchSettings, topic: str) -> list[Any]:
    tps = await topic_partitions(settings, topic)
    consumer = AIOKafkaConsumer(**settings.kafka.client_kwargs(), group_id=None, enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        records: list[Any] = []
        while any([await consumer.position(tp) < ends[tp] for tp in tps]):
            for batch in (await consumer.getmany(timeout_ms=1000)).values():
                records.extend(batch)
        return records
    finally:
        await consumer.stop()


async def end_offsets(settings: LLMBatchSettings, topic: str) -> dict[int, int]:
    tps = await topic_partitions(settings, topic)
    consumer = AIOKafkaConsumer(**settings.kafka.client_kwargs(), group_id=None)
    await consumer.start()
    try:
        return {tp.partition: off for tp, off in (await consumer.end_offsets(tps)).items()}
    finally:
        await consumer.stop()


def objects_under(settings: LLMBatchSettings, bucket: str, prefix: str) -> list[Any]:
    return list(storage.make_client(settings.s3).list_objects(bucket, prefix=prefix, recursive=True))


async def publish_raw(
    settings: LLMBatchSettings, envelope: Envelope[Any], timestamp_ms: int | None = None
) -> None:
    """Publish like the dispatcher does (optionally back-dated, to test time-based following)."""
    producer = AIOKafkaProducer(**settings.kafka.client_kwargs(), acks="all")
    await producer.start()
    try:
        key, value, headers = encode(envelope)
        await producer.send_and_wait(
            settings.kafka.topics.results, value=value, key=key, headers=headers, timestamp_ms=timestamp_ms
        )
    finally:
        await producer.stop()


def completed_event(batch_id: str, *, status: str = "completed", **extra: Any) -> Envelope[Any]:
    now = datetime.now(UTC)
    fields: dict[str, Any] = {
        "batch_id": batch_id,
        "model": MODEL,
        "accepted_at": now - timedelta(seconds=5),
        "finished_at": now,
        "request_counts": RequestCounts(total=2, completed=2),
        "usage": Usage(prompt_tokens=4, completion_tokens=6),
        "attempts": 1,
        "ray_submission_id": f"{batch_id}-a1",
        **extra,
    }
    if status == "failed":
        data: Any = BatchFailed(**fields, error=ErrorObject(code="attempts_exhausted", message="lost"))
    else:
        data = BatchCompleted(**fields)
    event_type = EventType.FAILED if status == "failed" else EventType.COMPLETED
    return Envelope.new(data, source="urn:test:dispatcher", id=stable_event_id(batch_id, event_type))


# ------------------------------------------------------------------------------ topics


async def described_configs(admin: AIOKafkaAdminClient, names: list[str]) -> dict[str, dict[str, str]]:
    """Each topic's configs as the broker describes them. A topic just created can be described with
    an error code and no configs until the broker's metadata has it (creation is asynchronous): asked
    again then, for 15 s at most; topics described without an error are returned as they are."""

    async def without_errors() -> dict[str, dict[str, str]] | None:
        described = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, n) for n in names])
        resources = [resource for response in described for resource in response.resources]
        if any(resource[0] != 0 for resource in resources):
            return None
        return {resource[3]: {entry[0]: entry[1] for entry in resource[4]} for resource in resources}

    found: dict[str, dict[str, str]] = await wait_for(
        without_errors, 15, interval=0.2, what=f"topics {names} described without an error code"
    )
    return found


async def test_ensure_topics_creates_missing_ones_once(settings: LLMBatchSettings) -> None:
    suffix = uuid.uuid4().hex[:8]
    topics = TopicSettings(
        requests=f"et-a-{suffix}", results=f"et-b-{suffix}", dead_letter=f"et-c-{suffix}", partitions=2
    )
    custom = settings.kafka.model_copy(update={"topics": topics})
    assert sorted(await ensure_topics(custom)) == sorted(
        [topics.requests, topics.results, topics.dead_letter]
    )
    assert await ensure_topics(custom) == []
    admin = AIOKafkaAdminClient(**custom.client_kwargs())
    await admin.start()
    try:
        described = await admin.describe_topics([topics.requests, topics.dead_letter])
        assert [len(t["partitions"]) for t in described] == [2, 2]
        flat = (await described_configs(admin, [topics.dead_letter]))[topics.dead_letter]
        assert flat["retention.ms"] == str(30 * 24 * 3600 * 1000)
    finally:
        await admin.close()


async def test_topics_take_records_up_to_the_settings_size(settings: LLMBatchSettings) -> None:
    """ensure_topics sets max.message.bytes from the settings (not the brokers' 1 MiB default), and the
    producer SDK sends records up to that size: an inline batch of 1.5 MB is published."""
    from llmbatch.adapters.kafka import Publisher

    suffix = uuid.uuid4().hex[:8]
    topics = TopicSettings(
        requests=f"sz-a-{suffix}",
        results=f"sz-b-{suffix}",
        dead_letter=f"sz-c-{suffix}",
        partitions=1,
        max_message_bytes=3 << 20,
        dead_letter_max_message_bytes=(3 << 20) + 65536,
    )
    custom = settings.kafka.model_copy(update={"topics": topics})
    await ensure_topics(custom)
    admin = AIOKafkaAdminClient(**custom.client_kwargs())
    await admin.start()
    try:
        described = await described_configs(admin, [topics.requests, topics.results, topics.dead_letter])
        sizes = {name: configs["max.message.bytes"] for name, configs in described.items()}
    finally:
        await admin.close()
    assert sizes == {
        topics.requests: str(3 << 20),
        topics.results: str(3 << 20),
        topics.dead_letter: str((3 << 20) + 65536),
    }
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "q" * 5000}]},
        }
        for i in range(300)
    ]
    request = BatchRequest.model_validate(
        {"batch_id": f"big-{suffix}", "model": "m", "endpoint": "/v1/chat/completions", "requests": lines}
    )
    publisher = Publisher(custom)
    try:
        published = await publisher.publish(topics.requests, Envelope.new(request, source="urn:test"))
    finally:
        await publisher.stop()
    assert published.topic == topics.requests and published.offset == 0


# ------------------------------------------------------------------------------ submit


async def test_submit_file_uploads_object_and_publishes_event_with_headers(
    client: BatchClient, prepared: LLMBatchSettings, tmp_path: Path, tenant: str
) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [line("a"), line("b", temperature=0.5), line("c")])
    batch_id = f"it-{uuid.uuid4().hex[:12]}"
    handle = await client.submit(
        file=path,
        model=MODEL,
        batch_id=batch_id,
        tenant=tenant,
        metadata={"team": "search"},
        priority=8,
        completion_window="2h",
    )
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert handle.input_uri == f"s3://{prepared.s3.input_bucket}/{tenant}/inputs/{digest}.jsonl"
    assert (handle.batch_id, handle.request_count, handle.skipped_lines) == (batch_id, 3, 0)
    # the object is in MinIO, byte for byte
    data = storage.get_bytes(client.s3, prepared.s3, handle.input_uri)
    assert data == path.read_bytes()
    # the event is on the requests topic, keyed by batch id, with CloudEvents binary-mode headers
    assert handle.published is not None
    record = await read_at(
        prepared, handle.published.topic, handle.published.partition, handle.published.offset
    )
    assert record.key == batch_id.encode()
    headers = dict(record.headers)
    assert headers["ce_specversion"] == b"1.0"
    assert headers["ce_type"] == b"llmbatch.batch.requested.v1"
    assert headers["ce_subject"] == batch_id.encode()
    assert headers["ce_id"] == handle.event_id.encode()
    assert headers["ce_source"] == b"urn:test:producer"
    assert headers["content-type"] == b"application/json"
    assert datetime.fromisoformat(headers["ce_time"].decode()) == handle.submitted_at
    envelope = decode(record.key, record.value, list(record.headers))
    request = envelope.data
    assert isinstance(request, BatchRequest)
    assert (request.input_uri, request.requests, request.metadata, request.priority, request.tenant) == (
        handle.input_uri,
        None,
        {"team": "search"},
        8,
        tenant,
    )
    assert request.endpoint is Endpoint.CHAT_COMPLETIONS
    assert json.loads(record.value)["completion_window"] == "2h"


async def test_same_file_is_uploaded_once(
    client: BatchClient, prepared: LLMBatchSettings, tmp_path: Path, tenant: str
) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [line("x"), line("y")])
    first = await client.submit(file=path, model=MODEL, tenant=tenant)
    stat_before = client.s3.stat_object(*storage.split_uri(first.input_uri or ""))
    await asyncio.sleep(1.1)  # MinIO's last-modified has second resolution
    second = await client.submit(file=path, model=MODEL, tenant=tenant)
    assert second.input_uri == first.input_uri
    assert second.batch_id != first.batch_id
    stat_after = client.s3.stat_object(*storage.split_uri(second.input_uri or ""))
    assert stat_after.last_modified == stat_before.last_modified  # not re-uploaded
    assert len(objects_under(prepared, prepared.s3.input_bucket, f"{tenant}/")) == 1


async def test_file_with_a_bad_line_uploads_and_publishes_nothing(
    client: BatchClient, prepared: LLMBatchSettings, tmp_path: Path, tenant: str
) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [line("a"), line("b", top_p=7), b"{broken"])
    before = await end_offsets(prepared, prepared.kafka.topics.requests)
    with pytest.raises(InvalidInput) as info:
        await client.submit(file=path, model=MODEL, tenant=tenant)
    assert [(e.line, e.field) for e in info.value.errors] == [(2, "body.top_p"), (3, None)]
    assert await end_offsets(prepared, prepared.kafka.topics.requests) == before
    assert objects_under(prepared, prepared.s3.input_bucket, f"{tenant}/") == []


async def test_skip_invalid_uploads_only_valid_lines(
    client: BatchClient, prepared: LLMBatchSettings, tmp_path: Path, tenant: str
) -> None:
    path = write_jsonl(tmp_path / "mixed.jsonl", [line("a"), line("b", n=3), line("c")])
    handle = await client.submit(file=path, model=MODEL, tenant=tenant, skip_invalid=True)
    assert (handle.request_count, handle.skipped_lines) == (2, 1)
    uploaded = storage.get_bytes(client.s3, prepared.s3, handle.input_uri or "")
    assert [orjson.loads(raw)["custom_id"] for raw in uploaded.splitlines()] == ["a", "c"]
    assert (handle.input_uri or "").endswith(f"{hashlib.sha256(uploaded).hexdigest()}.jsonl")


async def test_inline_requests_travel_in_the_event(client: BatchClient, prepared: LLMBatchSettings) -> None:
    handle = await client.submit([line("a"), line("b")], model=MODEL)
    assert handle.input_uri is None
    assert handle.published is not None
    record = await read_at(
        prepared, handle.published.topic, handle.published.partition, handle.published.offset
    )
    request = decode(record.key, record.value, list(record.headers)).data
    assert isinstance(request, BatchRequest)
    assert [r.custom_id for r in request.requests or []] == ["a", "b"]


async def test_inline_requests_over_the_limit_are_uploaded(prepared: LLMBatchSettings, tenant: str) -> None:
    options = ClientOptions(inline_limits=InlineLimits(max_requests=2))
    async with BatchClient(prepared, options=options) as small:
        handle = await small.submit([line("a"), line("b"), line("c")], model=MODEL, tenant=tenant)
    assert handle.input_uri is not None
    uploaded = storage.get_bytes(small.s3, prepared.s3, handle.input_uri)
    assert [orjson.loads(raw)["custom_id"] for raw in uploaded.splitlines()] == ["a", "b", "c"]
    strict = ClientOptions(inline_limits=InlineLimits(max_requests=2), spill_to_storage=False)
    async with BatchClient(prepared, options=strict) as no_spill:
        with pytest.raises(InvalidInput, match="exceed the limit of 2"):
            await no_spill.submit([line("a"), line("b"), line("c")], model=MODEL, tenant=tenant)


async def test_cancel_publishes_cancel_requested_on_the_batch_key(
    client: BatchClient, prepared: LLMBatchSettings
) -> None:
    handle = await client.submit([line("a")], model=MODEL)
    published = await handle.cancel("not needed")
    assert handle.published is not None
    assert published.partition == handle.published.partition  # same key, same partition: ordered
    record = await read_at(prepared, published.topic, published.partition, published.offset)
    envelope = decode(record.key, record.value, list(record.headers))
    assert envelope.type is EventType.CANCEL_REQUESTED
    assert envelope.data == CancelRequest(batch_id=handle.batch_id, reason="not needed")


# ------------------------------------------------------------------------------ follow & wait


async def test_wait_returns_the_terminal_event_another_task_publishes(
    client: BatchClient, prepared: LLMBatchSettings
) -> None:
    handle = await client.submit([line("a"), line("b")], model=MODEL)
    other = await client.submit([line("a")], model=MODEL)  # events of another batch must be filtered out

    async def dispatcher() -> None:
        await asyncio.sleep(1.0)
        now = datetime.now(UTC)
        await publish_raw(
            prepared,
            Envelope.new(
                BatchAccepted(
                    batch_id=handle.batch_id,
                    model=MODEL,
                    endpoint=Endpoint.CHAT_COMPLETIONS,
                    accepted_at=now,
                    expires_at=now + timedelta(hours=24),
                ),
                source="urn:test:dispatcher",
            ),
        )
        await publish_raw(prepared, completed_event(other.batch_id))
        await publish_raw(
            prepared,
            Envelope.new(
                BatchProgress(
                    batch_id=handle.batch_id,
                    request_counts=RequestCounts(total=2, completed=1),
                    updated_at=now,
                ),
                source="urn:test:dispatcher",
            ),
        )
        terminal = completed_event(handle.batch_id)
        await publish_raw(prepared, terminal)
        await publish_raw(prepared, terminal)  # redelivered: same ce_id

    task = asyncio.create_task(dispatcher())
    done = await handle.wait(timeout=60)
    await task
    assert done.type is EventType.COMPLETED
    assert done.subject == handle.batch_id
    assert isinstance(done.data, BatchCompleted)
    assert done.data.request_counts.completed == 2
    seen = []
    async with aclosing(handle.events()) as stream:
        async for envelope in stream:
            seen.append(envelope.type)
    assert seen == [EventType.ACCEPTED, EventType.PROGRESS, EventType.COMPLETED]  # duplicate dropped


async def test_events_start_at_a_time_not_at_the_beginning(settings: LLMBatchSettings) -> None:
    # a fresh topic: Kafka finds the first offset whose timestamp is >= `since`, so the back-dated
    # record must come first in its partition, as it would in real life
    suffix = uuid.uuid4().hex[:8]
    topics = TopicSettings(requests=f"ts-a-{suffix}", results=f"ts-b-{suffix}", dead_letter=f"ts-c-{suffix}")
    fresh = settings.model_copy(update={"kafka": settings.kafka.model_copy(update={"topics": topics})})
    await ensure_topics(fresh)
    batch_id = f"it-{uuid.uuid4().hex[:12]}"
    now = datetime.now(UTC)
    old = Envelope.new(
        BatchProgress(
            batch_id=batch_id, request_counts=RequestCounts(total=2), updated_at=now - timedelta(hours=2)
        ),
        source="urn:test:dispatcher",
    )
    await publish_raw(fresh, old, timestamp_ms=int((now - timedelta(hours=2)).timestamp() * 1000))
    await publish_raw(fresh, completed_event(batch_id))
    async with BatchClient(fresh) as client:
        recent = await client.wait(batch_id, timeout=30, since=now - timedelta(hours=1))
        assert recent.type is EventType.COMPLETED
        from_recent = [e.id async for e in client.events(batch_id, since=now - timedelta(hours=1))]
        assert from_recent == [recent.id]  # the older record was not read
        everything = [e.id async for e in client.events(batch_id, since=None)]
        assert everything == [old.id, recent.id]
        nothing_yet = client.events(batch_id, since=now + timedelta(hours=1))
        with pytest.raises(TimeoutError):  # nothing at/after `since`: it waits at the end
            await asyncio.wait_for(anext(nothing_yet), 3)
        await nothing_yet.aclose()


async def test_wait_times_out_for_a_batch_that_never_ends(client: BatchClient) -> None:
    started = time.monotonic()
    with pytest.raises(WaitTimeout) as info:
        await client.wait(f"never-{uuid.uuid4().hex[:8]}", timeout=3)
    assert info.value.retriable
    assert time.monotonic() - started < 15


# ------------------------------------------------------------------------------ results


def put_results(settings: LLMBatchSettings, tenant: str, batch_id: str) -> None:
    prefix = f"s3://{settings.s3.results_bucket}/{tenant}/{batch_id}/"
    s3 = storage.make_client(settings.s3)
    out = b"".join(
        orjson.dumps(
            {
                "id": f"batch_req_{i}",
                "custom_id": cid,
                "response": {
                    "status_code": 200,
                    "request_id": f"r{i}",
                    "body": {"choices": [{"message": {"role": "assistant", "content": cid.upper()}}]},
                },
                "error": None,
            }
        )
        + b"\n"
        for i, cid in enumerate(["a", "b"])
    )
    err = (
        orjson.dumps(
            {
                "id": "batch_req_9",
                "custom_id": "c",
                "response": None,
                "error": {"code": "invalid_value", "message": "bad"},
            }
        )
        + b"\n"
    )
    storage.put_bytes(s3, settings.s3, prefix + "output-a1-00000.jsonl", out, len(out))
    storage.put_bytes(s3, settings.s3, prefix + "error-a1-00000.jsonl", err, len(err))
    manifest = {
        "batch_id": batch_id,
        "attempt": 1,
        "status": "completed",
        "request_counts": {"total": 3, "completed": 2, "failed": 1},
        "output_shards": [{"uri": prefix + "output-a1-00000.jsonl", "lines": 2}],
        "error_shards": [{"uri": prefix + "error-a1-00000.jsonl", "lines": 1}],
        "timings": {"started_at": "2026-01-01T00:00:00Z", "finished_at": "2026-01-01T00:01:00Z"},
    }
    raw = orjson.dumps(manifest)
    storage.put_bytes(s3, settings.s3, prefix + "manifest.json", raw, len(raw))


async def test_results_by_custom_id_via_manifest_and_event(
    client: BatchClient, prepared: LLMBatchSettings, tenant: str
) -> None:
    batch_id = f"it-{uuid.uuid4().hex[:12]}"
    put_results(prepared, tenant, batch_id)
    manifest = await client.manifest(batch_id, tenant=tenant)
    outputs = await client.results_by_custom_id(manifest)
    assert sorted(outputs) == ["a", "b"]
    assert all(o.ok for o in outputs.values())
    errors = await client.results_by_custom_id(manifest, errors=True)
    assert errors["c"].error is not None
    assert errors["c"].error.code == "invalid_value"
    event = completed_event(batch_id, output_uris=manifest.output_uris, error_uris=manifest.error_uris)
    assert sorted(await client.results_by_custom_id(event)) == ["a", "b"]
    with pytest.raises(ResultsNotFound):
        await client.manifest("no-such-batch", tenant=tenant)


# ------------------------------------------------------------------------------ CLI


def test_cli_submit_wait_watch_results_cancel(
    prepared: LLMBatchSettings, tmp_path: Path, tenant: str
) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [line("a"), line("b")])
    batch_id = f"cli-{uuid.uuid4().hex[:10]}"

    def finish_later() -> None:
        time.sleep(2)
        put_results(prepared, tenant, batch_id)
        asyncio.run(publish_raw(prepared, completed_event(batch_id, tenant=tenant)))

    thread = threading.Thread(target=finish_later)
    thread.start()
    result = runner.invoke(
        cli.app,
        [
            "submit",
            str(path),
            "--model",
            MODEL,
            "--batch-id",
            batch_id,
            "--tenant",
            tenant,
            "--metadata",
            "k=v",
            "--wait",
            "--timeout",
            "60",
            "--json",
        ],
        obj=prepared,
    )
    thread.join()
    assert result.exit_code == 0, result.output
    stdout_lines = result.stdout.splitlines()
    assert stdout_lines[0] == batch_id
    events = [json.loads(x) for x in stdout_lines[1:]]
    assert events[-1]["type"] == "llmbatch.batch.completed.v1"
    assert events[-1]["subject"] == batch_id

    records = asyncio.run(all_records(prepared, prepared.kafka.topics.requests))
    mine = [decode(r.key, r.value, list(r.headers)) for r in records if r.key == batch_id.encode()]
    assert len(mine) == 1
    assert mine[0].data.metadata == {"k": "v"}

    watched = runner.invoke(cli.app, ["watch", batch_id, "--since", "1h", "--json"], obj=prepared)
    assert watched.exit_code == 0, watched.output
    assert json.loads(watched.stdout.splitlines()[-1])["type"] == "llmbatch.batch.completed.v1"

    results = runner.invoke(cli.app, ["results", batch_id, "--tenant", tenant], obj=prepared)
    assert results.exit_code == 0, results.output
    assert [json.loads(x)["custom_id"] for x in results.stdout.splitlines()] == ["a", "b"]
    errors = runner.invoke(cli.app, ["results", batch_id, "--tenant", tenant, "--errors"], obj=prepared)
    assert [json.loads(x)["custom_id"] for x in errors.stdout.splitlines()] == ["c"]

    to_file = tmp_path / "out.jsonl"
    saved = runner.invoke(
        cli.app, ["results", batch_id, "--tenant", tenant, "-o", str(to_file)], obj=prepared
    )
    assert saved.exit_code == 0, saved.output
    assert [json.loads(x)["custom_id"] for x in to_file.read_text().splitlines()] == ["a", "b"]
    unwritable = runner.invoke(
        cli.app,
        ["results", batch_id, "--tenant", tenant, "-o", str(tmp_path / "no" / "out.jsonl")],
        obj=prepared,
    )
    assert unwritable.exit_code == 1
    assert "Traceback" not in unwritable.output
    assert "no/out.jsonl: No such file or directory" in unwritable.output

    cancelled = runner.invoke(cli.app, ["cancel", batch_id, "--reason", "test"], obj=prepared)
    assert cancelled.exit_code == 0, cancelled.output
    missing = runner.invoke(cli.app, ["results", "never-ran", "--tenant", tenant], obj=prepared)
    assert missing.exit_code == 1
    assert "no results for batch 'never-ran' yet" in missing.output


def test_cli_watch_exits_3_for_a_failed_batch(prepared: LLMBatchSettings) -> None:
    batch_id = f"cli-{uuid.uuid4().hex[:10]}"
    asyncio.run(publish_raw(prepared, completed_event(batch_id, status="failed")))
    result = runner.invoke(cli.app, ["watch", batch_id, "--since", "10m"], obj=prepared)
    assert result.exit_code == 3, result.output
    assert "failed" in result.output
    assert "attempts_exhausted" in result.output


def env_for(settings: LLMBatchSettings) -> dict[str, str]:
    kafka, s3 = settings.kafka, settings.s3
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("LLMBATCH_")},
        "LLMBATCH_KAFKA__BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
        "LLMBATCH_KAFKA__TOPICS__REQUESTS": kafka.topics.requests,
        "LLMBATCH_KAFKA__TOPICS__RESULTS": kafka.topics.results,
        "LLMBATCH_KAFKA__TOPICS__DEAD_LETTER": kafka.topics.dead_letter,
        "LLMBATCH_S3__ENDPOINT": s3.endpoint,
        "LLMBATCH_S3__ACCESS_KEY": s3.access_key.get_secret_value(),
        "LLMBATCH_S3__SECRET_KEY": s3.secret_key.get_secret_value(),
        "LLMBATCH_S3__INPUT_BUCKET": s3.input_bucket,
        "LLMBATCH_S3__RESULTS_BUCKET": s3.results_bucket,
    }


def test_cli_as_a_subprocess(prepared: LLMBatchSettings, tmp_path: Path, tenant: str) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [line("a")])
    batch_id = f"sub-{uuid.uuid4().hex[:10]}"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmbatch.producer.cli",
            "submit",
            str(path),
            "--model",
            MODEL,
            "--batch-id",
            batch_id,
            "--tenant",
            tenant,
            "--endpoint",
            "/v1/chat/completions",
        ],
        cwd=ROOT,
        env=env_for(prepared),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{batch_id}\n"
    assert f"submitted {batch_id}: 1 requests" in proc.stderr
    records = asyncio.run(all_records(prepared, prepared.kafka.topics.requests))
    assert [r.key for r in records].count(batch_id.encode()) == 1
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert [o.object_name for o in objects_under(prepared, prepared.s3.input_bucket, f"{tenant}/")] == [
        f"{tenant}/inputs/{digest}.jsonl"
    ]
