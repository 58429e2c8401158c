"""Retention on real Kafka, Redis and MinIO: a batch sent with ``output_expires_after`` of an hour ends
(its terminal event published by the real publisher dates it), its result files show ``expires_at``,
answer 404 ``expired`` once the (test) clock passes it, and the collector then removes its shards,
manifest and state; what running batches need stays: the results and state of a reopened lifecycle,
and an expired upload that a batch created from it may still read (removed once that batch can no
longer read it). Two collectors at once remove each expired batch once."""

from __future__ import annotations

import asyncio
import io
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from fastapi.testclient import TestClient

from llmbatch.adapters.errors import StorageError
from llmbatch.adapters.storage import ensure_buckets, make_client
from llmbatch.api.http.app import build_services, create_app
from llmbatch.api.retention.collector import Collector, Report
from llmbatch.api.settings import ApiOptions
from llmbatch.api.store.state import RedisStateReader
from llmbatch.api.store.storage import MinioObjectStore
from llmbatch.api.tenancy.auth import hash_api_key
from llmbatch.dispatcher.domain.dlt import OriginalRecord
from llmbatch.dispatcher.domain.events import Outcome, terminal_fields
from llmbatch.dispatcher.domain.keys import BatchKey, batch_key
from llmbatch.dispatcher.domain.retention import batch_member
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.intake.commands import Accept, IntakeRules, classify
from llmbatch.dispatcher.state.retention import RetentionIndex
from llmbatch.schemas.batch import InlineLimits
from llmbatch.schemas.job import output_prefix
from llmbatch.settings import LLMBatchSettings, S3Settings
from llmbatch.settings.retention import RetentionSettings
from tests.integration.test_dispatcher_publisher import World, make_world, topic_settings, worlds  # noqa: F401
from tests.support.api_fakes import RecordingPublisher, chat_line, jsonl
from tests.support.clock import Clock
from tests.support.dispatcher_kit import MODEL, batch_request, request_message

pytestmark = pytest.mark.integration
TENANT = f"ret-{uuid.uuid4().hex[:8]}"  # its own folders: the session's MinIO is shared with other tests
KEY = "sk-retention-test"
HOUR = 3600


@dataclass
class Setup:
    w: World
    index: RetentionIndex
    objects: MinioObjectStore
    api: TestClient
    clock: Clock
    results_bucket: str
    input_bucket: str
    collectors: list[Collector]
    published: RecordingPublisher

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {KEY}"}

    async def keys(self, bucket: str, prefix: str) -> list[str]:
        return await self.objects.list_keys(bucket, prefix, limit=10_000)


@pytest.fixture
async def setup(settings: LLMBatchSettings, worlds: list[World]) -> AsyncIterator[Setup]:  # noqa: F811
    w = await make_world(settings, topic_settings())
    worlds.append(w)
    ensure_buckets(make_client(settings.s3), settings.s3)
    objects = MinioObjectStore(settings.s3)
    index = RetentionIndex(w.store.client, w.store.keys)
    clock = Clock(time.time())
    # the API has its own client: the test client runs the app in another event loop
    api_store = type(w.store).from_url(settings.redis.url, keys=w.store.keys)
    retention = RetentionSettings(collect_every_s=0)
    options = ApiOptions(keys={hash_api_key(KEY): TENANT}, source="urn:test:api")
    published = RecordingPublisher()
    services = build_services(
        options,
        objects=objects,
        state=RedisStateReader(api_store),
        publisher=published,
        input_bucket=settings.s3.input_bucket,
        results_bucket=settings.s3.results_bucket,
        requests_topic=w.kafka.topics.requests,
        retention=retention,
        retention_index=RetentionIndex(api_store.client, api_store.keys),
        clock=clock,
    )
    collectors = [
        Collector.over(
            index,
            objects,
            RedisStateReader(w.store),
            input_bucket=settings.s3.input_bucket,
            results_bucket=settings.s3.results_bucket,
            settings=retention,
            fallback_after_s=options.state_fallback_after_s,
            clock=clock,
        )
        for _ in range(2)
    ]
    with TestClient(create_app(services, on_close=[api_store.close])) as client:
        yield Setup(
            w,
            index,
            objects,
            client,
            clock,
            settings.s3.results_bucket,
            settings.s3.input_bucket,
            collectors,
            published,
        )


def _rules(s: Setup) -> IntakeRules:
    topics = s.w.kafka.topics
    return IntakeRules(
        requests_topic=topics.requests,
        dlt_topic=topics.dead_letter,
        group_id="g-retention",
        served_models=frozenset({MODEL}),
        inline_limits=InlineLimits(max_requests=1000, max_bytes=2_000_000),
    )


async def _take_in(
    s: Setup, n: int, key: bytes, value: bytes, headers: list[tuple[str, bytes]]
) -> tuple[BatchKey, str]:
    """The record taken in as the consumer does; the batch's key and lifecycle."""
    topic = s.w.kafka.topics.requests
    origin = OriginalRecord(topic, 0, n, key, value, tuple(headers), int(time.time() * 1000), 0)
    accept = classify(origin, _rules(s), time.time())
    assert isinstance(accept, Accept)
    assert (await s.w.store.intake(accept.item)).is_new
    record = await s.w.store.get(accept.item.key)
    assert record is not None
    return accept.item.key, record.get("lifecycle") or ""


async def _accepted(s: Setup, n: int, **request: object) -> tuple[BatchKey, str]:
    """A batch of the tenant sent to Kafka, taken in; its key and lifecycle."""
    data = batch_request(f"r-{uuid.uuid4().hex[:8]}", tenant=TENANT, **request)
    return await _take_in(s, n, *request_message(data))


async def _results(s: Setup, batch_id: str, lifecycle: str) -> list[str]:
    """Shards and a manifest in the lifecycle's folder, as a job writes them; their URIs."""
    folder = output_prefix(s.results_bucket, TENANT, batch_id, lifecycle).removeprefix(
        f"s3://{s.results_bucket}/"
    )
    uris = []
    for name in ("output-a1-00000.jsonl", "error-a1-00000.jsonl", "manifest.json"):
        data = b"{}\n" if name.endswith(".jsonl") else b"{}"
        await s.objects.put(s.results_bucket, folder + name, io.BytesIO(data), len(data), content_type="x")
        uris.append(f"s3://{s.results_bucket}/{folder}{name}")
    return uris


async def _run(s: Setup, key: BatchKey) -> None:
    record = await s.w.store.get(key)
    assert record is not None
    for step in (State.SUBMITTED, State.RUNNING):
        moved = await s.w.store.transition(
            key, step, expected_version=record.version, fields={"attempt": "1"}
        )
        assert moved.ok
        record = await s.w.store.get(key)
        assert record is not None


async def _complete(s: Setup, key: BatchKey, uris: list[str]) -> float:
    """Run the batch to completed with those results and publish its end (the real publisher); when
    it ended."""
    record = await s.w.store.get(key)
    if record is not None and record.state is State.QUEUED:
        await _run(s, key)
    ended = time.time()
    outcome = Outcome(
        State.COMPLETED,
        ended,
        output_uris=[uris[0]],
        error_uris=[uris[1]],
        manifest_uri=uris[2],
        counts={"total": 3, "completed": 3, "failed": 0},
        started_at=ended - 1,
    )
    for step in (State.FINALIZING, State.COMPLETED):
        record = await s.w.store.get(key)
        assert record is not None
        fields = terminal_fields(record, outcome) if step is State.COMPLETED else {}
        assert (await s.w.store.transition(key, step, expected_version=record.version, fields=fields)).ok
    assert await s.w.publisher.publish_pending() == 1
    return ended


async def test_expired_results_and_state_go_and_what_running_batches_need_stays(setup: Setup) -> None:
    s = setup
    # a batch kept an hour after its end (Kafka's output_expires_after), ended with results
    key, lifecycle = await _accepted(s, 1, output_expires_after={"anchor": "created_at", "seconds": HOUR})
    batch_id = key.split("/")[1]
    uris = await _results(s, batch_id, lifecycle)
    ended = await _complete(s, key, uris)
    member = batch_member(TENANT, batch_id, lifecycle)
    [due] = await s.index.due_of([member])
    assert due is not None and abs(due - (ended + HOUR)) < 0.01
    shown = s.api.get(f"/v1/files/file-output-{batch_id}", headers=s.auth())
    assert shown.status_code == 200, shown.text
    assert shown.json()["expires_at"] == int(due)
    assert s.api.get(f"/v1/files/file-output-{batch_id}/content", headers=s.auth()).content == b"{}\n"

    # a batch an operator reopened: its lifecycle is dated (it ended once) but it runs again
    running, running_lc = await _accepted(s, 2)
    running_uris = await _results(s, running.split("/")[1], running_lc)
    await _run(s, running)
    await s.index.schedule(batch_member(TENANT, running.split("/")[1], running_lc), ended + HOUR)

    # an upload kept an hour, read by a batch made from it that has not ended (nothing ran it yet)
    upload = s.api.post(
        "/v1/files",
        headers=s.auth(),
        data={"purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": str(HOUR)},
        files={"file": ("in.jsonl", jsonl(chat_line("a")), "application/jsonl")},
    )
    assert upload.status_code == 200, upload.text
    file_id = upload.json()["id"]
    assert upload.json()["expires_at"] == int(s.clock.now + HOUR)
    made = s.api.post(
        "/v1/batches",
        headers={**s.auth(), "Idempotency-Key": "nightly-1"},
        json={
            "input_file_id": file_id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            "output_expires_after": {"anchor": "created_at", "seconds": HOUR},
        },
    )
    assert made.status_code == 200, made.text
    api_batch = made.json()["id"]
    [(_, event_key, event_value, event_headers)] = s.published.records
    api_key, api_lc = await _take_in(s, 3, event_key, event_value, event_headers)  # as the dispatcher does
    await _run(s, api_key)
    api_objects = await s.keys(s.input_bucket, f"{TENANT}/api/")
    assert len(api_objects) == 4  # the records of the file and the batch, its use mark, its key's claim

    # an hour later: reads say expired before anything is deleted
    s.clock.now = ended + HOUR + 1
    gone = s.api.get(f"/v1/files/file-output-{batch_id}/content", headers=s.auth())
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "expired"
    assert s.api.get(f"/v1/files/{file_id}", headers=s.auth()).json()["error"]["code"] == "expired"

    report = await s.collectors[0].collect()
    assert (report.batches, report.result_objects, report.reopened, report.in_use, report.files) == (
        1,
        3,
        1,
        1,
        0,
    )
    folder = f"{TENANT}/{batch_id}/"
    assert await s.keys(s.results_bucket, folder) == []
    assert await s.w.store.get(key) is None
    assert s.api.get(f"/v1/batches/{batch_id}", headers=s.auth()).json()["error"]["code"] == "expired"
    assert (
        s.api.get(f"/v1/files/file-error-{batch_id}", headers=s.auth()).json()["error"]["code"] == "expired"
    )
    # the running batch: its results and state are untouched, and it left the index (its end dates it)
    running_folder = running_uris[0].removeprefix(f"s3://{s.results_bucket}/").rsplit("/", 1)[0] + "/"
    assert len(await s.keys(s.results_bucket, running_folder)) == 3
    record = await s.w.store.get(running)
    assert record is not None and record.state is State.RUNNING
    # the upload a batch may still read stays
    assert await s.keys(s.input_bucket, f"{TENANT}/files/{file_id}") != []

    # the API's batch ends (its results kept an hour); once both are past, both go, with all the API kept
    api_uris = await _results(s, api_batch, api_lc)
    await _complete(s, api_key, api_uris)
    s.clock.now = time.time() + 3 * HOUR
    again = await s.collectors[0].collect()
    assert (again.files, again.in_use, again.batches, again.result_objects) == (1, 0, 1, 3)
    assert await s.keys(s.input_bucket, f"{TENANT}/") == []  # upload, records, marks, idempotency claim
    assert await s.keys(s.results_bucket, f"{TENANT}/{api_batch}/") == []
    assert await s.w.store.get(api_key) is None
    assert s.api.get(f"/v1/files/{file_id}/content", headers=s.auth()).json()["error"]["code"] == "expired"
    assert s.api.get(f"/v1/batches/{api_batch}", headers=s.auth()).json()["error"]["code"] == "expired"
    assert await s.index.pending(s.clock.now) == (0, 0)


async def test_two_collectors_at_once_remove_each_expired_batch_once(setup: Setup) -> None:
    s = setup
    ended: list[tuple[str, str]] = []
    for n in range(6):
        key, lifecycle = await _accepted(
            s, 10 + n, output_expires_after={"anchor": "created_at", "seconds": HOUR}
        )
        await _complete(s, key, await _results(s, key.split("/")[1], lifecycle))
        ended.append((key.split("/")[1], lifecycle))
    s.clock.now = time.time() + HOUR + 1
    reports = await asyncio.gather(*(c.collect(limit=2) for c in s.collectors))
    total = Report()
    for report in reports:
        total.add(report)
    assert (total.batches, total.result_objects) == (6, 18)
    for batch_id, _ in ended:
        assert await s.keys(s.results_bucket, f"{TENANT}/{batch_id}/") == []
        assert await s.w.store.get(batch_key(TENANT, batch_id)) is None
    assert await s.index.pending(s.clock.now) == (0, 0)
    assert (total.lost, total.invalid) == (0, 0)


class RefusingStore(MinioObjectStore):
    """The real MinIO store, but deletes under one folder fail (a bucket policy, an S3 hiccup) while
    ``refusing`` holds."""

    def __init__(self, s3: S3Settings, folder: str) -> None:
        super().__init__(s3)
        self.folder = folder
        self.refusing = True

    async def delete(self, bucket: str, key: str) -> None:
        if self.refusing and key.startswith(self.folder):
            raise StorageError(f"AccessDenied deleting s3://{bucket}/{key}", retriable=False)
        await super().delete(bucket, key)


async def test_a_removal_that_fails_holds_back_no_other_and_is_done_later(
    setup: Setup, settings: LLMBatchSettings
) -> None:
    s = setup
    ended: list[str] = []
    for n in range(3):
        key, lifecycle = await _accepted(
            s, 30 + n, output_expires_after={"anchor": "created_at", "seconds": HOUR}
        )
        await _complete(s, key, await _results(s, key.split("/")[1], lifecycle))
        ended.append(key.split("/")[1])
    refusing = RefusingStore(settings.s3, f"{TENANT}/{ended[1]}/")
    collector = Collector.over(
        s.index,
        refusing,
        RedisStateReader(s.w.store),
        input_bucket=s.input_bucket,
        results_bucket=s.results_bucket,
        settings=RetentionSettings(collect_every_s=0),
        fallback_after_s=60.0,
        clock=s.clock,
    )
    s.clock.now = time.time() + HOUR + 1
    report = await collector.collect()
    assert (report.batches, report.failed) == (2, 1)
    assert ended[1] in report.first_error and "AccessDenied" in report.first_error
    assert await s.keys(s.results_bucket, f"{TENANT}/{ended[0]}/") == []
    assert await s.keys(s.results_bucket, f"{TENANT}/{ended[2]}/") == []
    assert await s.index.pending(s.clock.now) == (1, 1)  # still dated, taken again after its lease
    refusing.refusing = False
    s.clock.now += collector.lease_s + 1
    again = await collector.collect()
    assert (again.batches, again.failed) == (1, 0)
    assert await s.keys(s.results_bucket, f"{TENANT}/{ended[1]}/") == []
    assert await s.index.pending(s.clock.now) == (0, 0)
