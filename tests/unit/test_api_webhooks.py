"""``/v1/webhook_endpoints`` through the real app (in-memory ports), driven by the official ``openai``
SDK's ``client.webhooks`` calls unchanged: the secret shown at creation and rotation only, and the one
the deliveries are signed with; targets refused by name."""

from __future__ import annotations

import time
from typing import Any

import openai
import pytest
from openai.types.webhooks import BatchCompletedWebhookEvent

from llmbatch.schemas import webhooks
from llmbatch.settings.webhooks import WebhookSettings
from tests.support.api_fakes import KEYS, T0, WEBHOOK_KEY, ApiHarness, make_api

PUBLIC = "https://93.184.216.34/hooks"  # a literal public address: no name to resolve
BATCH_EVENTS: Any = ["batch.completed", "batch.failed"]


def _api(**settings: Any) -> ApiHarness:
    return make_api(webhooks=WebhookSettings(signing_key=WEBHOOK_KEY, **settings))


def _sdk(api: ApiHarness, tenant: str = "acme") -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key=KEYS[tenant], http_client=api.client, max_retries=0
    )


def test_the_sdk_creates_lists_reads_updates_and_deletes_an_endpoint_whose_secret_is_shown_once() -> None:
    api = _api()
    client = _sdk(api)
    made = client.webhooks.create(url=PUBLIC, event_types=BATCH_EVENTS, name="billing")
    assert (made.url, made.event_types, made.name, made.object) == (
        PUBLIC,
        BATCH_EVENTS,
        "billing",
        "webhook_endpoint",
    )
    stored = api.endpoints.by_tenant["acme"][made.id]
    # the secret shown is the one deliveries are signed with; nothing secret is stored
    assert made.signing_secret == webhooks.endpoint_secret(WEBHOOK_KEY.encode(), stored.id, 1)
    assert made.signing_secret not in stored.model_dump_json()
    assert made.signing_secret_hint == f"whsec_...{made.signing_secret[-4:]}"
    listed = client.webhooks.list()
    assert [e.id for e in listed.data] == [made.id] and "signing_secret" not in listed.data[0].model_dump()
    got = client.webhooks.retrieve(made.id)
    assert got.name == "billing" and got.created_at == int(T0) == got.updated_at
    with pytest.raises(openai.NotFoundError):
        _sdk(api, "globex").webhooks.retrieve(made.id)  # another tenant's key sees nothing
    assert _sdk(api, "globex").webhooks.list().data == []
    api.clock.now += 60
    changed = client.webhooks.update(made.id, event_types=["batch.expired"], name="renamed")
    assert (changed.event_types, changed.name, changed.updated_at) == (
        ["batch.expired"],
        "renamed",
        int(T0) + 60,
    )
    assert (
        client.webhooks.update(made.id, name="renamed").updated_at == int(T0) + 60
    )  # unchanged: not advanced
    gone = client.webhooks.delete(made.id)
    assert (gone.id, gone.deleted, gone.object) == (made.id, True, "webhook_endpoint.deleted")
    with pytest.raises(openai.NotFoundError):
        client.webhooks.retrieve(made.id)


def test_rotation_gives_a_new_secret_and_may_keep_the_old_one_signing_for_a_day() -> None:
    api = _api()
    client = _sdk(api)
    made = client.webhooks.create(url=PUBLIC, event_types=BATCH_EVENTS, name="n")
    rotated = client.webhooks.rotate_secret(made.id)
    assert rotated.signing_secret not in (None, made.signing_secret)
    stored = api.endpoints.by_tenant["acme"][made.id]
    assert stored.secret_versions(T0) == (2,)  # the old secret signs nothing now
    kept = client.webhooks.rotate_secret(made.id, keep_old_secret_active_for_24_hours=True)
    stored = api.endpoints.by_tenant["acme"][made.id]
    assert stored.secret_versions(T0 + 3600) == (3, 2) and stored.secret_versions(T0 + 86400) == (3,)
    # a delivery signed then verifies with either secret (Standard Webhooks' several signatures)
    secrets = tuple(webhooks.endpoint_secret(WEBHOOK_KEY.encode(), made.id, v) for v in (3, 2))
    body = webhooks.event_body("evt-1", "batch.completed", 1, "b")
    sent = webhooks.headers(secrets, "evt-1", int(time.time()), body)
    for secret in (kept.signing_secret, rotated.signing_secret):
        event = openai.OpenAI(api_key="x", webhook_secret=secret).webhooks.unwrap(body.decode(), sent)
        assert isinstance(event, BatchCompletedWebhookEvent)
        assert event.data.id == "b"


def test_pages_of_endpoints_with_after() -> None:
    api = _api()
    client = _sdk(api)
    ids = []
    for n in range(5):
        api.clock.now += 1
        ids.append(client.webhooks.create(url=PUBLIC, event_types=BATCH_EVENTS, name=str(n)).id)
    assert [e.id for e in client.webhooks.list(limit=2).data] == ids[:2]
    assert [e.id for e in client.webhooks.list(limit=2)] == ids  # the SDK's auto-paging


@pytest.mark.parametrize(
    ("url", "code"),
    [
        ("https://127.0.0.1/hooks", "webhook_target_refused"),
        ("https://localhost:8443/hooks", "webhook_target_refused"),
        ("https://169.254.169.254/latest/meta-data", "webhook_target_refused"),
        ("https://[::1]/x", "webhook_target_refused"),
        ("http://93.184.216.34/hooks", "webhook_target_refused"),
        ("https://no-such-host.invalid/x", "webhook_target_unresolved"),
    ],
)
def test_a_target_that_is_not_public_or_not_https_is_refused_naming_url(url: str, code: str) -> None:
    api = _api()
    with pytest.raises(openai.BadRequestError) as refused:
        _sdk(api).webhooks.create(url=url, event_types=BATCH_EVENTS, name="n")
    assert (refused.value.param, refused.value.code) == ("url", code)
    body = refused.value.body
    assert isinstance(body, dict)
    assert str(body["message"]).startswith("url: ")
    assert api.endpoints.by_tenant.get("acme", {}) == {}


def test_an_operators_allow_list_lets_a_private_http_receiver_in() -> None:
    api = _api(allow_networks=["127.0.0.0/8"], allow_http=True)
    _sdk(api).webhooks.create(url="http://127.0.0.1:8099/in", event_types=BATCH_EVENTS, name="n")


def test_bad_fields_are_named() -> None:
    api = _api()
    wrong = api.client.post(
        "/v1/webhook_endpoints",
        json={"url": PUBLIC, "event_types": ["response.completed"]},
        headers=api.auth(),
    )
    assert wrong.status_code == 400 and wrong.json()["error"]["param"].startswith("event_types")
    extra = api.client.post(
        "/v1/webhook_endpoints",
        json={"url": PUBLIC, "event_types": BATCH_EVENTS, "secret": "x"},
        headers=api.auth(),
    )
    assert extra.status_code == 400 and extra.json()["error"]["param"] == "secret"
    assert api.client.get("/v1/webhook_endpoints/whep_nope", headers=api.auth()).status_code == 404
    page = api.client.get("/v1/webhook_endpoints?after=whep_nope", headers=api.auth())
    assert page.status_code == 400 and page.json()["error"]["param"] == "after"


def test_a_tenant_has_at_most_max_endpoints() -> None:
    api = _api(max_endpoints=2)
    client = _sdk(api)
    for _ in range(2):
        client.webhooks.create(url=PUBLIC, event_types=BATCH_EVENTS, name="n")
    with pytest.raises(openai.ConflictError):
        client.webhooks.create(url=PUBLIC, event_types=BATCH_EVENTS, name="n")
    _sdk(api, "globex").webhooks.create(url=PUBLIC, event_types=BATCH_EVENTS, name="n")


def test_webhooks_are_off_without_a_signing_key_and_the_answer_names_the_setting() -> None:
    api = make_api()
    with pytest.raises(openai.NotFoundError) as off:
        _sdk(api).webhooks.create(url=PUBLIC, event_types=BATCH_EVENTS, name="n")
    assert "LLMBATCH_WEBHOOKS__SIGNING_KEY" in str(off.value)


def test_the_sdks_test_call_sends_one_signed_delivery_and_answers_its_status() -> None:
    """A receiver on loopback (allowed by the operator) that verifies with the SDK; then it goes away."""
    from tests.support.webhook_receiver import Receiver

    api = _api(allow_networks=["127.0.0.1/32"], allow_http=True)
    client = _sdk(api)
    receiver = Receiver()
    made = client.webhooks.create(url=receiver.url, event_types=BATCH_EVENTS, name="n")
    receiver.secret = made.signing_secret
    receiver.up()
    api.clock.now = time.time()  # the receiver checks the delivery's timestamp against its own clock
    try:
        result = client.webhooks.test(made.id, event_type="batch.failed")
        assert (result.status_code, result.success, result.webhook_endpoint_id) == (200, True, made.id)
        (got,) = receiver.accepted
        assert (got.type, got.batch_id) == ("batch.failed", "batch_test")
    finally:
        receiver.down()
    with pytest.raises(openai.BadRequestError) as gone:
        client.webhooks.test(made.id, event_type="batch.completed")
    assert gone.value.code == "webhook_test_failed"
