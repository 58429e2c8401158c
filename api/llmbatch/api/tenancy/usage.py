"""``GET /v1/usage``: the calling tenant's usage over a time range, one bucket per UTC day, from the
dispatcher's durable usage record (:mod:`llmbatch.dispatcher.domain.usage`), and the bytes it stores
now. Buckets are shaped like OpenAI's usage API's (``object: bucket``, ``start_time``, ``end_time``,
``results``); a result is one model and end state (``input_tokens``, ``output_tokens``, ...)."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta
from typing import Any, Literal, Protocol

from fastapi import FastAPI
from pydantic import BaseModel

from llmbatch.api.errors import InvalidRequest, from_exception
from llmbatch.api.store.storage import ObjectStore
from llmbatch.api.tenancy.caller import Tenant
from llmbatch.dispatcher.domain.keys import Keys
from llmbatch.dispatcher.domain.usage import MAX_DAYS, DayUsage, UsageRow
from llmbatch.dispatcher.ops import usage


class UsageSource(Protocol):
    async def tenant_usage(self, tenant: str, first: date, last: date) -> list[DayUsage]: ...


class RedisUsage:
    """:class:`UsageSource` over the dispatcher's Redis (the operator's ACL user reads it)."""

    def __init__(self, client: Any, keys: Keys) -> None:
        self.client = client
        self.keys = keys

    async def tenant_usage(self, tenant: str, first: date, last: date) -> list[DayUsage]:
        return await usage.tenant_usage(self.client, self.keys, tenant, first, last)


class UsageResult(BaseModel):
    object: Literal["llmbatch.usage.result"] = "llmbatch.usage.result"
    model: str
    status: str
    batches: int
    requests: int
    completed_requests: int
    failed_requests: int
    input_tokens: int
    output_tokens: int

    @classmethod
    def of(cls, row: UsageRow) -> UsageResult:
        return cls(
            model=row.model,
            status=row.status,
            batches=row.batches,
            requests=row.requests,
            completed_requests=row.completed,
            failed_requests=row.failed,
            input_tokens=row.prompt_tokens,
            output_tokens=row.completion_tokens,
        )


class UsageBucket(BaseModel):
    object: Literal["bucket"] = "bucket"
    start_time: int
    end_time: int
    results: list[UsageResult]


class UsagePage(BaseModel):
    object: Literal["page"] = "page"
    data: list[UsageBucket]
    has_more: bool = False
    stored_bytes: int


class UsageService:
    def __init__(
        self,
        source: UsageSource | None,
        objects: ObjectStore,
        buckets: tuple[str, ...],
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.source = source
        self.objects = objects
        self.buckets = buckets
        self.clock = clock

    async def report(self, tenant: str, start_time: int, end_time: int | None) -> UsagePage:
        end = int(self.clock()) if end_time is None else end_time
        if not 0 <= start_time < end:
            raise InvalidRequest(
                "start_time must be a unix time (seconds) before end_time (default: now)", param="start_time"
            )
        first = datetime.fromtimestamp(start_time, UTC).date()
        last = datetime.fromtimestamp(end - 1, UTC).date()
        if (last - first).days + 1 > MAX_DAYS:
            raise InvalidRequest(
                f"a report covers at most {MAX_DAYS} days; ask for a shorter range", param="end_time"
            )
        try:
            days = await self.source.tenant_usage(tenant, first, last) if self.source is not None else []
            stored = 0
            for bucket in self.buckets:
                stored += await self.objects.total_size(bucket, f"{tenant}/")
        except Exception as exc:
            raise from_exception(exc) from exc
        return UsagePage(data=[_bucket(d) for d in days], stored_bytes=stored)


def _bucket(day: DayUsage) -> UsageBucket:
    start = day.start
    return UsageBucket(
        start_time=int(start.timestamp()),
        end_time=int((start + timedelta(days=1)).timestamp()),
        results=[UsageResult.of(r) for r in day.rows],
    )


def add_routes(app: FastAPI, service: UsageService) -> None:
    @app.get("/v1/usage")
    async def get_usage(who: Tenant, start_time: int, end_time: int | None = None) -> UsagePage:
        return await service.report(who, start_time, end_time)
