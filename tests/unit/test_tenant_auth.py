"""Signed tenant claims (schemas.tenant_auth) and the dispatcher's intake check of them."""

from __future__ import annotations

from dataclasses import replace
from typing import TypedDict

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel

from llmbatch.dispatcher.intake.commands import Accept, Cancel, Reject, classify
from llmbatch.schemas import dlt as dlt_headers
from llmbatch.schemas.batch import CancelRequest
from llmbatch.schemas.cloudevents import Envelope, encode
from llmbatch.schemas.errors import Reason
from llmbatch.schemas.tenant_auth import TENANT_SIG, TenantSigner, tenant_signature, verify_tenant_signature
from llmbatch.settings import LLMBatchSettings, TenantSettings
from tests.support.dispatcher_kit import SOURCE, batch_request, origin
from tests.unit.test_dispatcher_intake import NOW, RULES

pytestmark = pytest.mark.unit

ACME, GLOBEX = b"a" * 32, b"g" * 32
KEYS = {"acme": ACME, "globex": GLOBEX}
Record = tuple[bytes, bytes, list[tuple[str, bytes]]]


def _signed(data: BaseModel, signer: TenantSigner, *, event_id: str = "e-1") -> Record:
    envelope = Envelope.new(data, source=SOURCE, id=event_id)
    key, value, headers = encode(envelope)
    header = signer.sign(envelope, value)
    return key, value, headers if header is None else [*headers, header]


def _sig(headers: list[tuple[str, bytes]]) -> str:
    return dict(headers)[TENANT_SIG].decode()


class Signed(TypedDict):
    """What a tenant signature covers of an event."""

    event_type: str
    source: str
    event_id: str
    tenant: str
    value: bytes


SIGNED: Signed = {
    "event_type": "llmbatch.batch.requested.v1",
    "source": "urn:s",
    "event_id": "e-1",
    "tenant": "acme",
    "value": b'{"batch_id":"b"}',
}


def test_a_signature_verifies_only_for_the_same_key_event_tenant_and_value() -> None:
    sig = tenant_signature(ACME, **SIGNED)
    assert verify_tenant_signature(ACME, sig, **SIGNED)
    assert not verify_tenant_signature(GLOBEX, sig, **SIGNED)
    others: list[Signed] = [
        {**SIGNED, "event_type": "llmbatch.batch.cancel_requested.v1"},
        {**SIGNED, "source": "urn:t"},
        {**SIGNED, "event_id": "e-2"},
        {**SIGNED, "tenant": "globex"},
        {**SIGNED, "value": b'{"batch_id":"c"}'},
    ]
    for other in others:
        assert not verify_tenant_signature(ACME, sig, **other), other
    assert not verify_tenant_signature(ACME, None, **SIGNED)


@given(st.text(max_size=100))
def test_any_signature_text_is_only_true_or_false(signature: str) -> None:
    assert verify_tenant_signature(ACME, signature, **SIGNED) is False


def test_a_signer_signs_only_the_tenants_it_has_keys_for() -> None:
    signer = TenantSigner({"acme": ACME})
    _, _, headers = _signed(batch_request("b", tenant="acme"), signer)
    assert TENANT_SIG in dict(headers)
    _, _, headers = _signed(batch_request("b", tenant="globex"), signer)
    assert TENANT_SIG not in dict(headers)
    assert not TenantSigner({}) and signer


def test_with_tenant_keys_a_request_signed_by_its_tenant_is_accepted() -> None:
    rules = replace(RULES, tenant_keys=KEYS, inputs_under_tenant_prefix=False)
    command = classify(origin(*_signed(batch_request("b", tenant="acme"), TenantSigner(KEYS))), rules, NOW)
    assert isinstance(command, Accept) and command.request.tenant == "acme"
    cancel = classify(
        origin(*_signed(CancelRequest(batch_id="b", tenant="acme"), TenantSigner(KEYS))), rules, NOW
    )
    assert isinstance(cancel, Cancel) and cancel.request.tenant == "acme"


def _forgeries() -> list[tuple[str, Record, str]]:
    """(what, record, what the error says) for requests a producer without acme's key could send."""
    globex_only = TenantSigner({"globex": GLOBEX})
    acme = TenantSigner({"acme": ACME})
    key, value, headers = _signed(batch_request("b", tenant="acme"), acme)
    other_value = _signed(batch_request("b", tenant="acme", metadata={"x": "1"}), acme)[1]
    copied = _sig(_signed(batch_request("b", tenant="acme"), acme, event_id="e-2")[2])
    no_sig = [(k, v) for k, v in headers if k != TENANT_SIG]
    return [
        ("unsigned", (key, value, no_sig), "is not signed"),
        (
            "signed with another tenant's key",
            (
                key,
                value,
                [
                    *no_sig,
                    (TENANT_SIG, _sig(_signed(batch_request("b", tenant="globex"), globex_only)[2]).encode()),
                ],
            ),
            "does not verify",
        ),
        ("the value changed after signing", (key, other_value, headers), "does not verify"),
        (
            "a signature copied from another event",
            (key, value, [*no_sig, (TENANT_SIG, copied.encode())]),
            "does not verify",
        ),
        ("not hex", (key, value, [*no_sig, (TENANT_SIG, b"\xff" * 64)]), "does not verify"),
        ("a tenant without a key", _signed(batch_request("b", tenant="initech"), acme), "has no key"),
        (
            "an unsigned cancel",
            _signed(CancelRequest(batch_id="b", tenant="acme"), TenantSigner({})),
            "is not signed",
        ),
    ]


@pytest.mark.parametrize(("what", "record", "says"), _forgeries(), ids=[f[0] for f in _forgeries()])
def test_with_tenant_keys_a_request_not_signed_by_its_tenant_is_dead_lettered_and_answered(
    what: str, record: Record, says: str
) -> None:
    rules = replace(RULES, tenant_keys=KEYS, inputs_under_tenant_prefix=False)
    command = classify(origin(*record), rules, NOW)
    assert isinstance(command, Reject), what
    assert command.error.field == TENANT_SIG and command.error.reason == Reason.INVALID_HEADER
    assert says in command.error.message and "LLMBATCH_TENANTS__KEYS" in command.error.message
    assert dict(command.dead_letter.headers)[dlt_headers.REASON] == b"invalid_event"
    assert command.batch_id == "b"  # a readable batch id: the consumer answers it with `rejected`


def test_without_tenant_keys_tenant_claims_are_trusted() -> None:
    record = _signed(batch_request("b", tenant="acme"), TenantSigner({}))
    rules = replace(RULES, inputs_under_tenant_prefix=False)
    assert isinstance(classify(origin(*record), rules, NOW), Accept)


def test_the_settings_read_tenant_keys_and_refuse_bad_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMBATCH_TENANTS__KEYS", '{"acme": "%s"}' % ("s" * 32))
    assert LLMBatchSettings(_env_file=None).tenants.key_bytes() == {"acme": b"s" * 32}
    with pytest.raises(ValueError, match="at least 32 characters"):
        TenantSettings.model_validate({"keys": {"acme": "short"}})
    with pytest.raises(ValueError, match="tenant 'Acme'"):
        TenantSettings.model_validate({"keys": {"Acme": "s" * 32}})
    assert "s" * 32 not in repr(TenantSettings.model_validate({"keys": {"acme": "s" * 32}}))
