"""Operators repair the system with the CLI, end to end: real Kafka, Redis, MinIO, Ray and a dispatcher
process (fast deterministic engine in the Ray job).

1. A batch names an input file that is not there yet: its Ray job exits ``input_not_found``, the batch
   fails and is dead-lettered. The operator uploads the file and replays the dead letter: the
   dispatcher reopens the batch, it completes; a rerun replays nothing; replaying again is refused
   because the batch completed. Replays are signed (``LLMBATCH_REPLAY__KEY``): the same replay headers
   copied by a producer, unsigned, are dead-lettered and reopen nothing.
2. ``llmbatch jobs cancel --wait`` stops a running batch, which ends ``cancelled`` with partial results.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaProducer
from pydantic import SecretStr
from typer.testing import CliRunner

from llmbatch.adapters.storage import ensure_buckets, make_client, put_bytes
from llmbatch.adapters.topics import ensure_topics
from llmbatch.cli import app
from llmbatch.dispatcher.domain.keys import Keys, batch_key
from llmbatch.dispatcher.job_options import JobOptions
from llmbatch.dispatcher.settings import DispatcherOptions, DispatcherSettings
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.ray_job.engines.backends import FAKE_BACKEND
from llmbatch.schemas import dlt
from llmbatch.schemas.dlt import ReplayInfo
from llmbatch.schemas.events import EventType
from llmbatch.schemas.job import EngineConfig
from llmbatch.settings import (
    KafkaSettings,
    RaySettings,
    RedisSettings,
    ReplaySettings,
    S3Settings,
    TopicSettings,
)
from llmbatch.stack.ports import free_port
from tests.support.dispatcher_kit import (
    DispatcherProcess,
    TopicReader,
    batch_request,
    decode_results,
    inline_lines,
    registry,
    request_message,
    terminal_events,
    wait_for,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
runner = CliRunner()
ENGINE = EngineConfig(
    backend=FAKE_BACKEND,
    batch_size=1,
    batches_in_flight=1,
    num_cpus_per_replica=0.5,
    backend_options={"delay_s": 0.3},
)


class Ops:
    """One dispatcher on private topics/prefix, plus the operator's CLI and a view of the topics."""

    def __init__(self, settings: DispatcherSettings, log: Path) -> None:
        self.settings = settings
        self.store = StateStore.from_url(settings.redis.url, keys=Keys(settings.redis.key_prefix))
        self.proc = DispatcherProcess(settings, log)

    async def cli(self, *args: str, code: int = 0) -> Any:
        result = await asyncio.to_thread(runner.invoke, app, list(args), obj=self.settings)
        assert result.exit_code == code, f"{args}: {result.output}\n--- dispatcher\n{self.proc.tail(30)}"
        return orjson.loads(result.stdout) if "--json" in args else result

    async def send(self, message: tuple[bytes, bytes, list[tuple[str, bytes]]]) -> None:
        producer = AIOKafkaProducer(acks="all", **self.settings.kafka.client_kwargs())
        await producer.start()
        try:
            key, value, headers = message
            await producer.send_and_wait(
                self.settings.kafka.topics.requests, value=value, key=key, headers=headers
            )
        finally:
            await producer.stop()

    async def topic(self, name: str) -> list[Any]:
        return await TopicReader(self.settings.kafka.client_kwargs(), name).read_to_end()

    async def terminal(self, batch_id: str, kind: EventType, limit_s: float = 300) -> Any:
        async def check() -> Any:
            events = terminal_events(decode_results(await self.topic(self.settings.kafka.topics.results)))
            found = [e for e in events.get(batch_id, []) if e.type is kind]
            return found[0] if found else None

        try:
            return await wait_for(check, limit_s, interval=1, what=f"{kind.value} of {batch_id}")
        except AssertionError:
            print(self.proc.tail(60))
            raise


@pytest.fixture(scope="module")
async def ops(
    kafka_settings: KafkaSettings,
    redis_settings: RedisSettings,
    s3_settings: S3Settings,
    ray_settings: RaySettings,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Ops]:
    tag = uuid.uuid4().hex[:8]
    topics = TopicSettings(
        requests=f"oe-req-{tag}", results=f"oe-res-{tag}", dead_letter=f"oe-req-{tag}.dlt", partitions=2
    )
    settings = DispatcherSettings(
        kafka=kafka_settings.model_copy(update={"topics": topics}),
        redis=redis_settings.model_copy(update={"key_prefix": f"oe{tag}"}),
        s3=s3_settings,
        ray=ray_settings,
        dispatcher=DispatcherOptions(
            group_id=f"oe-{tag}",
            instance_id="ops-e2e",
            metrics_port=free_port(),
            session_timeout_ms=6000,
            heartbeat_interval_ms=1000,
            poll_interval_s=0.5,
            lease_ttl_s=4,
            retry_backoff_base_s=0.5,
            retry_backoff_max_s=2,
            progress_interval_s=1,
            shared_engines=False,
        ),
        job=JobOptions(python=sys.executable, progress_interval_s=0.5, ray_stop_wait_s=10, stop_wait_s=30),
        engines=registry(ENGINE),
        replay=ReplaySettings(key=SecretStr(f"e2e-replay-key-{uuid.uuid4().hex}")),
    )
    ensure_buckets(make_client(s3_settings), s3_settings)
    await ensure_topics(settings)
    world = Ops(settings, tmp_path_factory.mktemp("ops-e2e") / "dispatcher.log")
    world.proc.start()
    try:
        yield world
    finally:
        await world.store.close()
        world.proc.stop_checked(timeout=30)  # fails the test when it had ended on its own


async def test_replay_after_fixing_the_input_completes_the_batch(ops: Ops) -> None:
    s3 = ops.settings.s3
    batch_id = f"fixme-{uuid.uuid4().hex[:8]}"
    input_uri = f"s3://{s3.input_bucket}/default/ops-e2e/{batch_id}.jsonl"
    original = request_message(batch_request(batch_id, input_uri=input_uri), event_id=f"ev-{batch_id}")
    await ops.send(original)
    failed = await ops.terminal(batch_id, EventType.FAILED)
    assert failed.data.error.code == "input_not_found", failed.data.error
    dlt_topic = ops.settings.kafka.topics.dead_letter
    dead = await wait_for(lambda: ops.topic(dlt_topic), 60, what="the dead letter")
    assert dict(dead[0].headers)[dlt.REASON] == b"input_not_found"

    listed = await ops.cli("dlq", "list", "--json")
    assert [(d["key"], d["reason"]) for d in listed["dead_letters"]] == [(batch_id, "input_not_found")]
    dry = await ops.cli("dlq", "replay", "--json")
    assert dry["summary"]["to_replay"] == 1 and dry["items"][0]["batch_state"] == "failed"
    assert len(await ops.topic(ops.settings.kafka.topics.requests)) == 1  # the dry run sent nothing

    # a producer copying replay headers (unsigned) reopens nothing: its record is dead-lettered
    forged = ReplayInfo(replay_id="forged-1", replayed_at=datetime.now(UTC), replayed_by="a-producer")
    await ops.send((original[0], original[1], [*original[2], *forged.to_headers()]))

    async def refused() -> list[Any]:
        return [d for d in await ops.topic(dlt_topic) if dict(d.headers)[dlt.REASON] == b"invalid_event"]

    [letter] = await wait_for(refused, 60, what="the forged replay's dead letter")
    assert dlt.REPLAY_SIG.encode() in dict(letter.headers)[dlt.EXCEPTION_MESSAGE]
    assert (await ops.cli("jobs", "get", batch_id, "--json"))["state"] == "failed"

    lines = b"".join(orjson.dumps(line) + b"\n" for line in inline_lines(3))
    put_bytes(make_client(s3), s3, input_uri, lines, len(lines))  # the operator's fix
    done = await ops.cli(
        "dlq", "replay", "--execute", "--reason", "input_not_found", "--by", "e2e-operator", "--json"
    )
    assert done["summary"]["replayed"] == 1
    requests = await ops.topic(ops.settings.kafka.topics.requests)
    assert len(requests) == 3
    replayed = requests[2]
    assert (replayed.key, replayed.value) == (original[0], original[1])
    assert dict(replayed.headers)["ce_id"] == f"ev-{batch_id}".encode()
    info = ReplayInfo.from_headers(list(replayed.headers))
    assert info is not None and info.replayed_by == "e2e-operator" and info.signature is not None
    assert not {n for n, _ in replayed.headers} & dlt.DLT_HEADERS

    completed = await ops.terminal(batch_id, EventType.COMPLETED)
    counts = completed.data.request_counts
    assert (counts.total, counts.completed, counts.failed) == (3, 3, 0)
    assert completed.id != failed.id  # a new lifecycle
    job = await ops.cli("jobs", "get", batch_id, "--json")
    assert job["state"] == "completed" and job["replay_id"] == info.replay_id
    last = [a["submission_id"] for a in job["attempts"]][-1]
    assert last.startswith(f"{batch_id}-") and last.endswith("-a2")  # attempt numbers go on after a replay

    rerun = await ops.cli("dlq", "replay", "--execute", "--reason", "input_not_found", "--json")
    assert (rerun["summary"]["replayed"], rerun["summary"]["already_replayed"]) == (0, 1)
    again = await ops.cli(
        "dlq", "replay", "--execute", "--include-replayed", "--reason", "input_not_found", "--json", code=3
    )
    assert again["summary"]["refused"] == 1 and "already completed" in again["items"][0]["why"]
    assert len(await ops.topic(ops.settings.kafka.topics.requests)) == 3  # nothing replayed twice
    listed = await ops.cli("dlq", "list", "--json")
    assert listed["dead_letters"][0]["replayed"]["replay_id"] == info.replay_id


async def test_jobs_cancel_stops_a_running_batch(ops: Ops) -> None:
    batch_id = f"stopme-{uuid.uuid4().hex[:8]}"
    await ops.send(request_message(batch_request(batch_id, requests=inline_lines(60))))

    async def working() -> bool:
        if await ops.store.get(batch_key(None, batch_id)) is None:
            return False
        job = await ops.cli("jobs", "get", batch_id, "--json")
        return bool(job and job["state"] == "running" and job["counts"]["completed"] > 0)

    await wait_for(working, 300, interval=2, what="the batch to make progress")
    listed = await ops.cli("jobs", "list", "--state", "running", "--json")
    assert batch_id in [j["batch_id"] for j in listed["jobs"]]
    result = await ops.cli(
        "jobs", "cancel", batch_id, "--reason", "e2e", "--wait", "--timeout", "240", "--json"
    )
    assert result["terminal"]["status"] == "cancelled"
    job = await ops.cli("jobs", "get", batch_id, "--json")
    assert job["state"] == "cancelled" and job["cancel_requested"] is True
    assert 0 < job["counts"]["completed"] < 60 and job["output_uris"]  # partial results kept
    assert (await ops.cli("jobs", "cancel", batch_id, code=1)).stderr.startswith("error: batch")
