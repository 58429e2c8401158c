"""/livez of a dispatcher running in-process on the real Kafka and Redis: it fails while the tracker
loop hangs (before, it only asked whether a task had ended, so a hung loop stayed "live" forever) and
recovers when the loop moves again."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from llmbatch.dispatcher.service import Dispatcher
from llmbatch.dispatcher.settings import DispatcherOptions, DispatcherSettings
from llmbatch.settings import KafkaSettings, RedisSettings, S3Settings, TopicSettings
from tests.integration.test_dispatcher_tracker import Jobs
from tests.support.dispatcher_kit import registry, wait_for

pytestmark = pytest.mark.integration


async def _livez(port: int) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    raw = await reader.read()
    writer.close()
    return int(raw.split()[1])


async def test_livez_fails_while_the_tracker_hangs_and_recovers(
    kafka_settings: KafkaSettings, redis_settings: RedisSettings, s3_settings: S3Settings
) -> None:
    tag = uuid.uuid4().hex[:8]
    settings = DispatcherSettings(
        _env_file=None,
        kafka=kafka_settings.model_copy(
            update={
                "topics": TopicSettings(
                    requests=f"live-{tag}",
                    results=f"live-res-{tag}",
                    dead_letter=f"live-{tag}.dlt",
                    partitions=1,
                )
            }
        ),
        redis=redis_settings.model_copy(update={"key_prefix": f"live{tag}"}),
        s3=s3_settings,
        dispatcher=DispatcherOptions(
            group_id=f"g-{tag}",
            metrics_host="127.0.0.1",
            metrics_port=0,
            stall_timeout_s=2.0,
            poll_interval_s=0.2,
            lease_ttl_s=3,
            shared_engines=False,
        ),
        engines=registry(),
    )
    dispatcher = Dispatcher(settings, backend=Jobs())
    hung, release = asyncio.Event(), asyncio.Event()
    real_tick = dispatcher.tracker.tick

    async def tick() -> None:
        if not release.is_set():
            hung.set()
            await release.wait()  # a tick that never returns (until the test lets it)
        await real_tick()

    dispatcher.tracker.tick = tick  # type: ignore[method-assign]
    await dispatcher.start()
    try:
        assert dispatcher.health is not None
        port = dispatcher.health.bound_port
        await wait_for(hung.is_set, 60, what="the tracker to take the lease and hang")
        assert await _livez(port) == 200  # not stalled yet
        await wait_for(lambda: _is(port, 503), 30, what="/livez to fail while the tracker hangs")
        assert dispatcher.stalled_loops() == ["tracker"]  # the consumer loop kept moving
        release.set()
        await wait_for(lambda: _is(port, 200), 30, what="/livez to recover")
    finally:
        release.set()
        await dispatcher.stop()


async def _is(port: int, status: int) -> bool:
    return await _livez(port) == status
