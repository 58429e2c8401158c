"""The usage record's pure parts: a day's hash read into rows (whatever else Redis holds there), sums
over days, the days of a range, the bounded tenant label."""

from __future__ import annotations

from datetime import date

from hypothesis import given
from hypothesis import strategies as st

from llmbatch.dispatcher.domain.usage import (
    COUNTERS,
    OTHER_TENANTS,
    DayUsage,
    UsageRow,
    days,
    metric_tenant,
    report,
    rows_of,
    totals,
    usage_day,
)


def test_a_hash_reads_into_rows_by_model_and_status() -> None:
    fields = {
        "m1|completed|batches": "2",
        "m1|completed|prompt_tokens": "300",
        "m1|failed|batches": "1",
        "m2|completed|completion_tokens": "7",
    }
    assert rows_of(fields) == [
        UsageRow("m1", "completed", batches=2, prompt_tokens=300),
        UsageRow("m1", "failed", batches=1),
        UsageRow("m2", "completed", completion_tokens=7),
    ]


def test_fields_that_do_not_parse_are_left_out() -> None:
    fields = {"nobars": "1", "m|completed|unknown": "5", "m|completed|batches": "x", "m|failed|failed": "3"}
    assert rows_of(fields) == [UsageRow("m", "failed", failed=3)]


row = st.builds(
    UsageRow,
    model=st.sampled_from(["a", "b/c"]),
    status=st.sampled_from(["completed", "failed"]),
    **{c: st.integers(0, 10**12) for c in COUNTERS},
)


@given(st.lists(st.lists(row, max_size=4), max_size=5))
def test_totals_are_the_sums_of_every_days_rows(per_day: list[list[UsageRow]]) -> None:
    summed = totals(DayUsage(f"2026120{n}", rows) for n, rows in enumerate(per_day))
    for counter in COUNTERS:
        assert sum(getattr(r, counter) for r in summed) == sum(
            getattr(r, counter) for rows in per_day for r in rows
        )
    assert len({(r.model, r.status) for r in summed}) == len(summed)


@given(st.dictionaries(st.text(max_size=30), st.text(max_size=8), max_size=20))
def test_any_hash_reads_without_raising(fields: dict[str, str]) -> None:
    for r in rows_of(fields):
        assert r.model is not None


def test_days_and_report() -> None:
    assert days(date(2026, 12, 30), date(2027, 1, 2)) == ["20261230", "20261231", "20270101", "20270102"]
    assert usage_day(1_796_515_200.0) == "20261206"
    got = report([("20261201", {}), ("20261202", {"m|completed|batches": "1"})])
    assert [d.day for d in got] == ["20261202"]
    assert got[0].start.isoformat() == "2026-12-02T00:00:00+00:00"


def test_tenants_outside_the_configured_set_share_one_label() -> None:
    known = frozenset({"default", "acme"})
    assert [metric_tenant(t, known) for t in ("acme", "default", "zeta")] == [
        "acme",
        "default",
        OTHER_TENANTS,
    ]
