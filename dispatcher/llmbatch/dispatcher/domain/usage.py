"""Usage per tenant: what the durable record holds and how it reads back. Pure.

When a batch's terminal event is published, its usage is added to its tenant's hash of the UTC day it
ended (``<p>:usage:<tenant>:<yyyymmdd>``, :mod:`llmbatch.dispatcher.state.lua` ``mark_published``), once
per lifecycle, under the fields ``<model>|<state>|<counter>`` (:data:`COUNTERS`). A usage report sums
those hashes over a range of days (:func:`report`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta

COUNTERS = ("batches", "requests", "completed", "failed", "prompt_tokens", "completion_tokens")
OTHER_TENANTS = "other"
"""The metrics' tenant label of a tenant outside the configured set (labels stay bounded)."""
MAX_DAYS = 400
"""The longest range a report reads (and how long a usage hash is kept)."""


def usage_day(at: float) -> str:
    """The day (UTC, ``yyyymmdd``) of unix time ``at``."""
    return datetime.fromtimestamp(at, UTC).strftime("%Y%m%d")


def days(first: date, last: date) -> list[str]:
    """Every day from ``first`` to ``last`` included, as :func:`usage_day` writes them."""
    return [(first + timedelta(days=n)).strftime("%Y%m%d") for n in range((last - first).days + 1)]


@dataclass(frozen=True, slots=True)
class UsageRow:
    """One model and end state of one day (or of a whole range)."""

    model: str
    status: str
    batches: int = 0
    requests: int = 0
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True, slots=True)
class DayUsage:
    day: str  # yyyymmdd
    rows: list[UsageRow] = field(default_factory=list)

    @property
    def start(self) -> datetime:
        return datetime.strptime(self.day, "%Y%m%d").replace(tzinfo=UTC)


def rows_of(fields: Mapping[str, str]) -> list[UsageRow]:
    """The rows of one usage hash (a field that does not parse is left out), by model then status."""
    sums: dict[tuple[str, str], dict[str, int]] = {}
    for name, value in fields.items():
        model, sep1, rest = name.partition("|")
        status, sep2, counter = rest.partition("|")
        if not (sep1 and sep2) or counter not in COUNTERS:
            continue
        try:
            amount = int(value)
        except ValueError:
            continue
        sums.setdefault((model, status), dict.fromkeys(COUNTERS, 0))[counter] += amount
    return [UsageRow(model, status, **c) for (model, status), c in sorted(sums.items())]


def report(hashes: Iterable[tuple[str, Mapping[str, str]]]) -> list[DayUsage]:
    """``(day, usage hash)`` pairs as days with their rows (days without usage left out)."""
    return [DayUsage(day, rows) for day, fields in hashes if (rows := rows_of(fields))]


def totals(days_: Iterable[DayUsage]) -> list[UsageRow]:
    """The rows of several days summed by model and status."""
    sums: dict[tuple[str, str], dict[str, int]] = {}
    for day in days_:
        for row in day.rows:
            into = sums.setdefault((row.model, row.status), dict.fromkeys(COUNTERS, 0))
            for counter in COUNTERS:
                into[counter] += getattr(row, counter)
    return [UsageRow(model, status, **c) for (model, status), c in sorted(sums.items())]


def metric_tenant(tenant: str, known: frozenset[str]) -> str:
    """The tenant label of the usage metrics: the tenant when configured, else :data:`OTHER_TENANTS`."""
    return tenant if tenant in known else OTHER_TENANTS
