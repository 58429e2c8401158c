"""Signed tenants on real Kafka and Redis: the producer SDK signs with the keys it holds, the
dispatcher's consumer accepts only requests and cancels signed by the tenant they name, answers the
others on the results topic; batch ids are scoped by tenant, so a cancel reaches only its own
tenant's batch, and two tenants may use one batch id for two batches."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from pydantic import SecretStr

from llmbatch.dispatcher.domain.keys import batch_key
from llmbatch.dispatcher.domain.states import State
from llmbatch.producer.client import BatchClient, ClientOptions
from llmbatch.schemas import dlt as dlt_headers
from llmbatch.schemas.batch import CancelRequest
from llmbatch.schemas.events import BatchRejected, EventType
from llmbatch.schemas.tenant_auth import TENANT_SIG
from llmbatch.settings import LLMBatchSettings, TenantSettings
from tests.support.consumer_harness import Harness, make_settings
from tests.support.dispatcher_kit import (
    MODEL,
    batch_request,
    decode_results,
    inline_lines,
    request_message,
    wait_for,
)

pytestmark = pytest.mark.integration

ACME, GLOBEX = "a" * 32, "g" * 32


def _tenants(**keys: str) -> TenantSettings:
    return TenantSettings(keys={tenant: SecretStr(key) for tenant, key in keys.items()})


def _as(settings: Any, tenants: TenantSettings) -> Any:
    return settings.model_copy(update={"tenants": tenants})


async def test_only_requests_and_cancels_signed_by_their_tenant_are_taken(settings: LLMBatchSettings) -> None:
    dispatcher_settings = _as(make_settings(settings), _tenants(acme=ACME, globex=GLOBEX))
    h = Harness(dispatcher_settings)
    await h.start()
    acme_only = _as(dispatcher_settings, _tenants(acme=ACME))  # a producer given acme's key only
    globex_only = _as(dispatcher_settings, _tenants(globex=GLOBEX))
    try:
        async with (
            BatchClient(acme_only, options=ClientOptions(source="urn:test:acme")) as acme,
            BatchClient(globex_only, options=ClientOptions(source="urn:test:globex")) as globex,
        ):
            mine = await acme.submit(inline_lines(2), model=MODEL, tenant="acme")
            # acme's producer claiming globex: it has no key for globex, so the request goes unsigned
            claimed = await acme.submit(inline_lines(2), model=MODEL, tenant="globex")
            answer = await claimed.wait(timeout=60)
            assert answer.type is EventType.REJECTED and isinstance(answer.data, BatchRejected)
            assert answer.data.error.param == TENANT_SIG and "is not signed" in answer.data.error.message
            assert answer.data.dead_letter is not None

            key = batch_key("acme", mine.batch_id)
            record = await h.store.get(key)
            assert record is not None and record.state is State.QUEUED and record.get("tenant") == "acme"
            # globex signs a cancel of its own tenant's batch of that id: taken, and ignored (globex has
            # no such batch; acme's is another batch)
            await globex.cancel(mine.batch_id, tenant="globex", reason="not yours")
            # an unsigned cancel naming acme (a raw producer without the key): dead-lettered
            await h.send([request_message(CancelRequest(batch_id=mine.batch_id, tenant="acme"))])
            await wait_for(lambda: _committed_is(h, 4), 60, what="the two cancels consumed")
            record = await h.store.get(key)
            assert record is not None and record.state is State.QUEUED and not record.flag("cancel_requested")
            assert h.metrics.processed.labels(outcome="cancel_ignored")._value.get() == 1
            dead = await h.reader("dead_letter").read_to_end()
            reasons = sorted(dict(r.headers)[dlt_headers.REASON] for r in dead)
            assert reasons == [b"invalid_event", b"invalid_event"]  # the claimed request, the raw cancel

            await acme.cancel(mine.batch_id, tenant="acme")  # its own tenant's, signed: applied
            await wait_for(lambda: _committed_is(h, 5), 60, what="acme's cancel consumed")
            record = await h.store.get(key)
            assert record is not None and record.state is State.CANCELLED
            # without keys on the dispatcher the same unsigned claim is taken (tenant trusted)
            plain = Harness(make_settings(settings))
            await plain.start()
            try:
                request = batch_request("plain-" + uuid.uuid4().hex[:6], tenant="globex")
                await plain.send([request_message(request)])
                await wait_for(lambda: _committed_is(plain, 1), 60, what="the unsigned request consumed")
                taken = await plain.store.get(batch_key("globex", request.batch_id))
                assert taken is not None and taken.state is State.QUEUED
            finally:
                await plain.stop()
    finally:
        await h.stop()


async def _committed_is(h: Harness, n: int) -> bool:
    return await h.committed() == n


async def test_two_tenants_using_one_batch_id_get_two_batches_and_a_cancel_reaches_only_its_own(
    settings: LLMBatchSettings,
) -> None:
    h = Harness(make_settings(settings))
    await h.start()
    try:
        mine = batch_request("shared-" + uuid.uuid4().hex[:6], tenant="acme")
        theirs = mine.model_copy(update={"tenant": "globex"})
        again = mine.model_copy(update={"metadata": {"again": "1"}})
        await h.send(
            [
                request_message(mine),
                request_message(theirs, event_id="ev-globex"),
                request_message(again, event_id="ev-again"),
            ]
        )
        await wait_for(lambda: _committed_is(h, 3), 60, what="three requests consumed")
        events = decode_results(await h.reader("results").read_to_end())
        accepted = {e.data.tenant: e for e in events if e.type is EventType.ACCEPTED}
        assert set(accepted) == {"acme", "globex"}  # one batch each, under the one id
        assert accepted["acme"].id != accepted["globex"].id  # consumers dedupe by id: both must stay
        answers = {e.data.request_id: e.data for e in events if e.type is EventType.REJECTED}
        assert set(answers) == {"ev-again"}  # only acme's second request runs into acme's batch
        same = answers["ev-again"]
        assert same.error.code == "duplicate_batch_id" and same.tenant == "acme"
        assert same.batch_status is State.QUEUED and "queued" in same.error.message
        acme = await h.store.get(batch_key("acme", mine.batch_id))
        globex = await h.store.get(batch_key("globex", mine.batch_id))
        assert acme is not None and globex is not None
        assert (acme.tenant, acme.batch_id, globex.tenant, globex.batch_id) == (
            "acme",
            mine.batch_id,
            "globex",
            mine.batch_id,
        )
        assert acme.get("lifecycle") != globex.get("lifecycle")  # so their results and Ray jobs differ

        await h.send([request_message(CancelRequest(batch_id=mine.batch_id, tenant="globex"))])
        await wait_for(lambda: _committed_is(h, 4), 60, what="globex's cancel consumed")
        acme = await h.store.get(batch_key("acme", mine.batch_id))
        globex = await h.store.get(batch_key("globex", mine.batch_id))
        assert globex is not None and globex.state is State.CANCELLED
        assert acme is not None and acme.state is State.QUEUED and not acme.flag("cancel_requested")
    finally:
        await h.stop()
