"""``llmbatch dlq list|inspect|replay`` against real Kafka and Redis (no dispatcher running).

Dead letters are produced exactly as the dispatcher writes them
(``llmbatch.dispatcher.domain.dlt.build_dead_letter``:
original record + Spring Kafka ``kafka_dlt-*`` headers + ``llmbatch-dlt-reason``); batch states come
from the dispatcher's state store. The end-to-end replay (dispatcher reopens and completes the
batch) is in tests/e2e/test_ops_replay_e2e.py.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, cast

import orjson
import pytest
from aiokafka import AIOKafkaProducer
from typer.testing import CliRunner

from llmbatch.adapters.topics import ensure_topics
from llmbatch.cli import app
from llmbatch.dispatcher.domain.batch_record import IntakeItem
from llmbatch.dispatcher.domain.dlt import OriginalRecord, build_dead_letter
from llmbatch.dispatcher.domain.events import Outcome, terminal_fields
from llmbatch.dispatcher.domain.keys import Keys, batch_key
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.intake.commands import intake_fields
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.schemas import dlt
from llmbatch.schemas.dlt import ReplayInfo
from llmbatch.settings import LLMBatchSettings, TopicSettings
from tests.support.dispatcher_kit import TopicReader, batch_request, request_message

pytestmark = pytest.mark.integration
runner = CliRunner()


class World:
    """Private topics and key prefix, three dead letters, and the state of their batches."""

    def __init__(self, base: LLMBatchSettings) -> None:
        self.tag = uuid.uuid4().hex[:8]
        topics = TopicSettings(
            requests=f"dq-req-{self.tag}",
            results=f"dq-res-{self.tag}",
            dead_letter=f"dq-req-{self.tag}.dlt",
            partitions=2,
        )
        self.settings = LLMBatchSettings(
            kafka=base.kafka.model_copy(update={"topics": topics}),
            redis=base.redis.model_copy(update={"key_prefix": f"dq{self.tag}"}),
            s3=base.s3,
        )
        self.store = StateStore.from_url(self.settings.redis.url, keys=Keys(self.settings.redis.key_prefix))
        self.failed = f"failed-{self.tag}"  # input_not_found, batch failed: replayable
        self.done = f"done-{self.tag}"  # input_not_found, batch completed since: refused
        self.junk = f"junk-{self.tag}"  # invalid_event, unknown to Redis: replayable
        self.messages: dict[str, tuple[bytes, bytes, list[tuple[str, bytes]]]] = {}

    async def send(
        self, topic: str, key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]]
    ) -> None:
        producer = AIOKafkaProducer(acks="all", **self.settings.kafka.client_kwargs())
        await producer.start()
        try:
            await producer.send_and_wait(topic, value=value, key=key, headers=headers)
        finally:
            await producer.stop()

    async def dead_letter(
        self, batch_id: str, reason: str, offset: int, *, value: bytes | None = None
    ) -> None:
        request = batch_request(
            batch_id, input_uri=f"s3://{self.settings.s3.input_bucket}/default/missing/{batch_id}.jsonl"
        )
        key, val, headers = request_message(request, event_id=f"ev-{batch_id}")
        val = value if value is not None else val
        self.messages[batch_id] = (key, val, headers)
        original = OriginalRecord(
            self.settings.kafka.topics.requests,
            1,
            offset,
            key,
            val,
            tuple(headers),
            int(time.time() * 1000),
            0,
        )
        letter = build_dead_letter(
            original,
            dlt_topic=self.settings.kafka.topics.dead_letter,
            reason=reason,
            group_id="llmbatch-dispatcher",
            fqcn="llmbatch.ray_job.errors.InputNotFound",
            message=f"{reason}: the input of {batch_id} is missing",
        )
        await self.send(letter.topic, letter.key, letter.value, letter.headers)

    async def batch(self, batch_id: str, final: State) -> None:
        request = batch_request(batch_id)
        key, value, headers = request_message(request, event_id=f"ev-{batch_id}")
        rec = OriginalRecord(self.settings.kafka.topics.requests, 0, 0, key, value, tuple(headers), 0, 0)
        now = time.time()
        fields = intake_fields(request, rec, "urn:t", f"ev-{batch_id}", None, now)
        marker = ("urn:t", f"ev-{batch_id}")
        stored = batch_key(None, batch_id)
        await self.store.intake(IntakeItem(stored, fields, marker, deadline=now + 3600))
        if final is State.COMPLETED:  # the lifecycle a real batch goes through
            for step in (State.SUBMITTED, State.RUNNING, State.FINALIZING):
                await self.store.transition_or_raise(stored, step, fields={"attempt": "1"})
        record = await self.store.get(stored)
        assert record is not None
        outcome = Outcome(final, now, counts={"total": 3, "completed": 3 if final is State.COMPLETED else 0})
        await self.store.transition_or_raise(stored, final, fields=terminal_fields(record, outcome))

    async def topic(self, name: str) -> list[Any]:
        return await TopicReader(self.settings.kafka.client_kwargs(), name).read_all(idle_ms=800)

    async def ledger(self) -> dict[str, str]:
        key = self.store.keys.replay_ledger(self.settings.kafka.topics.dead_letter)
        return dict(cast(dict[str, str], await self.store.client.hgetall(key)))  # a decoding client


@pytest.fixture
async def world(settings: LLMBatchSettings) -> AsyncIterator[World]:
    w = World(settings)
    await ensure_topics(w.settings)
    await w.batch(w.failed, State.FAILED)
    await w.batch(w.done, State.COMPLETED)
    await w.dead_letter(w.failed, "input_not_found", 10)
    await w.dead_letter(w.done, "input_not_found", 11)
    await w.dead_letter(w.junk, "invalid_event", 12, value=b'{"batch_id": 12')
    try:
        yield w
    finally:
        await w.store.close()


async def cli(world: World, *args: str) -> Any:
    """Run the CLI in a worker thread: its commands call asyncio.run themselves."""
    return await asyncio.to_thread(runner.invoke, app, list(args), obj=world.settings)


def as_json(result: Any, code: int = 0) -> Any:
    assert result.exit_code == code, result.output
    return orjson.loads(result.stdout)


async def test_list_and_inspect(world: World) -> None:
    listed = as_json(await cli(world, "dlq", "list", "--json"))
    assert listed["count"] == 3 and listed["topic_exists"] is True
    rows = {row["key"]: row for row in listed["dead_letters"]}
    assert {k: r["reason"] for k, r in rows.items()} == {
        world.failed: "input_not_found",
        world.done: "input_not_found",
        world.junk: "invalid_event",
    }
    row = rows[world.failed]
    assert (row["original_topic"], row["original_partition"], row["original_offset"]) == (
        world.settings.kafka.topics.requests,
        1,
        10,
    )
    assert row["consumer_group"] == "llmbatch-dispatcher" and "missing" in row["exception_message"]
    assert row["replayed"] is None
    only = as_json(await cli(world, "dlq", "list", "--reason", "invalid_event", "--json"))
    assert [r["key"] for r in only["dead_letters"]] == [world.junk]
    keyed = as_json(await cli(world, "dlq", "list", "-k", world.done, "--json"))
    assert [r["key"] for r in keyed["dead_letters"]] == [world.done]
    assert as_json(await cli(world, "dlq", "list", "--since", "2999-01-01T00:00:00Z", "--json"))["count"] == 0
    table = await cli(world, "dlq", "list")
    assert table.exit_code == 0 and "input_not_found" in table.stdout and "3 of 3" in table.stderr

    [full] = as_json(await cli(world, "dlq", "inspect", row["coordinate"], "--json"))
    assert full["key"] == world.failed and full["valid_now"] is True
    headers = {h["name"]: h for h in full["headers"]}
    assert headers[dlt.ORIGINAL_OFFSET] == {"name": dlt.ORIGINAL_OFFSET, "value": 10, "encoding": "int64-be"}
    assert headers["ce_id"]["value"] == f"ev-{world.failed}"
    assert full["payload"] == orjson.loads(world.messages[world.failed][1])
    [junk] = as_json(await cli(world, "dlq", "inspect", world.junk, "--json"))  # by key
    assert junk["valid_now"] is False and junk["payload"] == {"not_json": '{"batch_id": 12'}
    human = await cli(world, "dlq", "inspect", world.junk)
    assert human.exit_code == 0 and "kafka_dlt-original-offset" in human.stdout
    missing = await cli(world, "dlq", "inspect", "0:999")
    assert missing.exit_code == 1 and missing.stderr.startswith("error: no dead letter at '0:999'")


async def test_dry_run_changes_nothing(world: World) -> None:
    dry = as_json(await cli(world, "dlq", "replay", "--json"))
    assert dry["summary"]["dry_run"] is True
    assert (dry["summary"]["selected"], dry["summary"]["to_replay"], dry["summary"]["refused"]) == (3, 2, 1)
    decisions = {i["key"]: i["decision"] for i in dry["items"]}
    assert decisions == {world.failed: "replay", world.done: "refused", world.junk: "replay"}
    human = await cli(world, "dlq", "replay")
    assert human.exit_code == 0 and "dry run: 3 selected, 2 would be replayed" in human.stderr
    assert "--execute" in human.stderr
    assert await world.topic(world.settings.kafka.topics.requests) == []
    assert await world.ledger() == {}


async def test_execute_republishes_with_provenance_and_rerun_replays_nothing(world: World) -> None:
    run = await cli(
        world, "dlq", "replay", "--execute", "--reason", "input_not_found", "--by", "ops-test", "--json"
    )
    result = as_json(run, code=3)  # the completed batch was refused
    assert (result["summary"]["replayed"], result["summary"]["refused"]) == (1, 1)
    [replayed] = await world.topic(world.settings.kafka.topics.requests)
    key, value, original = world.messages[world.failed]
    assert (replayed.key, replayed.value) == (key, value)  # payload byte for byte
    headers = list(replayed.headers)
    names = [n for n, _ in headers]
    assert not set(names) & dlt.DLT_HEADERS
    assert dict(headers)["ce_id"] == dict(original)["ce_id"] == f"ev-{world.failed}".encode()
    info = ReplayInfo.from_headers(headers)
    assert info is not None and info.replayed_by == "ops-test" and info.replay_id.startswith("rp-")
    assert [o["replay_id"] for o in result["outcomes"]] == [info.replay_id]
    ledger = await world.ledger()
    assert list(ledger) == [result["outcomes"][0]["coordinate"]]
    assert orjson.loads(next(iter(ledger.values())))["replay_id"] == info.replay_id

    rerun = await cli(world, "dlq", "replay", "--execute", "--reason", "input_not_found", "--json")
    again = as_json(rerun, code=3)
    assert (again["summary"]["replayed"], again["summary"]["already_replayed"]) == (0, 1)
    assert len(await world.topic(world.settings.kafka.topics.requests)) == 1  # nothing twice
    listed = as_json(await cli(world, "dlq", "list", "-k", world.failed, "--json"))
    assert listed["dead_letters"][0]["replayed"]["replay_id"] == info.replay_id


async def test_completed_batch_is_refused_unless_forced(world: World) -> None:
    refused = await cli(world, "dlq", "replay", "--execute", "--key", world.done)
    assert refused.exit_code == 3, refused.output
    assert "already completed" in refused.stdout and "refused" in refused.stderr
    assert await world.topic(world.settings.kafka.topics.requests) == []
    forced = as_json(await cli(world, "dlq", "replay", "--execute", "--key", world.done, "--force", "--json"))
    assert forced["summary"]["replayed"] == 1 and forced["items"][0]["why"].startswith("forced")
    assert len(await world.topic(world.settings.kafka.topics.requests)) == 1


async def test_rate_limit_and_to_topic(world: World) -> None:
    target = f"dq-staging-{world.tag}"
    staging = TopicSettings(
        requests=target, results=f"{target}-res", dead_letter=f"{target}.dlt", partitions=1
    )
    await ensure_topics(world.settings.kafka.model_copy(update={"topics": staging}))
    started = time.monotonic()
    result = as_json(
        await cli(
            world, "dlq", "replay", "--execute", "--force", "--rate", "4/s", "--to-topic", target, "--json"
        )
    )
    elapsed = time.monotonic() - started
    assert result["summary"]["replayed"] == 3
    assert elapsed >= 0.5  # 3 records at 4/s: two waits of 0.25 s
    records = await world.topic(target)
    assert len(records) == 3
    stamps = sorted(r.timestamp for r in records)
    assert stamps[-1] - stamps[0] >= 450  # spread by the limiter, in ms
    assert await world.topic(world.settings.kafka.topics.requests) == []
    bad = await cli(world, "dlq", "replay", "--rate", "fast")
    assert bad.exit_code == 2 and "--rate" in bad.stderr
