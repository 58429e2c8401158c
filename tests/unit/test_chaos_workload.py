"""The chaos workload (llmbatch.chaos.workload): what it sends, and that the dispatcher's own intake
rules treat every record as the verdict expects (accepted, or dead-lettered/answered)."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime

import pytest

from llmbatch.chaos.verdict import Kind
from llmbatch.chaos.workload import MALFORMED_KINDS, workload
from llmbatch.dispatcher.domain.dlt import OriginalRecord
from llmbatch.dispatcher.intake.commands import Accept, Cancel, IntakeRules, Reject, classify
from llmbatch.schemas.batch import InlineLimits
from tests.support.dispatcher_kit import MODEL

pytestmark = pytest.mark.unit
NOW = datetime(2026, 11, 24, tzinfo=UTC)
RULES = IntakeRules(
    requests_topic="req",
    dlt_topic="req.dlt",
    group_id="g",
    served_models=frozenset({MODEL}),
    inline_limits=InlineLimits(),
    readable_buckets=frozenset({"llmbatch-input"}),
)


def records() -> list:  # type: ignore[type-arg]
    return workload(batches=60, malformed=len(MALFORMED_KINDS) * 2, model=MODEL, now=NOW, run="r1", seed=7)


def test_the_workload_is_what_the_issue_asks_and_seeded() -> None:
    out = records()
    kinds = Counter(r.sent.kind for r in out)
    assert kinds == {Kind.BATCH: 60, Kind.DUPLICATE: 20, Kind.CANCEL: 6, Kind.MALFORMED: 24}
    batches = [r for r in out if r.sent.kind is Kind.BATCH]
    assert len({r.sent.batch_id for r in batches}) == 60  # unique ids
    assert all(1 <= len(r.sent.custom_ids) <= 50 for r in batches)
    assert sum(1 for r in batches if r.upload) == 30  # half are files, half inline
    assert workload(batches=60, malformed=24, model=MODEL, now=NOW, run="r1", seed=7) == out
    first = {r.sent.batch_id: i for i, r in enumerate(out) if r.sent.kind is Kind.BATCH}
    for i, r in enumerate(out):  # a cancel or a duplicate always comes after its batch
        if r.sent.kind in (Kind.CANCEL, Kind.DUPLICATE):
            assert i > first[r.sent.batch_id]


def test_the_dispatchers_intake_rules_agree_with_the_expectations() -> None:
    for r in records():
        origin = OriginalRecord("req", 0, 0, r.key, r.value, r.headers)
        command = classify(origin, RULES, NOW.timestamp())
        if r.sent.kind is Kind.MALFORMED:
            assert isinstance(command, Reject), r.sent.mark
            assert command.dead_letter is not None
        elif r.sent.kind is Kind.CANCEL:
            assert isinstance(command, Cancel)
        else:
            assert isinstance(command, Accept), (r.sent, command)
