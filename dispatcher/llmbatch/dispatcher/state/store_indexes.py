"""Reads of the state store's indexes: batches per state, the ready queue, deadlines and terminal
events not yet published (sorted sets; see :mod:`llmbatch.dispatcher.domain.keys`). Mixed into
:class:`llmbatch.dispatcher.state.store.StateStore`, whose client, keys and error translation (``_call``) it
uses."""

from __future__ import annotations

from collections import Counter
from typing import Any

from llmbatch.dispatcher.domain import states
from llmbatch.dispatcher.domain.keys import BatchKey, split_batch_key
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.state.store_host import StoreHost


def reply_text(value: Any) -> str:
    """One Redis reply item as str (bytes decoded, bytes that are not UTF-8 replaced: whatever Redis
    holds reads back as text the caller can check and refuse; the store's client mostly decodes
    already)."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _key(raw: Any) -> BatchKey:
    return BatchKey(reply_text(raw))


class StoreIndexes(StoreHost):
    """Index reads of the Redis state store (see the module docstring)."""

    async def listed(
        self, tenant: str, *, after: tuple[int, str | None] | None, limit: int
    ) -> list[tuple[str, int]]:
        """Up to ``limit`` of ``tenant``'s listed batches (see :meth:`Keys.tenant_batches`) as
        ``(batch_id, accepted unix ms)``, newest first, ids descending within a millisecond. ``after``:
        ``(ms, batch_id)`` to go on after that listed batch, ``(ms, None)`` after everything of later
        milliseconds (every batch of ``ms`` follows)."""
        key = self.keys.tenant_batches(tenant)

        async def newest(top: str | int, num: int) -> list[tuple[str, int]]:
            raw: Any = await self.client.zrange(
                key, top, "-inf", desc=True, byscore=True, offset=0, num=num, withscores=True
            )
            return [(reply_text(m), int(s)) for m, s in raw]

        async def run() -> list[tuple[str, int]]:
            if after is None:
                return await newest("+inf", limit)
            ms, last = after
            if last is None:  # every batch of ms and older
                return await newest(ms, limit)
            # the rest of the cursor's millisecond (one intake's batches at most), then the older ones
            same = [reply_text(m) for m in await self.client.zrange(key, ms, ms, byscore=True)]
            found = [(m, ms) for m in sorted((m for m in same if m < last), reverse=True)[:limit]]
            if len(found) < limit:
                found += await newest(f"({ms}", limit - len(found))
            return found

        return await self._call(run)

    async def listed_at(self, tenant: str, batch_id: str) -> int | None:
        """When ``tenant``'s listed batch ``batch_id`` was accepted (unix ms), None if it is not listed."""
        score = await self._call(lambda: self.client.zscore(self.keys.tenant_batches(tenant), batch_id))
        return None if score is None else int(score)

    async def enqueued_tokens(self, tenant: str) -> int:
        """The tokens (estimated) ``tenant``'s accepted, not yet ended batches hold (0 if unreadable)."""
        raw = await self._call(lambda: self.client.get(self.keys.quota_tokens(tenant)))
        try:
            return max(0, int(raw or 0))
        except ValueError:
            return 0

    async def ids_in_state(self, state: State, limit: int = 1000, offset: int = 0) -> list[BatchKey]:
        key = self.keys.state_index(state)
        raw = await self._call(lambda: self.client.zrange(key, offset, offset + limit - 1))
        return [_key(x) for x in raw]

    async def count(self, state: State) -> int:
        return int(await self._call(lambda: self.client.zcard(self.keys.state_index(state))))

    async def counts(self) -> dict[State, int]:
        async def run() -> list[Any]:
            async with self.client.pipeline(transaction=False) as pipe:
                for state in State:
                    pipe.zcard(self.keys.state_index(state))
                return list(await pipe.execute())

        return dict(zip(State, (int(x) for x in await self._call(run)), strict=True))

    async def in_flight_count(self) -> int:
        async def run() -> list[Any]:
            async with self.client.pipeline(transaction=False) as pipe:
                for state in sorted(states.IN_FLIGHT):
                    pipe.zcard(self.keys.state_index(state))
                return list(await pipe.execute())

        return sum(int(x) for x in await self._call(run))

    async def in_flight_tenants(self) -> Counter[str]:
        """Batches in flight by tenant (read from their keys: ``<tenant>/<id>``, the default tenant's
        bare)."""

        async def run() -> list[Any]:
            async with self.client.pipeline(transaction=False) as pipe:
                for state in sorted(states.IN_FLIGHT):
                    pipe.zrange(self.keys.state_index(state), 0, -1)
                return list(await pipe.execute())

        return Counter(split_batch_key(reply_text(k))[0] for ids in await self._call(run) for k in ids)

    async def queued_count(self) -> int:
        """Queued batches (ready now or waiting for a retry backoff)."""
        return await self.count(State.QUEUED)

    async def ready_ids(self, limit: int) -> list[BatchKey]:
        """Queued batches that may launch now, in launch order."""
        if limit <= 0:
            return []
        raw = await self._call(lambda: self.client.zrange(self.keys.ready, 0, limit - 1))
        return [_key(x) for x in raw]

    async def due_deadlines(self, now: float, limit: int = 100) -> list[BatchKey]:
        key = self.keys.deadlines
        raw = await self._call(lambda: self.client.zrangebyscore(key, "-inf", now, start=0, num=limit))
        return [_key(x) for x in raw]

    async def due_now(self, batch: BatchKey, now: float) -> None:
        """Put a queued batch at the head of the deadline index, so the tracker's next tick finishes
        it (a cancelled retry waiting in the queue) instead of when its turn comes."""
        key = self.keys.deadlines
        await self._call(lambda: self.client.zadd(key, {batch: now}))

    async def unpublished_ids(self, limit: int = 100) -> list[BatchKey]:
        key = self.keys.unpublished
        return [_key(x) for x in await self._call(lambda: self.client.zrange(key, 0, limit - 1))]

    async def requeue_unpublished(self, batch: BatchKey) -> None:
        """Move a batch whose terminal event could not go out to the back of the unpublished index
        (only if it is still there), so the ones behind it go first."""
        key, now = self.keys.unpublished, self.clock()
        await self._call(lambda: self.client.zadd(key, {batch: now}, xx=True))
