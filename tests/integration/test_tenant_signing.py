"""Signed tenants on real Kafka and Redis: the producer SDK signs with the keys it holds, the
dispatcher's consumer accepts only requests and cancels signed by the tenant they name, answers the
others on the results topic, and ignores a cancel naming another tenant than the batch's."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from pydantic import SecretStr

from dispatcher.states import State
from llmbatch.settings import LLMBatchSettings, TenantSettings
from producer.client import BatchClient, ClientOptions
from schemas import dlt as dlt_headers
from schemas.batch import CancelRequest
from schemas.events import BatchRejected, EventType
from schemas.tenant_auth import TENANT_SIG
from tests.integration.test_dispatcher_consumer import Harness, make_settings
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
        async with BatchClient(acme_only, options=ClientOptions(source="urn:test:acme")) as acme, \
                BatchClient(globex_only, options=ClientOptions(source="urn:test:globex")) as globex:
            mine = await acme.submit(inline_lines(2), model=MODEL, tenant="acme")
            # acme's producer claiming globex: it has no key for globex, so the request goes unsigned
            claimed = await acme.submit(inline_lines(2), model=MODEL, tenant="globex")
            answer = await claimed.wait(timeout=60)
            assert answer.type is EventType.REJECTED and isinstance(answer.data, BatchRejected)
            assert answer.data.error.param == TENANT_SIG and "is not signed" in answer.data.error.message
            assert answer.data.dead_letter is not None

            record = await h.store.get(mine.batch_id)
            assert record is not None and record.state is State.QUEUED and record.get("tenant") == "acme"
            # globex signs a cancel of its own tenant for acme's batch: taken, and ignored
            await globex.cancel(mine.batch_id, tenant="globex", reason="not yours")
            # an unsigned cancel naming acme (a raw producer without the key): dead-lettered
            await h.send([request_message(CancelRequest(batch_id=mine.batch_id, tenant="acme"))])
            await wait_for(lambda: _committed_is(h, 4), 60, what="the two cancels consumed")
            record = await h.store.get(mine.batch_id)
            assert record is not None and record.state is State.QUEUED and not record.flag("cancel_requested")
            assert h.metrics.processed.labels(outcome="cancel_ignored")._value.get() == 1
            dead = await h.reader("dead_letter").read_all()
            reasons = sorted(dict(r.headers)[dlt_headers.REASON] for r in dead)
            assert reasons == [b"invalid_event", b"invalid_event"]  # the claimed request, the raw cancel

            await acme.cancel(mine.batch_id, tenant="acme")  # its own tenant's, signed: applied
            await wait_for(lambda: _committed_is(h, 5), 60, what="acme's cancel consumed")
            record = await h.store.get(mine.batch_id)
            assert record is not None and record.state is State.CANCELLED
            # without keys on the dispatcher the same unsigned claim is taken (tenant trusted)
            plain = Harness(make_settings(settings))
            await plain.start()
            try:
                request = batch_request("plain-" + uuid.uuid4().hex[:6], tenant="globex")
                await plain.send([request_message(request)])
                await wait_for(lambda: _committed_is(plain, 1), 60, what="the unsigned request consumed")
                taken = await plain.store.get(request.batch_id)
                assert taken is not None and taken.state is State.QUEUED
            finally:
                await plain.stop()
    finally:
        await h.stop()


async def _committed_is(h: Harness, n: int) -> bool:
    return await h.committed() == n


async def test_a_batch_id_in_use_by_another_tenant_is_refused_without_telling_its_state(
    settings: LLMBatchSettings,
) -> None:
    h = Harness(make_settings(settings))
    await h.start()
    try:
        mine = batch_request("taken-" + uuid.uuid4().hex[:6], tenant="acme")
        theirs = mine.model_copy(update={"tenant": "globex"})
        again = mine.model_copy(update={"metadata": {"again": "1"}})
        await h.send([request_message(mine), request_message(theirs, event_id="ev-globex"),
                      request_message(again, event_id="ev-again")])
        await wait_for(lambda: _committed_is(h, 3), 60, what="three requests consumed")
        events = decode_results(await h.reader("results").read_all())
        answers = {e.data.request_id: e.data for e in events if e.type is EventType.REJECTED}
        other, same = answers["ev-globex"], answers["ev-again"]
        assert other.error.code == same.error.code == "duplicate_batch_id"
        assert other.batch_status is None and "another tenant" in other.error.message
        assert "queued" not in other.error.message
        assert same.batch_status is State.QUEUED and "queued" in same.error.message  # acme's own
        record = await h.store.get(mine.batch_id)
        assert record is not None and record.get("tenant") == "acme"
    finally:
        await h.stop()
