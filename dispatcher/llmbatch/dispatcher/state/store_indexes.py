"""Reads of the state store's indexes: batches per state, the ready queue, deadlines and terminal
events not yet published (sorted sets; see :mod:`llmbatch.dispatcher.domain.keys`). Mixed into
:class:`llmbatch.dispatcher.state.store.StateStore`, whose client, keys and error translation (``_call``) it
uses."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from llmbatch.dispatcher.domain import states
from llmbatch.dispatcher.domain.keys import BatchKey
from llmbatch.dispatcher.domain.states import State

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from llmbatch.dispatcher.domain.keys import Keys

T = TypeVar("T")


def reply_text(value: Any) -> str:
    """One Redis reply item as str (bytes decoded; the store's client mostly decodes already)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _key(raw: Any) -> BatchKey:
    return BatchKey(reply_text(raw))


class StoreIndexes:
    """Index reads of the Redis state store (see the module docstring)."""

    client: aioredis.Redis
    keys: Keys
    clock: Callable[[], float]

    async def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
        raise NotImplementedError  # StateStore's: Redis errors translated at the boundary

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
