"""Stored-bytes quotas at intake, on real Kafka, Redis and MinIO: the tracker leader measures what each
tenant keeps (``dispatcher.runs.stored_bytes``); a batch of a tenant at or over
``LLMBATCH_TENANTS__MAX_STORED_BYTES`` is refused whole (a dead letter and a ``rejected`` answer with
``storage_quota_exceeded``, nothing queued), other tenants are not held back, and once the tenant's files
are gone (and measured so) the batch sent again is taken in."""

from __future__ import annotations

import asyncio
import io
import uuid
from collections.abc import AsyncIterator

import pytest
from minio import Minio

from llmbatch.dispatcher.domain.keys import batch_key
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.metrics import Metrics
from llmbatch.dispatcher.runs.stored_bytes import StoredBytes
from llmbatch.schemas import BatchRequest
from llmbatch.schemas import dlt as dlt_headers
from llmbatch.schemas.events import BatchRejected, EventType
from llmbatch.settings import LLMBatchSettings, S3Settings
from llmbatch.settings.tenants import TenantSettings
from tests.support.consumer_harness import Harness, make_settings
from tests.support.dispatcher_kit import (
    batch_request,
    decode_results,
    inline_lines,
    request_message,
    wait_for,
)

pytestmark = pytest.mark.integration
FULL = f"full-{uuid.uuid4().hex[:6]}"
ROOMY = f"roomy-{uuid.uuid4().hex[:6]}"
LIMIT = 100


class Lead:
    is_leader = True


@pytest.fixture
async def harness(settings: LLMBatchSettings) -> AsyncIterator[Harness]:
    base = make_settings(settings)
    h = Harness(base.model_copy(update={"tenants": TenantSettings(max_stored_bytes={"*": LIMIT})}))
    await h.start()
    try:
        yield h
    finally:
        await h.stop()


async def _measure(h: Harness, s3: S3Settings) -> None:
    """One measure by the leader's task, as it runs every interval."""
    stored = StoredBytes(s3, Metrics(), Lead(), frozenset(), asyncio.Event(), every_s=3600, figures=h.store)
    await stored.measure_once()


def _request(tenant: str) -> BatchRequest:
    return batch_request(f"s-{uuid.uuid4().hex[:8]}", tenant=tenant, requests=inline_lines(2))


async def test_a_batch_of_a_tenant_over_its_storage_is_refused_until_it_has_room(
    harness: Harness, node_minio: Minio, s3_settings: S3Settings
) -> None:
    node_minio.put_object(
        s3_settings.results_bucket, f"{FULL}/old/0123456789/output-a1-00000.jsonl", io.BytesIO(b"x" * 80), 80
    )
    node_minio.put_object(s3_settings.input_bucket, f"{FULL}/files/a.jsonl", io.BytesIO(b"y" * 30), 30)
    node_minio.put_object(s3_settings.input_bucket, f"{ROOMY}/files/a.jsonl", io.BytesIO(b"z" * 10), 10)
    await _measure(harness, s3_settings)
    assert await harness.store.stored_bytes_many([FULL, ROOMY]) == [110, 10]

    refused, accepted = _request(FULL), _request(ROOMY)
    await harness.send([request_message(refused), request_message(accepted)])
    await wait_for(lambda: _count_is(harness, 2), 60, what="both handled")
    gone = await harness.store.get(batch_key(FULL, refused.batch_id))
    assert gone is not None and gone.state is State.DEAD_LETTERED
    assert gone.get("error_code") == "storage_quota_exceeded"
    kept = await harness.store.get(batch_key(ROOMY, accepted.batch_id))
    assert kept is not None and kept.state is State.QUEUED
    [dead] = await harness.reader("dead_letter").read_to_end()
    assert dict(dead.headers)[dlt_headers.REASON] == b"storage_quota_exceeded"
    events = decode_results(await harness.reader("results").read_to_end())
    [answer] = [e for e in events if e.type is EventType.REJECTED]
    assert isinstance(answer.data, BatchRejected) and answer.data.error.code == "storage_quota_exceeded"
    assert "LLMBATCH_TENANTS__MAX_STORED_BYTES" in answer.data.error.message
    assert {e.batch_id for e in events if e.type is EventType.ACCEPTED} == {accepted.batch_id}

    # its results go (deleted, or their retention ended) and the next measure says so: sent again, taken in
    node_minio.remove_object(s3_settings.results_bucket, f"{FULL}/old/0123456789/output-a1-00000.jsonl")
    await _measure(harness, s3_settings)
    assert await harness.store.stored_bytes_many([FULL]) == [30]
    await harness.send([request_message(refused)])
    await wait_for(lambda: _count_is(harness, 3), 60, what="the request sent again")
    again = await harness.store.get(batch_key(FULL, refused.batch_id))
    assert again is not None and again.state is State.QUEUED


async def _count_is(h: Harness, n: int) -> bool:
    return await h.committed() == n
