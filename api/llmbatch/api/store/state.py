"""Reading what the dispatcher knows about batches, the way ``llmbatch jobs get`` does.

:class:`StateReader` is what the API needs; :class:`RedisStateReader` implements it over the
dispatcher's :class:`~llmbatch.dispatcher.state.store.StateStore` (batch hashes, plus the running job's
progress
counters for batches that have not ended), turned into :class:`~llmbatch.dispatcher.ops.jobs.JobDetail` by
the operator CLI's own pure :func:`~llmbatch.dispatcher.ops.jobs.detail_of`. It only reads: the operator's
Redis ACL user (``llmbatch dispatcher redis-acl``) is enough.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from llmbatch.dispatcher.domain.batch_record import BatchRecord
from llmbatch.dispatcher.domain.keys import BatchKey, batch_key
from llmbatch.dispatcher.ops.jobs import JobDetail, detail_of


class StateReader(Protocol):
    """The dispatcher's view of batches."""

    async def get_many(self, batches: Sequence[tuple[str, str]]) -> list[JobDetail | None]:
        """One entry per ``(tenant, batch_id)``, in order (``None``: Redis has no record of it).
        Batch ids are scoped by tenant: the tenant is part of what names a batch."""
        ...

    async def listed(
        self, tenant: str, *, after: tuple[int, str | None] | None, limit: int
    ) -> list[tuple[str, int]]:
        """Up to ``limit`` of the batches the tenant's services sent to Kafka, ``(batch_id, accepted
        unix ms)``, newest first (ids descending within a millisecond), after the cursor ``after``
        (``(ms, batch_id)``; ``(ms, None)``: every batch of ``ms`` and older)."""
        ...

    async def listed_at(self, tenant: str, batch_id: str) -> int | None:
        """When the tenant's batch ``batch_id`` sent to Kafka was accepted (unix ms); None if unlisted."""
        ...

    async def enqueued_tokens(self, tenant: str) -> int:
        """The tokens (estimated) the tenant's accepted, not yet ended batches hold."""
        ...

    async def stored_bytes(self, tenant: str) -> int | None:
        """The bytes the tenant keeps as the dispatchers last measured them (None: no measure)."""
        ...


class BatchRecords(Protocol):
    """The part of :class:`~llmbatch.dispatcher.state.store.StateStore` the reader uses."""

    async def get_many(self, batch_keys: Sequence[BatchKey]) -> list[BatchRecord | None]: ...

    async def read_progress_many(self, batch_keys: Sequence[BatchKey]) -> list[dict[str, str]]: ...

    async def listed(
        self, tenant: str, *, after: tuple[int, str | None] | None, limit: int
    ) -> list[tuple[str, int]]: ...

    async def listed_at(self, tenant: str, batch_id: str) -> int | None: ...

    async def enqueued_tokens(self, tenant: str) -> int: ...

    async def stored_bytes_many(self, tenants: Sequence[str]) -> list[int | None]: ...


class RedisStateReader:
    """:class:`StateReader` over the dispatcher's Redis (two round trips for any number of ids)."""

    def __init__(self, store: BatchRecords) -> None:
        self._store = store

    async def get_many(self, batches: Sequence[tuple[str, str]]) -> list[JobDetail | None]:
        keys = [batch_key(tenant, batch_id) for tenant, batch_id in batches]
        records = await self._store.get_many(keys) if keys else []
        live = [r.key for r in records if r is not None and not r.state.is_terminal]
        progress = dict(zip(live, await self._store.read_progress_many(live), strict=True)) if live else {}
        return [None if r is None else detail_of(r, progress.get(r.key, {})) for r in records]

    async def listed(
        self, tenant: str, *, after: tuple[int, str | None] | None, limit: int
    ) -> list[tuple[str, int]]:
        return await self._store.listed(tenant, after=after, limit=limit)

    async def listed_at(self, tenant: str, batch_id: str) -> int | None:
        return await self._store.listed_at(tenant, batch_id)

    async def enqueued_tokens(self, tenant: str) -> int:
        return await self._store.enqueued_tokens(tenant)

    async def stored_bytes(self, tenant: str) -> int | None:
        return (await self._store.stored_bytes_many([tenant]))[0]
