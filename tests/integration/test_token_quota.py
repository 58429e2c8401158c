"""Enqueued-token quotas at intake, on real Kafka and Redis (the consumer half of the dispatcher): a
tenant's batch that would pass its limit is refused whole (a dead letter, a ``rejected`` answer with
``token_limit_exceeded``, nothing queued), other tenants are not held back, and the tokens come back
when a batch's end is published."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import pytest

from llmbatch.dispatcher.domain.events import Outcome, terminal_fields
from llmbatch.dispatcher.domain.keys import batch_key
from llmbatch.dispatcher.domain.quota import estimate_inline
from llmbatch.dispatcher.domain.states import State
from llmbatch.schemas import BatchRequest
from llmbatch.schemas import dlt as dlt_headers
from llmbatch.schemas.events import BatchRejected, EventType
from llmbatch.settings import LLMBatchSettings, TenantSettings
from tests.support.consumer_harness import Harness, make_settings
from tests.support.dispatcher_kit import (
    batch_request,
    decode_results,
    inline_lines,
    request_message,
    wait_for,
)

pytestmark = pytest.mark.integration
LINES = inline_lines(4)
PER_BATCH = estimate_inline(line["body"] for line in LINES)


@pytest.fixture
async def harness(settings: LLMBatchSettings) -> AsyncIterator[Harness]:
    base = make_settings(settings)
    limits = TenantSettings(max_enqueued_tokens={"acme": 2 * PER_BATCH + PER_BATCH // 2})
    h = Harness(base.model_copy(update={"tenants": limits}))
    await h.start()
    try:
        yield h
    finally:
        await h.stop()


def _request(tenant: str) -> BatchRequest:
    return batch_request(f"q-{uuid.uuid4().hex[:8]}", tenant=tenant, requests=LINES)


async def _held(h: Harness, tenant: str) -> int:
    return int(await h.store.client.get(h.store.keys.quota_tokens(tenant)) or 0)


async def test_a_batch_over_the_tenants_token_limit_is_refused_whole_until_tokens_come_back(
    harness: Harness,
) -> None:
    first, second, third = (_request("acme") for _ in range(3))
    other = _request("globex")  # no limit of its own, and no "*"
    # one partition for the tenant's three: a record's key spreads them over both, and the order
    # across partitions is not defined, nor then which of them is the one over the limit
    await harness.send([request_message(r) for r in (first, second, third, other)], partitions=[0, 0, 0, 1])
    await wait_for(lambda: harness.committed(), 60, what="commits")
    await wait_for(lambda: _count_is(harness, 4), 60, what="all four handled")

    states = {
        r.batch_id: await harness.store.get(batch_key(r.tenant, r.batch_id))
        for r in (first, second, third, other)
    }
    assert [getattr(states[r.batch_id], "state", None) for r in (first, second, third, other)] == [
        State.QUEUED,
        State.QUEUED,
        State.DEAD_LETTERED,
        State.QUEUED,
    ]
    assert await _held(harness, "acme") == 2 * PER_BATCH  # the refused one holds nothing
    refused = states[third.batch_id]
    assert refused is not None and refused.get("error_code") == "token_limit_exceeded"
    [dead] = await harness.reader("dead_letter").read_to_end()
    assert dict(dead.headers)[dlt_headers.REASON] == b"token_limit_exceeded"
    events = decode_results(await harness.reader("results").read_to_end())
    [answer] = [e for e in events if e.type is EventType.REJECTED]
    assert isinstance(answer.data, BatchRejected) and answer.data.batch_id == third.batch_id
    assert answer.data.error.code == "token_limit_exceeded" and "LLMBATCH_TENANTS__MAX_ENQUEUED_TOKENS" in (
        answer.data.error.message
    )
    assert {e.batch_id for e in events if e.type is EventType.ACCEPTED} == {
        first.batch_id,
        second.batch_id,
        other.batch_id,
    }

    # the first batch ends and its end is published: its tokens come back, and the refused batch sent
    # again (a new request for it) is taken in
    key = batch_key("acme", first.batch_id)
    record = await harness.store.get(key)
    assert record is not None
    outcome = Outcome(State.CANCELLED, time.time())
    fields = terminal_fields(record, outcome)
    assert (await harness.store.transition(key, State.CANCELLED, fields=fields)).ok
    assert await harness.store.mark_published(key, fields["terminal_event_id"], ended_at=outcome.finished_at)
    assert await _held(harness, "acme") == PER_BATCH
    await harness.send([request_message(third)])
    await wait_for(lambda: _count_is(harness, 5), 60, what="the request sent again")
    again = await harness.store.get(batch_key("acme", third.batch_id))
    assert again is not None and again.state is State.QUEUED
    assert await _held(harness, "acme") == 2 * PER_BATCH


async def _count_is(h: Harness, n: int) -> bool:
    return await h.committed() == n
