"""The active-batch quota (``LLMBATCH_API__MAX_ACTIVE_BATCHES``): how many of a tenant's batches
created through the API may be under way at once.

Each create marks its batch active (``<tenant>/api/active/<batch_id>``,
:class:`~llmbatch.api.store.records.RecordStore`)
before counting, then counts the tenant's marked batches that have not ended; over the limit, it removes
its own mark and answers 429 ``insufficient_quota`` / ``active_batch_quota_exceeded``. Marks of batches
that ended are removed while counting, so the marks stay about as many as the batches under way. Two
creates at the same moment each see the other's mark: both may be refused, never both admitted over
the limit. A batch counts as ended when the dispatcher says so (Redis), or when the dispatcher does not
know it ``unknown_after_s`` after its create (its terminal state expired from Redis long ago, or its
event never got out: the API publishes it again when the batch is read).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from llmbatch.api.errors import QuotaExceeded
from llmbatch.api.store.records import BATCH_PREFIX, RecordStore, made_at
from llmbatch.api.store.state import StateReader

MAX_MARKS = 100_000  # marks listed per create at most (each is one key of a listing page)
_CHUNK = 500  # ids per Redis read


class ActiveBatches:
    """Admits a tenant's new batch while fewer than ``limit`` of its batches are under way."""

    def __init__(
        self,
        records: RecordStore,
        state: StateReader,
        *,
        limit: int,
        unknown_after_s: float = 600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.records = records
        self.state = state
        self.limit = limit
        self.unknown_after_s = unknown_after_s
        self.clock = clock

    async def admit(self, tenant: str, batch_id: str) -> None:
        """Mark ``batch_id`` active, or raise :class:`QuotaExceeded` (no mark left) when the tenant
        already has ``limit`` batches under way. No limit (0): nothing is marked."""
        if not self.limit:
            return
        await self.records.add_active(tenant, batch_id)
        others = [i for i in await self.records.active(tenant, limit=MAX_MARKS) if i != batch_id]
        under_way = 0
        for start in range(0, len(others), _CHUNK):
            under_way += await self._count_under_way(tenant, others[start : start + _CHUNK])
            if under_way >= self.limit:
                await self.records.drop_active(tenant, batch_id)
                raise QuotaExceeded(
                    f"tenant {tenant!r} has {self.limit} batches under way, its limit "
                    "(LLMBATCH_API__MAX_ACTIVE_BATCHES): create this batch once one has ended, or cancel one",
                    code="active_batch_quota_exceeded",
                )

    async def forget(self, tenant: str, batch_id: str) -> None:
        """Remove the mark of a batch whose create failed after :meth:`admit`."""
        if self.limit:
            await self.records.drop_active(tenant, batch_id)

    async def _count_under_way(self, tenant: str, batch_ids: list[str]) -> int:
        """How many of ``batch_ids`` are under way; the marks of the others are removed."""
        now = self.clock()
        count = 0
        jobs = await self.state.get_many([(tenant, b) for b in batch_ids])
        for batch_id, job in zip(batch_ids, jobs, strict=True):
            if job is None:
                ended = now - made_at(batch_id, BATCH_PREFIX) > self.unknown_after_s
            else:
                ended = job.state.is_terminal
            if ended:
                await self.records.drop_active(tenant, batch_id)
            else:
                count += 1
        return count
