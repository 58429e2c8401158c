"""A dispatcher process through a 25 s Kafka outage (the broker kill -9ed, then restarted on its port
with its data): aiokafka's own lines are said once per kind and then every 30 s, not once per retry
(before the limiter, one replica printed hundreds of them), and the service stays up."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import orjson
import pytest

from llmbatch.chaos.processes import DispatcherProcess
from llmbatch.dispatcher.job_options import JobOptions
from llmbatch.dispatcher.settings import DispatcherOptions, DispatcherSettings
from llmbatch.ray_job.engines.backends import FAKE_BACKEND
from llmbatch.schemas.engines import EngineModel, EngineRegistry
from llmbatch.schemas.job import EngineConfig
from llmbatch.settings import KafkaSettings, RaySettings, RedisSettings, S3Settings, TopicSettings
from llmbatch.stack import kafka_broker
from llmbatch.stack.process import alive, stop_tree
from tests.support.services import reaped_or_alive

pytestmark = pytest.mark.integration

OUTAGE_S = 25
FAKE = EngineConfig(backend=FAKE_BACKEND)


def _lines(path: Path) -> list[dict[str, object]]:
    out = []
    for raw in path.read_bytes().splitlines():
        try:
            line = orjson.loads(raw)
        except orjson.JSONDecodeError:
            line = {"logger": "?", "msg": raw.decode(errors="replace")}
        if isinstance(line, dict):
            out.append(line)
    return out


async def test_a_broker_outage_logs_aiokafka_once_per_kind_not_per_retry(
    tmp_path: Path, redis_settings: RedisSettings, s3_settings: S3Settings, ray_settings: RaySettings
) -> None:
    kafka = await asyncio.to_thread(kafka_broker.start_kafka, tmp_path)
    run = f"outage-{uuid.uuid4().hex[:6]}"
    settings = DispatcherSettings(
        _env_file=None,
        kafka=KafkaSettings(
            bootstrap_servers=kafka.address,
            topics=TopicSettings(requests=f"{run}.req", results=f"{run}.res", dead_letter=f"{run}.req.dlt"),
        ),
        redis=redis_settings.model_copy(update={"key_prefix": run}),
        s3=s3_settings,
        ray=ray_settings,
        dispatcher=DispatcherOptions(
            group_id=f"{run}-g",
            session_timeout_ms=6000,
            heartbeat_interval_ms=1000,
            metrics_port=0,
            log_json=True,
            shared_engines=False,
        ),
        engines=EngineRegistry(models={"m": EngineModel(path="/unused", engine=FAKE)}),
        job=JobOptions(python=sys.executable),
    )
    log = tmp_path / "dispatcher.log"
    proc = DispatcherProcess(settings, log).start()
    restarted = None
    try:
        deadline = time.monotonic() + 120
        while not any(line.get("msg") == "partitions assigned" for line in _lines(log)):
            assert proc.alive() and time.monotonic() < deadline, log.read_text()[-3000:]
            await asyncio.sleep(0.5)
        before = len(_lines(log))
        os.kill(kafka.pid, signal.SIGKILL)
        await asyncio.sleep(OUTAGE_S)
        assert not reaped_or_alive(kafka.pid)
        restarted = await asyncio.to_thread(kafka_broker.start_kafka, tmp_path, restart=kafka)
        await asyncio.sleep(10)
        assert proc.alive(), log.read_text()[-3000:]
        during = _lines(log)[before:]
        library = [line for line in during if str(line.get("logger", "")).startswith(("aiokafka", "kafka"))]
        kinds = {(line["logger"], str(line["msg"]).split(" [")[0][:60]) for line in library}
        # each kind at most once at its start and once per 30 s after (the outage + restart is < 60 s)
        assert len(library) <= 3 * len(kinds), "\n".join(str(line["msg"])[:160] for line in library)
        assert len(library) <= 40, len(library)
    finally:
        try:
            proc.stop_checked()  # fails the test when it had ended on its own
        finally:
            for rec in (kafka, restarted):
                if rec is not None and alive(rec.pid):
                    stop_tree(rec.pid)
