"""With shared engines, a dispatcher starts while Ray is down (before, its start waited for Ray and
took no request meanwhile) and deploys the engines once the head answers: a real Kafka, Redis and a
private Ray head started after the dispatcher, on the ports its settings name."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from llmbatch.dispatcher.backends.serve_api import ServeApi
from llmbatch.dispatcher.errors import DispatcherError
from llmbatch.dispatcher.service import Dispatcher
from llmbatch.dispatcher.settings import DispatcherOptions, DispatcherSettings
from llmbatch.ray_job.batch_runner.runner_http import APP_NAME as RUNNER_APP
from llmbatch.schemas.engines import app_name
from llmbatch.settings import KafkaSettings, RedisSettings, S3Settings, TopicSettings
from tests.integration.test_dispatcher_tracker import Jobs
from tests.support.dispatcher_kit import MODEL, registry, wait_for
from tests.support.private_ray import PrivateRay

pytestmark = pytest.mark.integration


async def _get(port: int, path: str) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    raw = await reader.read()
    writer.close()
    return int(raw.split()[1])


async def test_a_dispatcher_starts_while_ray_is_down_and_deploys_the_engines_once_it_answers(
    kafka_settings: KafkaSettings, redis_settings: RedisSettings, s3_settings: S3Settings, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:8]
    head = PrivateRay(tmp_path / "ray", s3=s3_settings)  # its ports are chosen; it is not running yet
    settings = DispatcherSettings(
        _env_file=None,
        kafka=kafka_settings.model_copy(
            update={
                "topics": TopicSettings(
                    requests=f"dep-{tag}",
                    results=f"dep-res-{tag}",
                    dead_letter=f"dep-{tag}.dlt",
                    partitions=1,
                )
            }
        ),
        redis=redis_settings.model_copy(update={"key_prefix": f"dep{tag}"}),
        s3=s3_settings,
        ray=head.settings(),
        dispatcher=DispatcherOptions(
            group_id=f"g-{tag}",
            metrics_host="127.0.0.1",
            metrics_port=0,
            poll_interval_s=0.2,
            lease_ttl_s=3,
            shared_engines=True,
        ),
        engines=registry(),
    )
    dispatcher = Dispatcher(settings, backend=Jobs())
    api = ServeApi(head.address, timeout_s=30)

    async def deployed() -> set[str] | None:
        try:
            apps = set((await api.status()).get("applications") or {})
        except DispatcherError:
            return None
        return apps or None

    try:
        await asyncio.wait_for(dispatcher.start(), 120)  # Ray is down: the start does not wait for it
        assert dispatcher.health is not None
        await wait_for(lambda: _ready(dispatcher.health.bound_port), 60, what="/readyz with Ray down")
        head.start()
        apps = await wait_for(deployed, 300, interval=2, what="the engines deployed once Ray answers")
        assert apps == {app_name(MODEL), RUNNER_APP}
    finally:
        await dispatcher.stop()
        head.stop()
        head.remove_temp()


async def _ready(port: int) -> bool:
    return await _get(port, "/readyz") == 200
