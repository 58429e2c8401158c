"""``llmbatch jobs list|get|cancel`` against real Redis and Kafka.

Batches are written to Redis through the dispatcher's own state store (intake + transitions), so the
CLI reads exactly what a running dispatcher would have written. Each test uses its own key prefix
and topics.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from typer.testing import CliRunner, Result

from llmbatch.adapters.topics import ensure_topics
from llmbatch.cli import app
from llmbatch.dispatcher.domain.batch_record import IntakeItem
from llmbatch.dispatcher.domain.events import Outcome, terminal_fields
from llmbatch.dispatcher.domain.keys import Keys, batch_key
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.intake.commands import intake_fields
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.schemas.batch import CancelRequest
from llmbatch.schemas.cloudevents import decode
from llmbatch.schemas.events import EventType
from llmbatch.schemas.job import submission_id
from llmbatch.settings import LLMBatchSettings, TopicSettings
from tests.support.dispatcher_kit import (
    TopicReader,
    batch_request,
    origin,
    request_message,
    settings_env,
)

pytestmark = pytest.mark.integration
runner = CliRunner()


def tagged(base: LLMBatchSettings) -> LLMBatchSettings:
    tag = uuid.uuid4().hex[:8]
    topics = TopicSettings(
        requests=f"ops-req-{tag}", results=f"ops-res-{tag}", dead_letter=f"ops-req-{tag}.dlt", partitions=2
    )
    return LLMBatchSettings(
        kafka=base.kafka.model_copy(update={"topics": topics}),
        redis=base.redis.model_copy(update={"key_prefix": f"ops{tag}"}),
        s3=base.s3,
    )


class World:
    def __init__(self, settings: LLMBatchSettings) -> None:
        self.settings = settings
        self.store = StateStore.from_url(settings.redis.url, keys=Keys(settings.redis.key_prefix))

    async def queued(self, batch_id: str, **overrides: Any) -> None:
        request = batch_request(batch_id, **overrides)
        key, value, headers = request_message(request, event_id=f"ev-{batch_id}")
        rec = origin(key, value, headers, topic=self.settings.kafka.topics.requests)
        now = time.time()
        item = IntakeItem(
            batch_key(request.tenant, batch_id),
            intake_fields(request, rec, "urn:test", f"ev-{batch_id}", None, now),
            ("urn:test", f"ev-{batch_id}"),
            deadline=now + 3600,
        )
        assert (await self.store.intake(item)).is_new

    async def running(self, batch_id: str) -> None:
        await self.queued(batch_id)
        await self.store.transition_or_raise(
            batch_key(None, batch_id),
            State.SUBMITTED,
            fields={
                "attempt": "1",
                "submission_id": await self.sid(batch_id, 1),
                "submitted_at": repr(time.time()),
                "confirmed": "1",
            },
        )
        await self.store.transition_or_raise(
            batch_key(None, batch_id),
            State.RUNNING,
            fields={"running_at": repr(time.time()), "started_at": repr(time.time())},
        )
        await self.store.client.hset(
            self.store.keys.progress(batch_key(None, batch_id)),
            mapping={"completed": "2", "failed": "0", "total": "3"},
        )

    async def sid(self, batch_id: str, attempt: int) -> str:
        """The Ray submission id of an attempt of the batch's lifecycle."""
        record = await self.store.get(batch_key(None, batch_id))
        assert record is not None and record.get("lifecycle")
        return submission_id(batch_id, attempt, record.get("lifecycle"))

    async def completed(self, batch_id: str) -> None:
        await self.running(batch_id)
        await self.store.transition_or_raise(
            batch_key(None, batch_id), State.FINALIZING, fields={"job_ended_at": repr(time.time())}
        )
        record = await self.store.get(batch_key(None, batch_id))
        assert record is not None
        prefix = f"s3://{self.settings.s3.results_bucket}/default/{batch_id}/"
        outcome = Outcome(
            State.COMPLETED,
            time.time(),
            [prefix + "output-a1-00000.jsonl"],
            [],
            prefix + "manifest.json",
            {"total": 3, "completed": 3, "failed": 0},
            {"prompt_tokens": 30, "completion_tokens": 24},
            time.time() - 5,
        )
        await self.store.transition_or_raise(
            batch_key(None, batch_id), State.COMPLETED, fields=terminal_fields(record, outcome)
        )

    async def requests(self) -> list[Any]:
        reader = TopicReader(self.settings.kafka.client_kwargs(), self.settings.kafka.topics.requests)
        return await reader.read_all(idle_ms=800)


@pytest.fixture
async def world(settings: LLMBatchSettings) -> AsyncIterator[World]:
    w = World(tagged(settings))
    await ensure_topics(w.settings)
    try:
        yield w
    finally:
        await w.store.close()


async def cli(world: World, *args: str) -> Result:
    """Run the CLI in a worker thread: its commands call asyncio.run themselves."""
    return await asyncio.to_thread(runner.invoke, app, list(args), obj=world.settings)


def as_json(result: Result) -> Any:
    assert result.exit_code == 0, result.output
    return orjson.loads(result.stdout)


def one_line_error(result: Result, code: int = 1) -> str:
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


async def test_list_filters_by_state_time_and_limit(world: World) -> None:
    tag = uuid.uuid4().hex[:6]
    await world.queued(f"q-{tag}")
    await world.running(f"r-{tag}")
    await world.completed(f"c-{tag}")

    everything = as_json(await cli(world, "jobs", "list", "--json"))
    assert {j["batch_id"]: j["state"] for j in everything["jobs"]} == {
        f"q-{tag}": "queued",
        f"r-{tag}": "running",
        f"c-{tag}": "completed",
    }
    assert everything["jobs"][0]["batch_id"] == f"c-{tag}"  # newest state change first
    running = as_json(await cli(world, "jobs", "list", "--state", "running", "--json"))["jobs"]
    assert [j["batch_id"] for j in running] == [f"r-{tag}"]
    assert running[0]["counts"] == {"total": 3, "completed": 2, "failed": 0}  # live counters of the job
    both = as_json(await cli(world, "jobs", "list", "-s", "queued,completed", "--json"))["jobs"]
    assert sorted(j["state"] for j in both) == ["completed", "queued"]
    assert as_json(await cli(world, "jobs", "list", "--limit", "1", "--json"))["count"] == 1
    future = as_json(await cli(world, "jobs", "list", "--since", "2999-01-01T00:00:00Z", "--json"))
    assert future["jobs"] == []
    table = await cli(world, "jobs", "list")
    assert table.exit_code == 0 and "running" in table.stdout and "3 batch(es)" in table.stderr
    assert "unknown state" in one_line_error(await cli(world, "jobs", "list", "--state", "nope"), code=2)
    assert "--since" in one_line_error(await cli(world, "jobs", "list", "--since", "last tuesday"), code=2)


async def test_get_shows_timeline_attempts_counts_results(world: World) -> None:
    batch_id = f"c-{uuid.uuid4().hex[:6]}"
    await world.completed(batch_id)
    job = as_json(await cli(world, "jobs", "get", batch_id, "--json"))
    assert job["state"] == "completed" and job["attempt"] == 1
    sid = await world.sid(batch_id, 1)
    assert [a["submission_id"] for a in job["attempts"]] == [sid] and sid.startswith(f"{batch_id}-")
    assert job["counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert job["usage"] == {"prompt_tokens": 30, "completion_tokens": 24}
    assert job["output_uris"] and job["output_uris"][0].endswith("output-a1-00000.jsonl")
    assert job["manifest_uri"].endswith("manifest.json")
    steps = [e["step"] for e in job["timeline"]]
    assert steps == ["queued", "submitted", "running", "finalizing", "completed"]
    assert job["terminal_event_id"] and job["terminal_event_published"] is False
    human = await cli(world, "jobs", "get", batch_id)
    assert human.exit_code == 0 and sid in human.stdout and "timeline" in human.stdout
    assert "no batch" in one_line_error(await cli(world, "jobs", "get", "never-seen"))


async def test_cancel_publishes_for_live_batches_only(world: World) -> None:
    tag = uuid.uuid4().hex[:6]
    await world.running(f"r-{tag}")
    await world.completed(f"c-{tag}")

    done = await cli(world, "jobs", "cancel", f"r-{tag}", "--reason", "operator test", "--json")
    result = as_json(done)
    assert result["state"] == "running"
    assert result["published"]["topic"] == world.settings.kafka.topics.requests
    assert "already ended completed" in one_line_error(await cli(world, "jobs", "cancel", f"c-{tag}"))
    assert "no batch" in one_line_error(await cli(world, "jobs", "cancel", f"x-{tag}"))
    forced = await cli(world, "jobs", "cancel", f"x-{tag}", "--force")
    assert forced.exit_code == 0, forced.output

    records = await world.requests()
    # the two keys may sit on different partitions: no order between them is promised
    cancels = sorted((decode(r.key, r.value, r.headers) for r in records), key=lambda e: e.batch_id)
    assert [(e.type, e.batch_id) for e in cancels] == [
        (EventType.CANCEL_REQUESTED, f"r-{tag}"),
        (EventType.CANCEL_REQUESTED, f"x-{tag}"),
    ]
    data = cancels[0].data
    assert isinstance(data, CancelRequest) and data.reason == "operator test" and data.requested_by


async def test_get_and_cancel_name_a_batch_by_tenant_and_id(world: World) -> None:
    batch_id = f"t-{uuid.uuid4().hex[:6]}"
    await world.queued(batch_id, tenant="acme")
    # batch ids are scoped by tenant: the default tenant has no batch of that id
    assert "of tenant 'default'" in one_line_error(await cli(world, "jobs", "get", batch_id))
    job = as_json(await cli(world, "jobs", "get", batch_id, "--tenant", "acme", "--json"))
    assert (job["batch_id"], job["tenant"], job["state"]) == (batch_id, "acme", "queued")
    assert "no batch" in one_line_error(await cli(world, "jobs", "cancel", batch_id))
    result = as_json(await cli(world, "jobs", "cancel", batch_id, "--tenant", "acme", "--json"))
    assert result["state"] == "queued"
    [record] = [r for r in await world.requests() if r.key == batch_id.encode()]
    cancel = decode(record.key, record.value, record.headers).data
    assert isinstance(cancel, CancelRequest) and cancel.tenant == "acme"


def test_errors_are_one_line_in_a_real_process(settings: LLMBatchSettings) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMBATCH_")}
    env.update(settings_env(tagged(settings)))
    proc = subprocess.run(
        [sys.executable, "-m", "llmbatch", "jobs", "get", "never-seen"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1 and proc.stderr.startswith("error: no batch 'never-seen'"), proc.stderr
    assert "Traceback" not in proc.stderr
    env["LLMBATCH_REDIS__URL"] = "redis://127.0.0.1:1/0"
    proc = subprocess.run(
        [sys.executable, "-m", "llmbatch", "jobs", "list"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1 and "Redis at redis://127.0.0.1:1/0 did not answer" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
