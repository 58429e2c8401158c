"""What the state store's parts share, declared once: the Redis client, the key names, the TTLs, the
clock, the scripts and ``_call`` (Redis errors translated at the boundary). The parts are mixed into
:class:`llmbatch.dispatcher.state.store.StateStore`, which sets them all."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from llmbatch.dispatcher.domain.keys import BatchKey, Keys
    from llmbatch.dispatcher.state.store_scripts import Scripts

T = TypeVar("T")


class StoreHost:
    """The base of the state store's parts (see the module docstring)."""

    client: aioredis.Redis
    keys: Keys
    finished_ttl_s: int
    dedupe_ttl_s: int
    clock: Callable[[], float]
    _scripts: Scripts
    _unreadable_said: set[BatchKey]

    async def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
        raise NotImplementedError  # StateStore's: Redis errors translated at the boundary
