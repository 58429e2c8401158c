"""Reading the usage record (:mod:`llmbatch.dispatcher.domain.usage`) from Redis: what ``llmbatch usage``
and the HTTP API's ``GET /v1/usage`` report. Read only (the operator's ACL user is enough)."""

from __future__ import annotations

import re
from datetime import date
from typing import Any

from llmbatch.dispatcher.domain.keys import Keys
from llmbatch.dispatcher.domain.usage import MAX_DAYS, DayUsage, days, report
from llmbatch.dispatcher.errors import StateStoreUnavailable, classify
from llmbatch.dispatcher.state.store_indexes import reply_text
from llmbatch.schemas.common import TENANT_PATTERN


def check_range(first: date, last: date) -> None:
    """ValueError naming the fix unless ``first`` <= ``last`` and the range is at most :data:`MAX_DAYS`."""
    if last < first:
        raise ValueError(f"the range ends ({last}) before it starts ({first})")
    if (last - first).days + 1 > MAX_DAYS:
        raise ValueError(f"a report covers at most {MAX_DAYS} days; ask for a shorter range")


async def tenant_usage(client: Any, keys: Keys, tenant: str, first: date, last: date) -> list[DayUsage]:
    """``tenant``'s usage of each day from ``first`` to ``last`` (UTC, both included) that has any."""
    check_range(first, last)
    wanted = days(first, last)
    try:
        async with client.pipeline(transaction=False) as pipe:
            for day in wanted:
                pipe.hgetall(keys.usage(tenant, day))
            hashes = await pipe.execute()
    except Exception as exc:
        raise classify(exc, default=StateStoreUnavailable) from exc
    return report(
        (day, {reply_text(k): reply_text(v) for k, v in h.items()})
        for day, h in zip(wanted, hashes, strict=True)
    )


async def tenants(client: Any, keys: Keys) -> list[str]:
    """Every tenant with usage recorded (names that are not tenant names are left out)."""
    try:
        raw = await client.smembers(keys.usage_tenants)
    except Exception as exc:
        raise classify(exc, default=StateStoreUnavailable) from exc
    return sorted(t for t in (reply_text(m) for m in raw) if re.fullmatch(TENANT_PATTERN, t))
