"""Batch keys: batch ids scoped by tenant (dispatcher.keys)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmbatch.dispatcher.domain.batch_record import BatchRecord
from llmbatch.dispatcher.domain.keys import DEFAULT_TENANT, Keys, batch_key, split_batch_key
from llmbatch.dispatcher.domain.states import State
from llmbatch.schemas.common import BATCH_ID_PATTERN, TENANT_PATTERN

pytestmark = pytest.mark.unit

tenants = st.from_regex(TENANT_PATTERN, fullmatch=True)
batch_ids = st.from_regex(BATCH_ID_PATTERN, fullmatch=True)


def test_the_default_tenants_key_is_the_bare_id_and_another_tenants_is_prefixed() -> None:
    assert batch_key("default", "b-1") == "b-1" and batch_key(None, "b-1") == "b-1"
    assert batch_key("acme", "b-1") == "acme/b-1"
    keys = Keys("p")
    assert keys.batch(batch_key("acme", "b-1")) == "p:batch:acme/b-1"
    assert keys.progress(batch_key("acme", "b-1")) == "p:progress:acme/b-1"
    assert keys.batch(batch_key("acme", "b-1")) != keys.batch(batch_key("globex", "b-1"))


@given(tenants, batch_ids, tenants, batch_ids)
def test_keys_round_trip_and_never_collide(t1: str, b1: str, t2: str, b2: str) -> None:
    assert split_batch_key(batch_key(t1, b1)) == (t1, b1)
    assert (batch_key(t1, b1) == batch_key(t2, b2)) == ((t1, b1) == (t2, b2))


def test_a_record_reads_its_id_and_tenant_from_its_fields_else_from_its_key() -> None:
    record = BatchRecord(batch_key("acme", "b-1"), State.QUEUED, 1, {})
    assert (record.batch_id, record.tenant) == ("b-1", "acme")
    assert BatchRecord(batch_key(None, "b-2"), State.QUEUED, 1, {}).tenant == DEFAULT_TENANT
    stored = BatchRecord(batch_key("acme", "b-1"), State.QUEUED, 1, {"batch_id": "b-1", "tenant": "acme"})
    assert (stored.batch_id, stored.tenant) == ("b-1", "acme")
