"""Retention's pure rules: the index's members read back exactly and nothing else reads as one (fuzzed),
the settings refuse what cannot be meant, and a request's ``output_expires_after`` is OpenAI's."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from llmbatch.dispatcher.domain.retention import (
    Expiring,
    batch_member,
    file_member,
    parse_member,
    retention_s,
)
from llmbatch.schemas import SchemaError, parse_batch_request
from llmbatch.schemas.common import ExpiresAfter
from llmbatch.settings.retention import RetentionSettings
from tests.support.dispatcher_kit import batch_request

TENANTS = st.from_regex(r"[a-z0-9](?:[a-z0-9-]{0,10}[a-z0-9])?", fullmatch=True)
BATCH_IDS = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True)
LIFECYCLES = st.one_of(st.just(""), st.from_regex(r"[0-9a-f]{10}", fullmatch=True))


@given(TENANTS, BATCH_IDS, LIFECYCLES)
def test_a_batch_member_reads_back_as_itself(tenant: str, batch_id: str, lifecycle: str) -> None:
    member = batch_member(tenant, batch_id, lifecycle)
    assert parse_member(member) == Expiring("batch", tenant, batch_id, lifecycle)
    assert Expiring("batch", tenant, batch_id, lifecycle).member == member


@given(TENANTS, st.from_regex(r"file-[0-9]{13}[0-9a-f]{16}", fullmatch=True))
def test_a_file_member_reads_back_as_itself(tenant: str, file_id: str) -> None:
    assert parse_member(file_member(tenant, file_id)) == Expiring("file", tenant, file_id)


@given(st.text(max_size=300))
def test_no_other_text_reads_as_a_member_and_none_raises(text: str) -> None:
    item = parse_member(text)
    assert item is None or item.member == text


@pytest.mark.parametrize(
    "member",
    [
        "b|acme|x|",  # fine: a batch of before lifecycles
    ],
)
def test_members_of_batches_of_before_lifecycles_are_read(member: str) -> None:
    assert parse_member(member) == Expiring("batch", "acme", "x", "")


@pytest.mark.parametrize(
    "member",
    ["b|Acme|x|", "b|acme|x|0123456789a", "b|acme|../x|", "f|acme|file-1", "x|acme|y|", "b|acme|x|\n", ""],
)
def test_hostile_members_are_refused(member: str) -> None:
    assert parse_member(member) is None


def test_the_request_wins_then_the_tenant_then_the_default() -> None:
    settings = RetentionSettings(default_s=7200, by_tenant={"acme": 0, "globex": 86_400})
    asked = ExpiresAfter(anchor="created_at", seconds=3600)
    assert retention_s(settings, "acme", asked) == 3600
    assert retention_s(settings, "acme", None) == 0
    assert retention_s(settings, "globex", None) == 86_400
    assert retention_s(settings, "initech", None) == 7200


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"default_s": 60}, "default_s"),
        ({"by_tenant": {"acme": 10}}, "acme"),
        ({"by_tenant": {"Not A Tenant": 3600}}, "tenant"),
        ({"forget_after_s": 1}, "forget_after_s"),
        ({"collect_every_s": -1}, "collect_every_s"),
    ],
)
def test_settings_refuse_what_cannot_be_meant(values: dict[str, object], named: str) -> None:
    with pytest.raises(ValidationError) as caught:
        RetentionSettings.model_validate(values)
    assert named in str(caught.value)


@pytest.mark.parametrize(
    "value",
    [
        {"anchor": "created_at", "seconds": 3599},
        {"anchor": "created_at", "seconds": 2_592_001},
        {"anchor": "created_at", "seconds": "3600"},
        {"anchor": "last_active_at", "seconds": 3600},
        {"anchor": "created_at"},
        {"anchor": "created_at", "seconds": 3600, "extra": 1},
    ],
)
def test_a_kafka_request_with_a_bad_output_expiry_is_refused_naming_the_field(value: object) -> None:
    data = batch_request().model_dump(mode="json")
    data["output_expires_after"] = value
    with pytest.raises(SchemaError) as caught:
        parse_batch_request(data)
    assert (caught.value.field or "").startswith("output_expires_after")


def test_a_kafka_request_may_ask_openais_output_expiry() -> None:
    data = batch_request().model_dump(mode="json")
    data["output_expires_after"] = {"anchor": "created_at", "seconds": 3600}
    assert parse_batch_request(data).output_expires_after == ExpiresAfter(anchor="created_at", seconds=3600)
