"""``/v1/webhooks``: a tenant's endpoints through the real app (in-memory ports): the secret shown at
creation and rotation only, and the one the deliveries are signed with; targets refused by name."""

from __future__ import annotations

from typing import Any

import pytest

from llmbatch.schemas import webhooks
from llmbatch.settings.webhooks import WebhookSettings
from tests.support.api_fakes import WEBHOOK_KEY, ApiHarness, make_api

PUBLIC = "https://93.184.216.34/hooks"  # a literal public address: no name to resolve


def _api(**settings: Any) -> ApiHarness:
    return make_api(webhooks=WebhookSettings(signing_key=WEBHOOK_KEY, **settings))


def _create(api: ApiHarness, tenant: str = "acme", **body: Any) -> Any:
    return api.client.post("/v1/webhooks", json={"url": PUBLIC, **body}, headers=api.auth(tenant))


def test_an_endpoint_is_created_listed_read_and_deleted_with_its_secret_shown_once() -> None:
    api = _api()
    made = _create(api, events=["batch.completed", "batch.accepted"], description="billing")
    assert made.status_code == 200, made.text
    endpoint = made.json()
    assert endpoint["object"] == "webhook_endpoint" and endpoint["url"] == PUBLIC
    assert endpoint["events"] == ["batch.completed", "batch.accepted"]
    stored = api.endpoints.by_tenant["acme"][endpoint["id"]]
    # the secret shown is the one deliveries are signed with; nothing secret is stored
    assert endpoint["secret"] == webhooks.endpoint_secret(WEBHOOK_KEY.encode(), stored.id, 1)
    assert endpoint["secret"] not in stored.model_dump_json()
    listed = api.client.get("/v1/webhooks", headers=api.auth()).json()
    assert [e["id"] for e in listed["data"]] == [endpoint["id"]] and listed["data"][0]["secret"] is None
    got = api.client.get(f"/v1/webhooks/{endpoint['id']}", headers=api.auth()).json()
    assert got["secret"] is None and got["description"] == "billing"
    assert api.client.get(f"/v1/webhooks/{endpoint['id']}", headers=api.auth("globex")).status_code == 404
    assert api.client.get("/v1/webhooks", headers=api.auth("globex")).json()["data"] == []
    gone = api.client.delete(f"/v1/webhooks/{endpoint['id']}", headers=api.auth())
    assert gone.json() == {"id": endpoint["id"], "object": "webhook_endpoint.deleted", "deleted": True}
    assert api.client.get(f"/v1/webhooks/{endpoint['id']}", headers=api.auth()).status_code == 404


def test_without_events_an_endpoint_gets_openais_terminal_batch_events() -> None:
    api = _api()
    assert _create(api).json()["events"] == list(webhooks.TERMINAL_WEBHOOK_TYPES)


def test_rotation_gives_a_new_secret_and_the_old_one_stops() -> None:
    api = _api()
    endpoint = _create(api).json()
    rotated = api.client.post(f"/v1/webhooks/{endpoint['id']}/rotate", headers=api.auth()).json()
    assert rotated["secret"] != endpoint["secret"]
    stored = api.endpoints.by_tenant["acme"][endpoint["id"]]
    assert (
        webhooks.endpoint_secret(WEBHOOK_KEY.encode(), stored.id, stored.secret_version) == rotated["secret"]
    )


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
    answer = api.client.post("/v1/webhooks", json={"url": url}, headers=api.auth())
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["param"], error["code"]) == ("url", code) and error["message"].startswith("url: ")
    assert api.endpoints.by_tenant.get("acme", {}) == {}


def test_an_operators_allow_list_lets_a_private_http_receiver_in() -> None:
    api = _api(allow_networks=["127.0.0.0/8"], allow_http=True)
    assert _create(api, url="http://127.0.0.1:8099/in").status_code == 200


def test_bad_fields_are_named() -> None:
    api = _api()
    wrong = api.client.post(
        "/v1/webhooks", json={"url": PUBLIC, "events": ["batch.started"]}, headers=api.auth()
    )
    assert wrong.status_code == 400 and wrong.json()["error"]["param"].startswith("events")
    extra = api.client.post("/v1/webhooks", json={"url": PUBLIC, "secret": "mine"}, headers=api.auth())
    assert extra.status_code == 400 and extra.json()["error"]["param"] == "secret"
    assert api.client.get("/v1/webhooks/whep_nope", headers=api.auth()).status_code == 404


def test_a_tenant_has_at_most_max_endpoints() -> None:
    api = _api(max_endpoints=2)
    assert [_create(api).status_code for _ in range(3)] == [200, 200, 409]
    assert _create(api, tenant="globex").status_code == 200


def test_webhooks_are_off_without_a_signing_key_and_the_answer_names_the_setting() -> None:
    api = make_api()
    answer = api.client.post("/v1/webhooks", json={"url": PUBLIC}, headers=api.auth())
    assert answer.status_code == 404
    assert "LLMBATCH_WEBHOOKS__SIGNING_KEY" in answer.json()["error"]["message"]
    assert api.client.get("/v1/webhooks", headers=api.auth()).status_code == 404
