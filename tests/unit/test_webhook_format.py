"""Webhook deliveries as their receivers check them: the official ``openai`` SDK's verification
(``client.webhooks.unwrap``) and the ``standardwebhooks`` library accept every signed delivery; a
changed one is refused; OpenAI's batch event objects read back; targets that are not public are
refused unless an operator allows them."""

from __future__ import annotations

import contextlib
import ipaddress
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from openai import InvalidWebhookSignatureError, OpenAI
from openai.types.webhooks import (
    BatchCancelledWebhookEvent,
    BatchCompletedWebhookEvent,
    BatchExpiredWebhookEvent,
    BatchFailedWebhookEvent,
)
from standardwebhooks.webhooks import Webhook

from llmbatch.dispatcher.webhooks import targets
from llmbatch.schemas import webhooks
from llmbatch.settings.webhooks import WebhookSettings

KEY = b"k" * 40
EP = "whep_" + "a" * 24
BATCH_EVENTS = (
    BatchCompletedWebhookEvent,
    BatchFailedWebhookEvent,
    BatchCancelledWebhookEvent,
    BatchExpiredWebhookEvent,
)


def _client(secret: str) -> OpenAI:
    return OpenAI(api_key="unused", base_url="http://127.0.0.1:9", webhook_secret=secret)


@pytest.mark.parametrize("kind", ["batch.completed", "batch.failed", "batch.cancelled", "batch.expired"])
def test_the_sdk_verifies_each_terminal_event_and_reads_the_batch_id(kind: str) -> None:
    secret = webhooks.endpoint_secret(KEY, EP, 1)
    now = int(time.time())
    body = webhooks.event_body("evt-1", kind, now - 5, "nightly-7")
    event = _client(secret).webhooks.unwrap(body.decode(), webhooks.headers(secret, "evt-1", now, body))
    assert isinstance(event, BATCH_EVENTS)
    assert (event.type, event.id, event.data.id, event.created_at) == (kind, "evt-1", "nightly-7", now - 5)


@given(
    event_id=st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=80),
    batch_id=st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", fullmatch=True),
    version=st.integers(1, 10_000),
)
def test_any_event_signs_so_the_sdk_verifies_it_and_a_changed_byte_does_not(
    event_id: str, batch_id: str, version: int
) -> None:
    secret = webhooks.endpoint_secret(KEY, EP, version)
    now = int(time.time())
    body = webhooks.event_body(event_id, "batch.completed", now, batch_id)
    sent = webhooks.headers(secret, event_id, now, body)
    event = _client(secret).webhooks.unwrap(body.decode(), sent)
    assert isinstance(event, BatchCompletedWebhookEvent)
    assert event.data.id == batch_id
    assert Webhook(secret).verify(body, sent)["data"] == {"id": batch_id}  # the standardwebhooks library
    changed = body.replace(b'"object"', b'"objecT"')
    with pytest.raises(InvalidWebhookSignatureError):
        _client(secret).webhooks.verify_signature(changed.decode(), sent)
    with pytest.raises(InvalidWebhookSignatureError):  # the secret before a rotation signs nothing now
        _client(webhooks.endpoint_secret(KEY, EP, version + 1)).webhooks.verify_signature(body.decode(), sent)


def test_secrets_differ_by_endpoint_version_and_key() -> None:
    made = {
        webhooks.endpoint_secret(KEY, EP, 1),
        webhooks.endpoint_secret(KEY, EP, 2),
        webhooks.endpoint_secret(KEY, "whep_" + "b" * 24, 1),
        webhooks.endpoint_secret(b"j" * 40, EP, 1),
    }
    assert len(made) == 4 and all(s.startswith("whsec_") for s in made)


def test_an_old_timestamp_is_refused_by_the_sdk() -> None:
    """The receiver's tolerance window: a delivery replayed 10 minutes later does not verify."""
    secret = webhooks.endpoint_secret(KEY, EP, 1)
    old = int(time.time()) - 600
    body = webhooks.event_body("evt-2", "batch.failed", old, "b")
    with pytest.raises(InvalidWebhookSignatureError):
        _client(secret).webhooks.verify_signature(body.decode(), webhooks.headers(secret, "evt-2", old, body))


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://hooks.example.com/x", "https://"),
        ("ftp://hooks.example.com/x", "https://"),
        ("https://user:pw@hooks.example.com/x", "credentials"),
        ("https:///nohost", "no host"),
        ("https://hooks.example.com/x#frag", "fragment"),
        ("https://hooks.example.com/ x", "spaces"),
        ("https://hooks.example.com:99999/x", "not a URL"),
        ("https://" + "a" * 2100 + ".com/", "2048"),
    ],
)
def test_a_url_webhooks_may_not_target_is_refused_naming_why(url: str, why: str) -> None:
    with pytest.raises(targets.TargetRefused, match=why):
        targets.check_url(url, allow_http=False)


def test_a_good_url_splits_into_what_is_sent() -> None:
    t = targets.check_url("https://hooks.example.com:8443/in?x=1", allow_http=False)
    assert (t.scheme, t.host, t.port, t.path) == ("https", "hooks.example.com", 8443, "/in?x=1")
    assert targets.check_url("http://h.example.com", allow_http=True).port == 80


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "127.8.9.10",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "169.254.169.254",
        "100.64.0.1",
        "0.0.0.0",
        "224.0.0.1",
        "::1",
        "fe80::1",
        "fc00::1",
        "::ffff:127.0.0.1",
        "::ffff:10.0.0.1",
        "::",
    ],
)
def test_addresses_that_are_not_public_are_refused_unless_allowed(address: str) -> None:
    ip = ipaddress.ip_address(address)
    with pytest.raises(targets.TargetRefused, match="LLMBATCH_WEBHOOKS__ALLOW_NETWORKS"):
        targets.check_address(ip, [])
    plain = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped else ip
    targets.check_address(ip, WebhookSettings(allow_networks=[str(plain)]).networks())


@pytest.mark.parametrize("address", ["93.184.216.34", "8.8.8.8", "2606:4700:4700::1111"])
def test_public_addresses_pass(address: str) -> None:
    targets.check_address(ipaddress.ip_address(address), [])


async def test_a_name_that_resolves_to_loopback_is_refused() -> None:
    with pytest.raises(targets.TargetRefused):
        await targets.resolve(targets.check_url("https://localhost/x", allow_http=False), [])


@given(st.text(max_size=300))
def test_any_text_as_a_url_is_split_or_refused_never_raised_otherwise(url: str) -> None:
    with contextlib.suppress(targets.TargetRefused):
        targets.check_url(url, allow_http=True)


def test_settings_name_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="at least 32"):
        WebhookSettings(signing_key="short")
    with pytest.raises(ValueError, match="allow_networks"):
        WebhookSettings(allow_networks=["10.0.0.0/33"])
    with pytest.raises(ValueError, match="retry_s"):
        WebhookSettings(retry_s=[0])
