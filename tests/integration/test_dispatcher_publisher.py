"""The terminal-event publisher against real Kafka and Redis: a batch's late dead letter that does not
fit the dead-letter topic is written reduced, and the batch still gets its terminal event. (Ray is not
involved: the batch is put into its terminal state directly, as the tracker would.)"""

from __future__ import annotations

import hashlib
import struct
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from llmbatch.adapters.topics import ensure_topics
from llmbatch.dispatcher.domain.dlt import OriginalRecord
from llmbatch.dispatcher.domain.events import Outcome, terminal_fields
from llmbatch.dispatcher.domain.keys import BatchKey, Keys, batch_key
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.intake.commands import Accept, IntakeRules, classify
from llmbatch.dispatcher.kafka.publisher import EventProducer, TerminalPublisher
from llmbatch.dispatcher.metrics import Metrics
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.schemas import dlt as dlt_headers
from llmbatch.schemas.batch import InlineLimits
from llmbatch.schemas.dlt import DltReason
from llmbatch.schemas.events import EventType
from llmbatch.settings import KafkaSettings, LLMBatchSettings, TopicSettings
from tests.support.dispatcher_kit import (
    MODEL,
    TopicReader,
    batch_request,
    decode_results,
    inline_lines,
    request_message,
    wait_for,
)

pytestmark = pytest.mark.integration


@dataclass
class World:
    kafka: KafkaSettings
    store: StateStore
    producer: EventProducer
    publisher: TerminalPublisher
    metrics: Metrics

    def reader(self, topic: str) -> TopicReader:
        return TopicReader(self.kafka.client_kwargs(), topic)


async def make_world(settings: LLMBatchSettings, topics: TopicSettings) -> World:
    kafka = settings.kafka.model_copy(update={"topics": topics})
    metrics = Metrics()
    store = StateStore.from_url(settings.redis.url, keys=Keys(f"p{uuid.uuid4().hex[:8]}"))
    producer = EventProducer(kafka, metrics)
    await ensure_topics(kafka)
    await producer.start()
    publisher = TerminalPublisher(
        store,
        producer,
        results_topic=topics.results,
        dlt_topic=topics.dead_letter,
        group_id="g-publisher",
        source="urn:test:dispatcher",
        metrics=metrics,
    )
    return World(kafka, store, producer, publisher, metrics)


def topic_settings(**sizes: int) -> TopicSettings:
    tag = uuid.uuid4().hex[:8]
    return TopicSettings(requests=f"req-{tag}", results=f"res-{tag}", dead_letter=f"req-{tag}.dlt", **sizes)


@pytest.fixture
async def worlds() -> AsyncIterator[list[World]]:
    made: list[World] = []
    try:
        yield made
    finally:
        for w in made:
            await w.producer.stop()
            await w.store.close()


async def failed_inline_batch(w: World, lines: int) -> tuple[str, bytes]:
    """An inline batch of ``lines`` x ~3 KB accepted as the consumer would, then failed for good with a
    dead letter due (attempts exhausted), as the tracker would record it. Returns (batch id, value)."""
    requests = inline_lines(lines)
    for line in requests:
        line["body"]["messages"][0]["content"] = "z" * 3000
    request = batch_request("late-" + uuid.uuid4().hex[:6], requests=requests)
    key, value, headers = request_message(request)
    topics = w.kafka.topics
    rules = IntakeRules(
        requests_topic=topics.requests,
        dlt_topic=topics.dead_letter,
        group_id="g-publisher",
        served_models=frozenset({MODEL}),
        inline_limits=InlineLimits(max_requests=1000, max_bytes=2_000_000),
    )
    origin = OriginalRecord(topics.requests, 1, 17, key, value, tuple(headers), int(time.time() * 1000), 0)
    accept = classify(origin, rules, time.time())
    assert isinstance(accept, Accept)
    assert (await w.store.intake(accept.item)).is_new
    record = await w.store.get(batch_key(None, request.batch_id))
    assert record is not None
    outcome = Outcome(
        State.FAILED,
        time.time(),
        error_code="attempts_exhausted",
        error_message="every attempt failed",
        dlt_reason=DltReason.ATTEMPTS_EXHAUSTED,
    )
    fields = terminal_fields(record, outcome)
    result = await w.store.transition(
        batch_key(None, request.batch_id), State.FAILED, expected_version=record.version, fields=fields
    )
    assert result.ok
    return request.batch_id, value


async def test_a_late_dead_letter_the_broker_refuses_is_reduced_and_the_terminal_event_goes_out(
    settings: LLMBatchSettings, worlds: list[World]
) -> None:
    """The dead-letter topic takes 64 KiB (created so before the dispatcher's ensure_topics, which leaves
    existing topics alone) and the batch's request is 150 KB: the broker refuses the full dead letter, a
    reduced one is written, then the terminal event, and Redis drops the request body."""
    topics = topic_settings()
    admin = AIOKafkaAdminClient(**settings.kafka.client_kwargs())
    await admin.start()
    try:
        await admin.create_topics(
            [
                NewTopic(
                    topics.dead_letter,
                    num_partitions=1,
                    replication_factor=1,
                    topic_configs={"max.message.bytes": "65536"},
                )
            ]
        )
    finally:
        await admin.close()
    w = await make_world(settings, topics)
    worlds.append(w)
    batch_id, value = await failed_inline_batch(w, 50)
    assert len(value) > 140_000

    assert await w.publisher.publish_pending() == 1

    [dead] = await w.reader(topics.dead_letter).read_to_end()
    letter = dict(dead.headers)
    assert dead.key == batch_id.encode() and dead.value is None
    assert letter[dlt_headers.REASON] == b"attempts_exhausted"
    assert letter[dlt_headers.REDUCED] == b"true"
    assert letter[dlt_headers.ORIGINAL_VALUE_BYTES] == str(len(value)).encode()
    assert letter[dlt_headers.ORIGINAL_VALUE_SHA256] == hashlib.sha256(value).hexdigest().encode()
    assert letter[dlt_headers.ORIGINAL_TOPIC] == topics.requests.encode()
    assert struct.unpack(">q", letter[dlt_headers.ORIGINAL_OFFSET])[0] == 17
    assert w.metrics.dead_letters_reduced._value.get() == 1

    events = decode_results(await w.reader(topics.results).read_to_end())
    [terminal] = [e for e in events if e.batch_id == batch_id and e.is_terminal]
    assert terminal.type is EventType.FAILED and terminal.data.error.code == "attempts_exhausted"
    record = await w.store.get(batch_key(None, batch_id))
    assert record is not None and record.flag("dlt_written") and record.flag("published")
    assert "request" not in record.fields and "origin" not in record.fields
    assert await w.publisher.publish_pending() == 0  # nothing left: no second event, no second letter


async def test_a_late_dead_letter_over_the_setting_is_reduced_before_sending(
    settings: LLMBatchSettings, worlds: list[World]
) -> None:
    """Topics created from the settings with a 64 KiB dead-letter topic: the dead letter is reduced
    before it is sent (the broker never sees the full one)."""
    topics = topic_settings(dead_letter_max_message_bytes=65536)
    w = await make_world(settings, topics)
    worlds.append(w)
    batch_id, _ = await failed_inline_batch(w, 30)
    assert await w.publisher.publish_pending() == 1

    async def letters() -> list[object]:
        return await w.reader(topics.dead_letter).read_to_end()

    [dead] = await wait_for(letters, 30, what="the dead letter")
    assert dead.value is None and dict(dead.headers)[dlt_headers.REDUCED] == b"true"
    events = decode_results(await w.reader(topics.results).read_to_end())
    assert [e.type for e in events if e.batch_id == batch_id] == [EventType.FAILED]


async def test_stale_and_failing_entries_never_hold_back_the_terminal_events_behind_them(
    settings: LLMBatchSettings, worlds: list[World]
) -> None:
    """More stale entries (batch hash gone, or published already) than a publish pass reads, and more
    batches whose event cannot be built, at the head of the unpublished index: before, each pass read
    the same head, skipped it and published nothing behind it, for ever."""
    w = await make_world(settings, topic_settings())
    worlds.append(w)
    client, keys = w.store.client, w.store.keys
    await client.zadd(keys.unpublished, {f"default/ghost-{i}": i for i in range(250)})
    # terminal, with an outcome nothing can read; raw index members like the ghosts (batch_key would
    # not write the default tenant into them)
    broken = [BatchKey(f"default/broken-{i}") for i in range(250)]
    for i, key in enumerate(broken):
        await client.hset(keys.batch(key), mapping={"state": "failed", "version": "2", "outcome": "{"})
        await client.zadd(keys.unpublished, {key: 1000 + i})
    batch_id, _ = await failed_inline_batch(w, 1)
    await client.zadd(keys.unpublished, {batch_id: 5000})  # behind all of them
    for _ in range(6):
        await w.publisher.publish_pending(limit=200)
        if await client.zscore(keys.unpublished, batch_id) is None:
            break
    record = await w.store.get(batch_key(None, batch_id))
    assert record is not None and record.flag("published")
    assert await client.zcard(keys.unpublished) == len(broken)  # the ghosts went; the broken wait behind


async def test_an_event_whose_batch_moved_on_before_the_mark_is_said_not_counted(
    settings: LLMBatchSettings, worlds: list[World], caplog: pytest.LogCaptureFixture
) -> None:
    """Between the terminal event going out and its mark, the batch's hash names another terminal event
    (a newer lifecycle's): the mark is refused. Before, the publisher logged "terminal event published"
    as for any other; now it says the event was not marked and its usage not counted."""
    import redis

    w = await make_world(settings, topic_settings())
    worlds.append(w)
    batch_id, _ = await failed_inline_batch(w, 1)
    record = await w.store.get(batch_key(None, batch_id))
    assert record is not None
    hash_key = w.store.keys.batch(record.key)
    sync = redis.Redis.from_url(settings.redis.url)

    def moved_on(point: str) -> None:
        if point == "after_publish":
            sync.hset(hash_key, "terminal_event_id", "a-newer-lifecycles-event")

    w.publisher.crash = moved_on
    try:
        with caplog.at_level("INFO", logger="llmbatch"):
            await w.publisher.publish_pending()
    finally:
        sync.close()
    said = [r.getMessage() for r in caplog.records if r.name.startswith("llmbatch")]
    assert any("no longer has it as its terminal event" in m for m in said), said
    assert not any(m == "terminal event published" for m in said), said
    events = decode_results(await w.reader(w.kafka.topics.results).read_to_end())
    assert [e.type for e in events if e.batch_id == batch_id] == [EventType.FAILED]  # it did go out
    after = await w.store.get(batch_key(None, batch_id))
    assert after is not None and not after.flag("published")
