"""Enqueued-token quotas, the pure parts: the estimate, the settings, what intake classification
records for a batch (its tokens and its tenant's limit), and a file batch's estimate from its size."""

from __future__ import annotations

import time
from typing import cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmbatch.dispatcher.domain.quota import BYTES_PER_TOKEN, estimate_file, estimate_inline
from llmbatch.dispatcher.intake.commands import Accept, IntakeRules, classify
from llmbatch.dispatcher.intake.intake_apply import IntakeApplier
from llmbatch.dispatcher.kafka.publisher import EventProducer
from llmbatch.dispatcher.metrics import Metrics
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.settings import TenantSettings
from tests.support.dispatcher_kit import MODEL, batch_request, inline_lines, origin, request_message


@given(st.integers(0, 10**12))
def test_a_files_estimate_is_its_bytes_over_four_rounded_up(size: int) -> None:
    tokens = estimate_file(size)
    assert (tokens - 1) * BYTES_PER_TOKEN < size <= tokens * BYTES_PER_TOKEN or size == tokens == 0


def test_an_inline_estimate_grows_with_its_bodies() -> None:
    short = estimate_inline(line["body"] for line in inline_lines(2))
    assert 0 < short < estimate_inline(line["body"] for line in inline_lines(4))


def test_limits_per_tenant_with_a_default_and_named_mistakes() -> None:
    limits = TenantSettings(max_enqueued_tokens={"*": 100, "acme": 5})
    assert (limits.token_limit("acme"), limits.token_limit("zeta")) == (5, 100)
    assert TenantSettings().token_limit("acme") is None
    with pytest.raises(ValueError, match="positive"):
        TenantSettings(max_enqueued_tokens={"acme": 0})
    with pytest.raises(ValueError, match="tenant"):
        TenantSettings(max_enqueued_tokens={"Not A Tenant": 5})


def _rules(**limits: int) -> IntakeRules:
    return IntakeRules("req", "req.dlt", "g", frozenset({MODEL}), token_limits=limits)


def test_classification_records_the_inline_estimate_and_the_tenants_limit() -> None:
    lines = inline_lines(3)
    request = batch_request("b1", tenant="acme", requests=lines)
    command = classify(origin(*request_message(request)), _rules(acme=50, **{"*": 7}), time.time())
    assert isinstance(command, Accept)
    assert command.item.tokens == estimate_inline(line["body"] for line in lines)
    assert command.item.token_limit == 50
    other = classify(
        origin(*request_message(batch_request("b2", tenant="zeta"))), _rules(acme=50), time.time()
    )
    assert isinstance(other, Accept) and other.item.token_limit is None


async def test_a_file_batch_under_a_limit_is_estimated_from_its_size() -> None:
    asked: list[str] = []

    async def size_of(uri: str) -> int | None:
        asked.append(uri)
        return 4001

    applier = IntakeApplier(
        cast(StateStore, None),  # the estimate reads neither the store nor the producer
        cast(EventProducer, None),
        Metrics(),
        results_topic="r",
        source="s",
        clock=time.time,
        crash=lambda p: None,
        rules=_rules(acme=10),
        size_of=size_of,
    )
    file_batch = batch_request("f1", tenant="acme", input_uri="s3://inputs/acme/f.jsonl")
    command = classify(origin(*request_message(file_batch)), _rules(acme=10), time.time())
    assert isinstance(command, Accept) and command.item.tokens == 0
    estimated = await applier._estimated(command)
    assert estimated.item.tokens == 1001 and asked == ["s3://inputs/acme/f.jsonl"]
    unlimited = classify(
        origin(*request_message(batch_request("f2", tenant="zeta", input_uri="s3://inputs/zeta/f.jsonl"))),
        _rules(acme=10),
        time.time(),
    )
    assert isinstance(unlimited, Accept)
    assert (await applier._estimated(unlimited)).item.tokens == 0 and len(
        asked
    ) == 1  # no HEAD without a limit
