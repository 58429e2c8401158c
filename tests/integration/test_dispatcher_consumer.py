"""The consumer against real Kafka and Redis: acceptance, dedupe, dead letters, commits, outages,
backpressure. (Ray is not involved: only the consumer half of the dispatcher runs.)"""

from __future__ import annotations

import asyncio
import hashlib
import struct
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from redis.typing import EncodableT, FieldT

from llmbatch.adapters.topics import ensure_topics
from llmbatch.dispatcher.domain.dlt import OriginalRecord
from llmbatch.dispatcher.domain.events import Outcome, terminal_fields
from llmbatch.dispatcher.domain.keys import Keys, batch_key
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.intake.commands import Accept
from llmbatch.dispatcher.kafka.record_reader import RecordReader
from llmbatch.dispatcher.kafka.request_body import RequestBodies
from llmbatch.dispatcher.settings import DispatcherSettings
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.schemas import dlt as dlt_headers
from llmbatch.schemas.batch import CancelRequest, InlineLimits
from llmbatch.schemas.common import BatchStatus
from llmbatch.schemas.events import BatchRejected, EventType
from llmbatch.settings import LLMBatchSettings, RedisSettings
from tests.support.consumer_harness import Harness, make_settings
from tests.support.dispatcher_kit import (
    batch_request,
    decode_results,
    inline_lines,
    origin,
    request_message,
    wait_for,
)

pytestmark = pytest.mark.integration


@pytest.fixture
async def harness(settings: LLMBatchSettings) -> AsyncIterator[Harness]:
    h = Harness(make_settings(settings))
    await h.start()
    try:
        yield h
    finally:
        await h.stop()


async def test_valid_duplicate_and_invalid_events(harness: Harness) -> None:
    good = [batch_request(f"good-{i}-{uuid.uuid4().hex[:6]}") for i in range(3)]
    first = request_message(good[0], event_id="same-id")
    key, value, headers = request_message(good[1])
    messages = [
        first,
        first,  # redelivered (same ce_id)
        request_message(good[0]),  # same batch_id, new event id
        (key, b"{not json", headers),  # invalid JSON
        (key, value, [(k, v) for k, v in headers if k != "ce_type"]),  # missing ce_type
        (b"mismatch", value, headers),  # key != subject
        request_message(good[1]),  # valid after the invalid ones
        request_message(good[2]),
    ]
    await harness.send(messages)
    await wait_for(lambda: harness.committed(), 60, what="commits")
    await wait_for(lambda: _committed_is(harness, len(messages)), 60, what="all offsets committed")

    for request in good:
        record = await harness.store.get(batch_key(None, request.batch_id))
        assert record is not None and record.state is State.QUEUED, request.batch_id
    assert await harness.store.count(State.QUEUED) == 3

    dead = await harness.reader("dead_letter").read_all()
    assert len(dead) == 3
    reasons = [dict(r.headers)[dlt_headers.REASON] for r in dead]
    assert reasons == [b"invalid_event"] * 3
    # dead letters of different keys land on different partitions: compare without order
    texts = sorted(dict(r.headers)[dlt_headers.EXCEPTION_MESSAGE].decode() for r in dead)
    assert [t.split(":", 1)[0] for t in texts] == ["invalid_json", "invalid_key", "missing_header"]
    assert "ce_type" in texts[2]
    offsets = sorted(struct.unpack(">q", dict(r.headers)[dlt_headers.ORIGINAL_OFFSET])[0] for r in dead)
    assert len(set(offsets)) == 3
    assert b"{not json" in [r.value for r in dead]

    events = decode_results(await harness.reader("results").read_all())
    accepted = [e for e in events if e.type is EventType.ACCEPTED]
    assert sorted({e.batch_id for e in accepted}) == sorted(r.batch_id for r in good)
    # a redelivered event may republish 'accepted', but always with the same id
    by_batch: dict[str, set[str]] = {}
    for e in accepted:
        by_batch.setdefault(e.batch_id, set()).add(e.id)
    assert all(len(ids) == 1 for ids in by_batch.values())
    assert harness.metrics.processed.labels(outcome="duplicate")._value.get() >= 1


async def test_unknown_model_is_dead_lettered_never_queued(harness: Harness) -> None:
    served = batch_request(f"served-{uuid.uuid4().hex[:6]}")
    other = "no-such-model"
    lines = inline_lines(2, model=other)
    unknown = batch_request(f"unknown-{uuid.uuid4().hex[:6]}", model=other, requests=lines)
    await harness.send([request_message(unknown), request_message(served)])
    await wait_for(lambda: _committed_is(harness, 2), 60, what="both offsets committed")

    queued = await harness.store.get(batch_key(None, served.batch_id))
    assert queued is not None and queued.state is State.QUEUED
    record = await harness.store.get(batch_key(None, unknown.batch_id))
    assert record is not None and record.state is State.DEAD_LETTERED
    assert record.get("error_code") == "model_not_found"
    # Redis keeps where the record was, not its value (that is in the dead letter)
    kept = OriginalRecord.from_json(record.get("origin") or "{}")
    assert kept.value is None and kept.key == unknown.batch_id.encode() and kept.offset >= 0
    [dead] = await harness.reader("dead_letter").read_all()
    headers = dict(dead.headers)
    assert headers[dlt_headers.REASON] == b"model_not_found"
    message = headers[dlt_headers.EXCEPTION_MESSAGE].decode()
    assert "'no-such-model'" in message and served.model in message and "LLMBATCH_ENGINES__MODELS" in message
    events = decode_results(await harness.reader("results").read_all())
    assert unknown.batch_id not in {e.batch_id for e in events if e.type is EventType.ACCEPTED}


async def test_every_rejected_request_that_names_a_batch_id_is_answered(harness: Harness) -> None:
    tag = uuid.uuid4().hex[:6]
    held = batch_request(f"held-{tag}")
    unknown = batch_request(
        f"unknown-{tag}", model="no-such-model", requests=inline_lines(1, model="no-such-model")
    )
    late = batch_request(f"late-{tag}", deadline=datetime.now(UTC) - timedelta(minutes=1))
    bad_key, _, bad_headers = request_message(batch_request(f"badjson-{tag}"), event_id=f"ev-json-{tag}")
    messages = [
        (bad_key, b"{not json", bad_headers),
        request_message(unknown, event_id=f"ev-unknown-{tag}"),
        request_message(late, event_id=f"ev-late-{tag}"),
        request_message(held, event_id=f"ev-held-{tag}"),
        request_message(held, event_id=f"ev-again-{tag}"),  # same batch id, a new request
        (None, b"{not json", bad_headers),  # no usable batch id: dead letter only
    ]
    await harness.send(messages)
    await wait_for(lambda: _committed_is(harness, len(messages)), 60, what="all offsets committed")

    dead = await harness.reader("dead_letter").read_to_end()
    assert len(dead) == 4
    events = decode_results(await harness.reader("results").read_to_end())
    answers = {e.batch_id: e for e in events if e.type is EventType.REJECTED}
    assert set(answers) == {f"badjson-{tag}", unknown.batch_id, late.batch_id, held.batch_id}
    assert not any(e.is_terminal for e in events)

    by_coordinates = {(r.partition, r.offset): r for r in dead}
    expected = {
        f"badjson-{tag}": ("invalid_json", f"ev-json-{tag}", None),
        unknown.batch_id: ("model_not_found", f"ev-unknown-{tag}", "model"),
        late.batch_id: ("deadline_passed", f"ev-late-{tag}", "deadline"),
    }
    for batch_id, (code, request_id, param) in expected.items():
        answer: BatchRejected = answers[batch_id].data
        assert (answer.error.code, answer.request_id, answer.error.param) == (code, request_id, param)
        assert answer.batch_status is BatchStatus.DEAD_LETTERED and answer.is_final
        # the answer points at this request's own dead letter
        assert answer.dead_letter is not None
        assert answer.dead_letter.topic == harness.settings.kafka.topics.dead_letter
        letter = by_coordinates[(answer.dead_letter.partition, answer.dead_letter.offset)]
        assert letter.key == batch_id.encode()
        assert dict(letter.headers)[dlt_headers.REASON] in {b"invalid_event", code.encode()}
        record = await harness.store.get(batch_key(None, batch_id))
        assert record is not None and record.state is State.DEAD_LETTERED

    duplicate: BatchRejected = answers[held.batch_id].data
    assert duplicate.error.code == "duplicate_batch_id" and duplicate.request_id == f"ev-again-{tag}"
    assert duplicate.batch_status is BatchStatus.QUEUED and not duplicate.is_final
    assert duplicate.dead_letter is None
    still_queued = await harness.store.get(batch_key(None, held.batch_id))
    assert still_queued is not None and still_queued.state is State.QUEUED


async def test_the_producer_sdk_wait_returns_the_rejection_of_its_own_request(harness: Harness) -> None:
    from llmbatch.producer.client import BatchClient, ClientOptions

    async with BatchClient(harness.settings, options=ClientOptions(source="urn:test:sdk")) as client:
        handle = await client.submit(inline_lines(1, model="no-such-model"), model="no-such-model")
        answer = await handle.wait(timeout=60)
        assert answer.type is EventType.REJECTED and answer.batch_id == handle.batch_id
        assert isinstance(answer.data, BatchRejected)
        assert answer.data.request_id == handle.event_id and answer.data.error.code == "model_not_found"
        # a second request for the same id is answered too, and does not end a wait on the first
        again = await client.submit(
            inline_lines(1, model="no-such-model"), model="no-such-model", batch_id=handle.batch_id
        )
        second = await again.wait(timeout=60)
        assert isinstance(second.data, BatchRejected)
        assert second.data.request_id == again.event_id != handle.event_id
        # without a request id, a wait on the batch id ends at a final rejection
        bare = await client.wait(handle.batch_id, timeout=60)
        assert bare.type is EventType.REJECTED


async def _committed_is(harness: Harness, n: int) -> bool:
    return await harness.committed() == n


async def test_cancel_of_a_queued_batch_finishes_it(harness: Harness) -> None:
    request = batch_request("c-" + uuid.uuid4().hex[:8])
    cancel = request_message(
        CancelRequest(batch_id=request.batch_id, reason="changed my mind"), event_id="c1"
    )
    await harness.send([request_message(request), cancel, cancel])
    await wait_for(lambda: _committed_is(harness, 3), 60, what="commits")
    record = await harness.store.get(batch_key(None, request.batch_id))
    assert record is not None and record.state is State.CANCELLED
    assert record.get("terminal_event_id") and record.flag("published") is False
    assert await harness.store.unpublished_ids() == [request.batch_id]


async def test_redis_outage_commits_nothing_and_loses_nothing(
    settings: LLMBatchSettings, tmp_path: Path
) -> None:
    from llmbatch.stack import services as stack_services
    from llmbatch.stack.process import stop_tree

    run_dir = tmp_path / "redis-outage"
    rec = stack_services.start_redis(run_dir, name="redis-outage")
    port = rec.ports["redis"]
    h = Harness(make_settings(settings, RedisSettings(url=rec.address)))
    await h.start()
    try:
        first = [batch_request("o1-" + uuid.uuid4().hex[:6])]
        await h.send([request_message(r) for r in first])
        await wait_for(lambda: _committed_is(h, 1), 60, what="first commit")
        stop_tree(rec.pid)  # Redis goes away
        during = [batch_request(f"o2-{i}-" + uuid.uuid4().hex[:6]) for i in range(4)]
        await h.send([request_message(r) for r in during])
        await wait_for(
            lambda: h.metrics.transient_errors.labels(component="redis")._value.get() >= 3,
            60,
            what="the consumer to hit the outage",
        )
        assert await h.committed() == 1  # nothing acknowledged meanwhile
        rec = stack_services.start_redis(run_dir, port=port, name="redis-outage", fresh_port_if_taken=True)
        if rec.ports["redis"] != port:
            # another process took the freed port meanwhile: Redis came back elsewhere, so the
            # consumer is restarted against the new address and resumes from the committed offsets
            await h.stop()
            redis_settings = h.settings.redis.model_copy(update={"url": rec.address})
            h = Harness(h.settings.model_copy(update={"redis": redis_settings}))
            await h.start()
        await wait_for(lambda: _committed_is(h, 5), 90, what="commits after Redis returned")
        for r in first + during:
            record = await h.store.get(batch_key(None, r.batch_id))
            assert record is not None and record.state is State.QUEUED, r.batch_id
    finally:
        await h.stop()
        stop_tree(rec.pid)


async def test_backpressure_pauses_then_resumes(settings: LLMBatchSettings) -> None:
    h = Harness(make_settings(settings, max_queued=4, resume_ratio=0.5, max_poll_records=1))
    await h.start()
    try:
        requests = [batch_request(f"bp-{i}-" + uuid.uuid4().hex[:6]) for i in range(10)]
        await h.send([request_message(r) for r in requests])
        await wait_for(lambda: h.consumer.backpressure.paused, 60, what="pause")
        await asyncio.sleep(2)  # paused: no more acceptance
        queued = await h.store.queued_count()
        assert 4 <= queued <= 5
        assert await h.committed() == queued
        assert h.metrics.paused._value.get() == 1

        async def drain_and_check() -> bool:
            # pretend the tracker launched what is queued: the consumer resumes
            for batch_id in await h.store.ready_ids(100):
                assert (await h.store.transition(batch_id, State.SUBMITTED)).ok
            return await _committed_is(h, 10)

        await wait_for(drain_and_check, 90, interval=1.0, what="resume and accept the rest")
        for r in requests:
            assert await h.store.get(batch_key(None, r.batch_id)) is not None
    finally:
        await h.stop()


async def test_a_cancel_behind_a_paused_backlog_takes_effect_in_seconds(settings: LLMBatchSettings) -> None:
    h = Harness(make_settings(settings, max_queued=3, resume_ratio=0.5, max_poll_records=1))
    await h.start()
    try:
        first = [batch_request(f"full-{i}-" + uuid.uuid4().hex[:6]) for i in range(3)]
        await h.send([request_message(r) for r in first])
        await wait_for(lambda: h.consumer.backpressure.paused, 60, what="the queue to fill")
        backlog = [batch_request(f"backlog-{i}-" + uuid.uuid4().hex[:6]) for i in range(6)]
        stop = CancelRequest(batch_id=first[0].batch_id, reason="stop it")
        cancel = request_message(stop, event_id="c-ahead")
        # a cancel of a batch that is still in the backlog is left for its turn (after its request)
        early = request_message(CancelRequest(batch_id=backlog[5].batch_id), event_id="c-early")
        await h.send([*(request_message(r) for r in backlog), early, cancel])

        async def cancelled() -> bool:
            record = await h.store.get(batch_key(None, first[0].batch_id))
            return record is not None and record.state is State.CANCELLED

        await wait_for(cancelled, 30, what="the cancel behind the backlog to apply")
        assert h.consumer.backpressure.paused and await h.committed() == 3  # the backlog still waits
        assert await h.store.get(batch_key(None, backlog[5].batch_id)) is None

        async def drained() -> bool:  # the tracker launches what is queued: the consumer resumes
            for batch_id in await h.store.ready_ids(100):
                await h.store.transition(batch_id, State.SUBMITTED)
            return await _committed_is(h, 3 + 8)

        await wait_for(drained, 90, interval=1.0, what="the backlog and both cancels")
        late = await h.store.get(batch_key(None, backlog[5].batch_id))
        # applied in its turn, not lost (the test's stand-in tracker may have launched it by then)
        assert late is not None and (late.state is State.CANCELLED or late.flag("cancel_requested"))
        # the consumer met the cancel applied ahead and skipped it by its marker
        assert h.metrics.processed.labels(outcome="duplicate_cancel")._value.get() >= 1
        assert h.metrics.processed.labels(outcome="cancel_ahead")._value.get() >= 1
    finally:
        await h.stop()


async def test_revoked_partitions_move_to_the_other_consumer(settings: LLMBatchSettings) -> None:
    s = make_settings(settings)
    a = Harness(s)
    await a.start()
    b: Harness | None = None
    try:
        await wait_for(
            lambda: len(a.consumer.assignment) == 2, 60, what="first consumer owns both partitions"
        )
        b = Harness(s)
        await b.start()
        await wait_for(
            lambda: len(a.consumer.assignment) == 1 and len(b.consumer.assignment) == 1,
            60,
            what="rebalance to one partition each",
        )
        requests = [batch_request(f"rb-{i}-" + uuid.uuid4().hex[:6]) for i in range(6)]
        # pinned, three to each partition: random keys put all six on one partition 1 time in 32
        await a.send([request_message(r) for r in requests], partitions=[i % 2 for i in range(6)])
        await wait_for(lambda: _committed_is(a, 6), 60, what="both consumers commit")
        assert a.consumer.accepted_total > 0 and b.consumer.accepted_total > 0
        assert a.consumer.accepted_total + b.consumer.accepted_total == 6
    finally:
        if b is not None:
            await b.stop()
        await a.stop()


async def test_a_rebalance_during_a_slow_redis_leaves_no_stale_partition_behind(
    settings: LLMBatchSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A segment stuck in a slow Redis outlives the rebalance wait: its partition moves to the other
    consumer meanwhile. When Redis answers, the segment must not mark the partition it lost as done
    (committing it would fail every later commit of this consumer): every record ends committed."""
    s = make_settings(settings)
    a = Harness(s)
    hold, release = asyncio.Event(), asyncio.Event()
    intake_many = a.store.intake_many

    async def slow(items: Any) -> Any:
        if hold.is_set():
            hold.clear()
            await release.wait()  # Redis answers only after the rebalance
        return await intake_many(items)

    monkeypatch.setattr(a.store, "intake_many", slow)
    # records on both partitions before the first consumer starts: its first segment holds both
    first = [batch_request(f"slow-{i}-" + uuid.uuid4().hex[:6]) for i in range(8)]
    await ensure_topics(s)
    await a.send([request_message(r) for r in first], partitions=[i % 2 for i in range(8)])
    hold.set()
    await a.start()
    b: Harness | None = None
    try:
        await wait_for(lambda: not hold.is_set(), 30, what="a segment stuck in the slow Redis")
        assert len(a.consumer.assignment) == 2
        b = Harness(s)
        await b.start()
        await wait_for(
            lambda: len(a.consumer.assignment) == 1 and len(b.consumer.assignment) == 1,
            60,
            what="the rebalance while the segment is stuck",
        )
        release.set()
        later = [batch_request(f"later-{i}-" + uuid.uuid4().hex[:6]) for i in range(6)]
        await a.send([request_message(r) for r in later])
        await wait_for(lambda: _committed_is(a, 14), 60, what="every record committed")
        assert a.metrics.commits.labels(result="failed")._value.get() == 0
    finally:
        if b is not None:
            await b.stop()
        await a.stop()


# --- one record never stops the consumer ---------------------------------------------------------------


# Redis out of memory pauses intake instead: tests/integration/test_intake_pause.py


async def test_an_unexpected_error_on_one_record_dead_letters_only_that_record(
    settings: LLMBatchSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug hit by one record (injected: Redis intake raises a plain exception for that batch only)
    fails its segment; the records are retried one by one and only the failing one is dead-lettered."""
    h = Harness(make_settings(settings, record_max_attempts=3))
    poison = batch_request("poison-" + uuid.uuid4().hex[:6])
    intake_many = h.store.intake_many
    calls: list[int] = []

    async def buggy(items: Any) -> Any:
        calls.append(len(items))
        if any(item.key == poison.batch_id for item in items):
            raise RuntimeError("a bug met by this record only")
        return await intake_many(items)

    monkeypatch.setattr(h.store, "intake_many", buggy)
    await h.start()
    try:
        good = [batch_request(f"fine-{i}-" + uuid.uuid4().hex[:6]) for i in range(2)]
        await h.send([request_message(good[0]), request_message(poison), request_message(good[1])])
        await wait_for(lambda: _committed_is(h, 3), 60, what="all three offsets committed")
        assert h.task is not None and not h.task.done()
        for request in good:
            record = await h.store.get(batch_key(None, request.batch_id))
            assert record is not None and record.state is State.QUEUED, request.batch_id
        [dead] = await h.reader("dead_letter").read_to_end()
        assert dead.key == poison.batch_id.encode()
        letter = dict(dead.headers)
        assert letter[dlt_headers.REASON] == b"processing_failed"
        assert letter[dlt_headers.EXCEPTION_FQCN] == b"builtins.RuntimeError"
        assert b"a bug met by this record only" in letter[dlt_headers.EXCEPTION_MESSAGE]
        assert calls.count(1) >= 3  # the poison record alone, record_max_attempts times
        assert h.metrics.failed_records._value.get() == 1
        events = decode_results(await h.reader("results").read_all())
        accepted = {e.batch_id for e in events if e.type is EventType.ACCEPTED}
        assert accepted == {r.batch_id for r in good}
    finally:
        await h.stop()


async def test_the_answer_to_a_record_given_up_on_waits_for_the_broker_and_is_retried(
    settings: LLMBatchSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker refuses the rejection answer of a record given up on (injected once: the send of the
    result fails with a request timeout): the answer is sent again and arrives once. Before, the
    acknowledgement was never awaited and the answer was lost without a word."""
    from aiokafka.errors import KafkaTimeoutError

    h = Harness(make_settings(settings, record_max_attempts=2))
    poison = batch_request("unanswered-" + uuid.uuid4().hex[:6])
    intake_many = h.store.intake_many

    async def buggy(items: Any) -> Any:
        if any(item.key == poison.batch_id for item in items):
            raise RuntimeError("a bug met by this record only")
        return await intake_many(items)

    monkeypatch.setattr(h.store, "intake_many", buggy)
    await h.start()
    kafka = h.producer._producer
    send = kafka.send
    refused: list[str] = []

    async def flaky_send(topic: str, *args: Any, **kwargs: Any) -> Any:
        if topic == h.settings.kafka.topics.results and not refused:
            refused.append(topic)
            failed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            failed.set_exception(KafkaTimeoutError("injected: the result was not acknowledged"))
            return failed
        return await send(topic, *args, **kwargs)

    monkeypatch.setattr(kafka, "send", flaky_send)
    try:
        await h.send([request_message(poison)])
        await wait_for(lambda: _committed_is(h, 1), 60, what="the offset to move past the record")
        assert refused, "the answer was never sent"
        answers = [
            e
            for e in decode_results(await h.reader("results").read_to_end())
            if e.batch_id == poison.batch_id
        ]
        assert [e.type for e in answers] == [EventType.REJECTED], answers
        assert h.metrics.failed_records._value.get() == 1
    finally:
        await h.stop()


async def _create_small_dead_letter_topic(s: DispatcherSettings, max_bytes: int) -> None:
    """The dead-letter topic as someone else created it: smaller than the setting says."""
    from aiokafka.admin import NewTopic

    admin = AIOKafkaAdminClient(**s.kafka.client_kwargs())
    await admin.start()
    try:
        await admin.create_topics(
            [
                NewTopic(
                    s.kafka.topics.dead_letter,
                    num_partitions=2,
                    replication_factor=1,
                    topic_configs={"max.message.bytes": str(max_bytes)},
                )
            ]
        )
    finally:
        await admin.close()


async def test_a_dead_letter_the_broker_refuses_as_too_large_is_written_reduced(
    settings: LLMBatchSettings,
) -> None:
    """An invalid record of 200 KB whose dead letter the broker refuses (the dead-letter topic takes 64 KiB):
    a reduced dead letter arrives, and the records behind it are processed."""
    s = make_settings(settings)
    await _create_small_dead_letter_topic(s, 65536)
    h = Harness(s)
    await h.start()
    try:
        good = batch_request("after-big-" + uuid.uuid4().hex[:6])
        key, _, headers = request_message(batch_request("big-junk-" + uuid.uuid4().hex[:6]))
        junk = b"{not json" + b"x" * 200_000
        await h.send([(key, junk, headers), request_message(good)])
        await wait_for(lambda: _committed_is(h, 2), 60, what="both offsets committed")
        assert h.task is not None and not h.task.done()
        record = await h.store.get(batch_key(None, good.batch_id))
        assert record is not None and record.state is State.QUEUED
        [dead] = await h.reader("dead_letter").read_to_end()
        letter = dict(dead.headers)
        assert dead.value is None and dead.key == key
        assert letter[dlt_headers.REASON] == b"invalid_event"
        assert letter[dlt_headers.REDUCED] == b"true"
        assert letter[dlt_headers.ORIGINAL_VALUE_BYTES] == str(len(junk)).encode()
        assert letter[dlt_headers.ORIGINAL_VALUE_SHA256] == hashlib.sha256(junk).hexdigest().encode()
        assert letter["ce_id"] == dict(headers)["ce_id"]
        assert struct.unpack(">q", letter[dlt_headers.ORIGINAL_OFFSET])[0] == 0
        assert h.metrics.dead_letters_reduced._value.get() == 1
    finally:
        await h.stop()


async def test_records_up_to_the_topic_size_are_consumed(settings: LLMBatchSettings) -> None:
    """The topics are created with the settings' max.message.bytes (2 MiB, not the brokers' 1 MiB), and
    the consumer fetches such records: an inline batch of 1.5 MB is accepted."""
    s = make_settings(settings, inline_limits=InlineLimits(max_requests=1000, max_bytes=1_900_000))
    h = Harness(s)
    await h.start()
    try:
        lines = inline_lines(300)
        for line in lines:
            line["body"]["messages"][0]["content"] = "y" * 5000
        big = batch_request("big-" + uuid.uuid4().hex[:6], requests=lines)
        key, value, headers = request_message(big)
        assert 1_400_000 < len(value) < s.kafka.topics.max_message_bytes
        await h.send([(key, value, headers)])
        await wait_for(lambda: _committed_is(h, 1), 60, what="the big record committed")
        record = await h.store.get(batch_key(None, big.batch_id))
        assert record is not None and record.state is State.QUEUED
        # Redis keeps what the state machine needs: a body this large stays on the topic only
        assert record.get("request") is None and record.get("request_bytes") == str(len(value))
        reader = RecordReader(s.kafka)
        try:
            assert await RequestBodies(reader).text(record) == value.decode()
        finally:
            await reader.close()
    finally:
        await h.stop()


async def test_a_request_body_kept_on_the_topic_only_is_read_back_at_launch_or_its_loss_answered(
    settings: LLMBatchSettings,
) -> None:
    """A body over request_in_redis_max_bytes is read back from the requests topic by the tracker when it
    builds the job spec. Once retention removed the record (delete_records here), the batch fails with
    request_gone and its dead letter is reduced, pointing at the original record; small bodies stay
    in Redis and need no topic."""
    from aiokafka import TopicPartition
    from aiokafka.admin import RecordsToDelete

    from llmbatch.dispatcher.domain.events import Outcome
    from llmbatch.dispatcher.errors import RequestUnavailable
    from llmbatch.dispatcher.kafka.publisher import late_dead_letter
    from llmbatch.dispatcher.runs.context import RunContext
    from llmbatch.dispatcher.runs.tracker import Tracker

    s = make_settings(settings, request_in_redis_max_bytes=4096)
    h = Harness(s)
    await h.start()
    unused: Any = None  # nothing here submits a job or reads results
    tracker = Tracker(RunContext(s, h.store, unused, unused, h.producer, h.metrics))
    try:
        small = batch_request("small-" + uuid.uuid4().hex[:6], requests=inline_lines(1))
        big = batch_request("big-" + uuid.uuid4().hex[:6], requests=inline_lines(200))
        messages = [request_message(small), request_message(big)]
        assert len(messages[0][1] or b"") < 4096 < len(messages[1][1] or b"")
        await h.send(messages)
        await wait_for(lambda: _committed_is(h, 2), 60, what="two intakes")
        kept, offloaded = (
            await h.store.get(batch_key(None, small.batch_id)),
            await h.store.get(batch_key(None, big.batch_id)),
        )
        assert kept is not None and kept.get("request") == (messages[0][1] or b"").decode()
        assert offloaded is not None and offloaded.get("request") is None
        spec = await tracker.launcher.job_spec(offloaded, 1)
        assert spec.requests is not None and [r.custom_id for r in spec.requests] == [
            r.custom_id for r in big.requests or []
        ]
        # retention removes both records from the topic
        where = OriginalRecord.from_json(offloaded.get("origin") or "{}")
        admin = AIOKafkaAdminClient(**s.kafka.client_kwargs())
        await admin.start()
        try:
            tps = [TopicPartition(s.kafka.topics.requests, p) for p in range(2)]
            everything = {tp: RecordsToDelete(before_offset=-1) for tp in tps}  # -1: up to the end
            await admin.delete_records(everything, timeout_ms=10_000)
        finally:
            await admin.close()
        assert (await tracker.launcher.job_spec(kept, 1)).requests is not None  # in Redis: no topic needed
        with pytest.raises(RequestUnavailable, match=r"no longer on the topic.*retention"):
            await tracker.launcher.job_spec(offloaded, 1)
        outcome = Outcome(State.FAILED, time.time(), dlt_reason="request_gone")
        letter = late_dead_letter(offloaded, outcome, dlt_topic="dlt", group_id="g")
        assert letter.value is None and letter.record.reduced
        assert letter.record.original_value_bytes == len(messages[1][1] or b"")
        assert (letter.record.original_topic, letter.record.original_offset) == (where.topic, where.offset)
    finally:
        await tracker.launcher.bodies.reader.close()
        await h.stop()


async def test_the_reconcile_pass_takes_in_again_the_batches_whose_state_redis_lost(harness: Harness) -> None:
    """Accepted batches whose Redis state is gone (a lost disk, a lagging failover, a flush) are found
    from the results topic and taken in again from their request records, as they were; an ended
    batch and one Redis still knows are left alone."""
    from llmbatch.dispatcher.intake.reconcile import Reconciler
    from llmbatch.dispatcher.kafka.publisher import TerminalPublisher

    tag = uuid.uuid4().hex[:6]
    kept, done = batch_request(f"kept-{tag}"), batch_request(f"done-{tag}")
    lost = [batch_request(f"lost-{i}-{tag}") for i in range(3)]
    await harness.send([request_message(r) for r in [kept, *lost, done]])
    await wait_for(lambda: _committed_is(harness, 5), 60, what="five intakes")
    await harness.send([request_message(CancelRequest(batch_id=done.batch_id))])
    await wait_for(lambda: _committed_is(harness, 6), 60, what="the cancel")
    topics = harness.settings.kafka.topics
    publisher = TerminalPublisher(
        harness.store,
        harness.producer,
        results_topic=topics.results,
        dlt_topic=topics.dead_letter,
        group_id="g",
        source="urn:test",
        metrics=harness.metrics,
    )
    assert await publisher.publish_pending() == 1  # 'done' ended: its terminal event is out
    before = {r.batch_id: await harness.store.get(batch_key(None, r.batch_id)) for r in lost}
    store, keys = harness.store, harness.store.keys
    for r in [*lost, done]:  # Redis loses their state
        key = batch_key(None, r.batch_id)
        await store.client.delete(keys.batch(key))
        await store.client.zrem(keys.ready, key)
        await store.client.zrem(keys.state_index(State.QUEUED), key)

    reconciler = Reconciler(harness.settings, store, harness.consumer.rules, harness.metrics)
    assert await reconciler.run_once() == 3
    for r in lost:
        old, new = before[r.batch_id], await store.get(batch_key(None, r.batch_id))
        assert old is not None and new is not None and new.state is State.QUEUED
        assert new.get("lifecycle") == old.get("lifecycle")  # the same results prefix and job ids
        assert new.number("accepted_at") == pytest.approx(old.number("accepted_at"), abs=0.002)
        assert new.deadline == pytest.approx(old.deadline, abs=0.002)
        assert new.get("request") == old.get("request")
    assert set(await store.ready_ids(10)) == {kept.batch_id, *(r.batch_id for r in lost)}
    assert await store.get(batch_key(None, done.batch_id)) is None  # it ended: nothing to restore
    assert harness.metrics.reconciled.labels(outcome="restored")._value.get() == 3
    assert await reconciler.run_once() == 0  # nothing lost any more


@pytest.mark.parametrize("answer", [State.CANCELLED, State.COMPLETED])
async def test_a_published_answer_stays_final_after_redis_is_restored_from_an_older_snapshot(
    harness: Harness, answer: State
) -> None:
    """A batch was cancelled and its terminal event published; then Redis is rolled back to a snapshot
    taken while it was queued (a failover to a lagging replica, a restore). Before, it ran again and
    could end with a second, different terminal event. The reconcile pass sets it back to the answer it
    published: the same terminal state and event id, marked published, nothing more on the topic."""
    from llmbatch.dispatcher.intake.reconcile import Reconciler
    from llmbatch.dispatcher.kafka.publisher import TerminalPublisher

    request = batch_request(f"final-{uuid.uuid4().hex[:6]}")
    await harness.send([request_message(request)])
    await wait_for(lambda: _committed_is(harness, 1), 60, what="the intake")
    store, keys = harness.store, harness.store.keys
    key = batch_key(None, request.batch_id)
    snapshot = await store.client.hgetall(keys.batch(key))  # while it was queued
    if answer is State.CANCELLED:
        await harness.send([request_message(CancelRequest(batch_id=request.batch_id))])
        await wait_for(lambda: _committed_is(harness, 2), 60, what="the cancel")
    else:  # it ran and completed, as the tracker would record it
        for step in (State.SUBMITTED, State.FINALIZING):
            await store.transition_or_raise(key, step, fields={"attempt": "1"})
        record = await store.get(key)
        assert record is not None
        done = Outcome(State.COMPLETED, time.time(), counts={"total": 2, "completed": 2})
        await store.transition_or_raise(key, State.COMPLETED, fields=terminal_fields(record, done))
    topics = harness.settings.kafka.topics
    publisher = TerminalPublisher(
        store,
        harness.producer,
        results_topic=topics.results,
        dlt_topic=topics.dead_letter,
        group_id="g",
        source="urn:test",
        metrics=harness.metrics,
    )
    assert await publisher.publish_pending() == 1
    ended = await store.get(key)
    assert ended is not None and ended.state is answer and ended.flag("published")
    # Redis comes back from the older snapshot: the batch is queued again, its answer forgotten
    await store.client.delete(keys.batch(key))
    # hgetall's own reply: hset's Mapping[FieldT, EncodableT] is invariant in its key, no narrower dict fits
    await store.client.hset(keys.batch(key), mapping=cast("dict[FieldT, EncodableT]", snapshot))
    await store.client.zadd(keys.ready, {key: 1.0})
    await store.client.zadd(keys.state_index(State.QUEUED), {key: 1.0})
    await store.client.zrem(keys.state_index(answer), key)

    reconciler = Reconciler(harness.settings, store, harness.consumer.rules, harness.metrics)
    await reconciler.run_once()
    settled = await store.get(key)
    assert settled is not None and settled.state is answer and settled.flag("published")
    assert settled.get("terminal_event_id") == ended.get("terminal_event_id")
    assert await store.ready_ids(10) == []  # it will not run again
    assert harness.metrics.reconciled.labels(outcome="answer_kept")._value.get() == 1
    assert await publisher.publish_pending() == 0
    terminal = [
        e
        for e in decode_results(await harness.reader("results").read_all())
        if e.batch_id == request.batch_id and e.is_terminal
    ]
    assert [e.id for e in terminal] == [ended.get("terminal_event_id")]


async def test_a_lost_batch_whose_request_left_the_topic_still_ends_in_one_terminal_event(
    harness: Harness,
) -> None:
    """Redis lost the batch and retention removed its request: the reconcile pass takes it in from its
    accepted event alone, the tracker fails it with request_gone at launch, and the publisher sends its
    one terminal event and a reduced dead letter naming the original record."""
    from aiokafka import TopicPartition
    from aiokafka.admin import RecordsToDelete

    from llmbatch.dispatcher.intake.reconcile import Reconciler
    from llmbatch.dispatcher.kafka.publisher import TerminalPublisher
    from llmbatch.dispatcher.runs.context import RunContext
    from llmbatch.dispatcher.runs.tracker import Tracker

    lost = batch_request(f"gone-{uuid.uuid4().hex[:6]}", metadata={"k": "v"})
    await harness.send([request_message(lost)])
    await wait_for(lambda: _committed_is(harness, 1), 60, what="the intake")
    store, keys, s = harness.store, harness.store.keys, harness.settings
    lost_key = batch_key(None, lost.batch_id)
    await store.client.delete(keys.batch(lost_key))  # Redis loses the batch
    await store.client.zrem(keys.ready, lost_key)
    await store.client.zrem(keys.state_index(State.QUEUED), lost_key)
    admin = AIOKafkaAdminClient(**s.kafka.client_kwargs())
    await admin.start()
    try:  # and retention removes its request
        tps = [TopicPartition(s.kafka.topics.requests, p) for p in range(2)]
        await admin.delete_records({tp: RecordsToDelete(before_offset=-1) for tp in tps}, timeout_ms=10_000)
    finally:
        await admin.close()

    reconciler = Reconciler(s, store, harness.consumer.rules, harness.metrics)
    assert await reconciler.run_once() == 0  # nothing could be restored to run
    taken = await store.get(lost_key)
    assert taken is not None and taken.state is State.QUEUED and taken.flag("request_gone")
    assert harness.metrics.reconciled.labels(outcome="request_gone")._value.get() == 1
    unused: Any = None  # nothing here submits a job or reads results
    tracker = Tracker(RunContext(s, store, unused, unused, harness.producer, harness.metrics))
    try:
        assert await tracker.launcher.start_attempt(taken) is False
        failed = await store.get(lost_key)
        assert failed is not None and failed.state is State.FAILED
        topics = s.kafka.topics
        publisher = TerminalPublisher(
            store,
            harness.producer,
            results_topic=topics.results,
            dlt_topic=topics.dead_letter,
            group_id="g",
            source="urn:test",
            metrics=harness.metrics,
            bodies=tracker.launcher.bodies,
        )
        assert await publisher.publish_pending() == 1
    finally:
        await tracker.launcher.bodies.reader.close()
    results = decode_results(await harness.reader("results").read_all())
    [terminal] = [e for e in results if e.batch_id == lost.batch_id and e.is_terminal]
    assert terminal.type is EventType.FAILED and terminal.data.error.code == "request_gone"
    assert terminal.data.metadata == {"k": "v"}
    [letter] = [r for r in await harness.reader("dead_letter").read_all() if r.key == lost.batch_id.encode()]
    headers = dict(letter.headers)
    assert letter.value is None and headers[dlt_headers.REDUCED] == b"true"
    assert headers[dlt_headers.REASON] == b"request_gone"
    assert await reconciler.run_once() == 0  # it ended: nothing more to do
    ended = await store.get(lost_key)
    assert ended is not None and ended.state is State.FAILED


async def test_kill9_of_redis_right_after_a_burst_loses_no_accepted_batch(
    settings: LLMBatchSettings, tmp_path: Path
) -> None:
    """Every request whose offset is committed (so its 'accepted' is out) is on disk: Redis runs with
    appendfsync always, so a SIGKILL right after the burst and a restart on the same data keep every
    batch (with everysec the newest writes may still sit in Redis' AOF buffer and die with it)."""
    import os
    import signal

    import redis

    from llmbatch.stack import services as stack_services
    from llmbatch.stack.process import alive, stop_tree

    run_dir = tmp_path / "redis-kill9"
    rec = stack_services.start_redis(run_dir, name="redis-kill9")
    port = rec.ports["redis"]
    h = Harness(make_settings(settings, RedisSettings(url=rec.address)))
    await h.start()
    try:
        assert redis.Redis.from_url(rec.address).config_get("appendfsync")["appendfsync"] == "always"
        burst = [batch_request(f"k9-{i}-" + uuid.uuid4().hex[:6]) for i in range(60)]
        await h.send([request_message(r) for r in burst])
        await wait_for(lambda: _committed_is(h, len(burst)), 90, interval=0.05, what="the burst committed")
        os.kill(rec.pid, signal.SIGKILL)  # at once: no time for a background flush
        await h.stop()
        for _ in range(100):
            if not alive(rec.pid):
                break
            await asyncio.sleep(0.05)
        rec = stack_services.start_redis(run_dir, port=port, name="redis-kill9", fresh_port_if_taken=True)
        store = StateStore.from_url(rec.address, keys=Keys(h.settings.redis.key_prefix))
        try:
            events = decode_results(await h.reader("results").read_all())
            accepted = {e.batch_id for e in events if e.type is EventType.ACCEPTED}
            assert accepted == {r.batch_id for r in burst}
            states = await store.states_many([batch_key(None, batch_id) for batch_id in sorted(accepted)])
            assert states == [State.QUEUED] * len(accepted), states
        finally:
            await store.close()
    finally:
        stop_tree(rec.pid)


async def test_a_redelivery_sends_the_lost_accepted_event_with_its_original_time(harness: Harness) -> None:
    """The dispatcher died after the intake and before 'accepted' went out, and the tracker launched the
    batch meanwhile: the redelivered record sends 'accepted' again, with the acceptance time Redis
    kept (not the time of the redelivery) and its stable id."""
    from llmbatch.dispatcher.intake.commands import classify, intake_rules

    request = batch_request(f"lost-acc-{uuid.uuid4().hex[:6]}")
    message = request_message(request, event_id=f"ev-{request.batch_id}")
    topics = harness.settings.kafka.topics
    # what the first consumer did before it died: the intake, 100 s ago (the record's coordinates
    # do not matter for a redelivery: the batch is found by its id and event id)
    earlier = time.time() - 100
    command = classify(origin(*message, topic=topics.requests), intake_rules(harness.settings), earlier)
    assert isinstance(command, Accept)
    await harness.store.intake_many([command.item])
    await harness.store.transition(
        batch_key(None, request.batch_id), State.SUBMITTED, fields={"attempt": "1"}
    )

    await harness.send([message])  # the redelivery
    await wait_for(lambda: _committed_is(harness, 1), 60, what="the redelivery")
    events = decode_results(await harness.reader("results").read_to_end())
    [accepted] = {e.id: e for e in events if e.type is EventType.ACCEPTED}.values()
    assert accepted.data.accepted_at.timestamp() == pytest.approx(earlier, abs=0.002)
    assert accepted.time.timestamp() == pytest.approx(earlier, abs=0.002)
    record = await harness.store.get(batch_key(None, request.batch_id))
    assert record is not None and record.state is State.SUBMITTED


async def test_records_that_once_ended_the_consumer_are_dead_lettered_and_it_goes_on(
    harness: Harness,
) -> None:
    # a key with a trailing newline passed `re.match(...$)`, and the answer built from it raised after
    # its dead letter was written: the consumer task died on it, and again after every restart; a
    # record with neither key nor value could not be dead-lettered at all
    good = batch_request(f"behind-{uuid.uuid4().hex[:6]}")
    poisoned = batch_request(f"poison-{uuid.uuid4().hex[:6]}")
    key, _, headers = request_message(poisoned)
    messages = [(key + b"\n", b"{not json", headers), (None, None, []), request_message(good)]
    await harness.send(messages, partitions=[0, 0, 0])
    await wait_for(
        lambda: harness.store.get(batch_key(None, good.batch_id)), 60, what="the request behind them"
    )
    await wait_for(lambda: _committed_is(harness, 3), 60, what="all offsets committed")
    harness.assert_alive()
    dead = await harness.reader("dead_letter").read_to_end()
    offsets = sorted(struct.unpack(">q", dict(r.headers)[dlt_headers.ORIGINAL_OFFSET])[0] for r in dead)
    assert offsets == [0, 1]
    assert {(r.key, r.value) for r in dead} == {(key + b"\n", b"{not json"), (None, b"")}
    # no answer names the unusable batch id: there is none to name
    assert [
        e
        for e in decode_results(await harness.reader("results").read_to_end())
        if e.type is EventType.REJECTED
    ] == []
