"""Misconfiguration pauses intake, never drains it: on real Kafka and a Redis of the test's own that
refuses writes (``OOM``, at ``maxmemory``), a valid request is neither dead-lettered nor rejected.
Intake pauses (readiness names the cause, the gauge is 1) and takes the request in once Redis has
room again. Before, the request was tried three times, dead-lettered ``processing_failed``, answered
``rejected`` and its offset committed."""

from __future__ import annotations

import asyncio
import secrets
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from pydantic import SecretStr

from llmbatch.dispatcher.domain.keys import batch_key
from llmbatch.schemas.events import EventType
from llmbatch.settings import LLMBatchSettings, RedisSettings
from llmbatch.stack import services
from llmbatch.stack.process import alive, stop_tree
from tests.support.consumer_harness import Harness, make_settings
from tests.support.dispatcher_kit import batch_request, decode_results, request_message, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
async def own_redis(tmp_path: Path) -> AsyncIterator[RedisSettings]:
    password = secrets.token_urlsafe(16)
    rec = await asyncio.to_thread(services.start_redis, tmp_path, name="redis-oom", password=password)
    try:
        # the password in the URL: the consumer harness connects by URL alone
        url = f"redis://:{password}@127.0.0.1:{rec.ports['redis']}/0"
        yield RedisSettings(url=url, password=SecretStr(""))
    finally:
        if alive(rec.pid):
            stop_tree(rec.pid)


async def test_a_redis_out_of_memory_pauses_intake_and_nothing_is_dead_lettered(
    settings: LLMBatchSettings, own_redis: RedisSettings
) -> None:
    admin = aioredis.Redis.from_url(own_redis.url)
    harness = Harness(make_settings(settings, redis=own_redis))
    await harness.start()
    try:
        await admin.config_set("maxmemory-policy", "noeviction")
        await admin.config_set("maxmemory", "1")  # every write refused: OOM command not allowed
        request = batch_request(f"oom-{uuid.uuid4().hex[:6]}")
        await harness.send([request_message(request)], partitions=[0])

        async def paused() -> str | None:
            return harness.consumer.retry.paused

        assert await wait_for(paused, 60, what="intake to pause") == "redis_out_of_memory"
        gauge = harness.metrics.intake_paused.labels(cause="redis_out_of_memory")._value.get()
        assert gauge == 1
        harness.assert_alive()
        await admin.config_set("maxmemory", "0")  # the operator fixes it
        await wait_for(
            lambda: harness.store.get(batch_key(None, request.batch_id)), 60, what="the request taken in"
        )
        assert harness.consumer.retry.paused is None
        assert harness.metrics.intake_paused.labels(cause="redis_out_of_memory")._value.get() == 0
        events = decode_results(await harness.reader("results").read_all())
        assert [e.type for e in events if e.batch_id == request.batch_id] == [EventType.ACCEPTED]
        assert await harness.reader("dead_letter").read_all() == []
    finally:
        await admin.config_set("maxmemory", "0")
        await admin.aclose()
        await harness.stop()
