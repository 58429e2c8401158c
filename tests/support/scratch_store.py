"""A StateStore on the test Redis under a key prefix of its own, emptied when the test ends."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

from llmbatch.dispatcher.domain.keys import Keys
from llmbatch.dispatcher.state.store import StateStore


@contextlib.asynccontextmanager
async def scratch_store(redis_url: str, **kwargs: Any) -> AsyncIterator[StateStore]:
    """``StateStore.from_url(redis_url, **kwargs)`` with a fresh prefix; its keys are deleted after."""
    store = StateStore.from_url(redis_url, keys=Keys(f"t{uuid.uuid4().hex[:8]}"), **kwargs)
    try:
        yield store
    finally:
        keys = [k async for k in store.client.scan_iter(match=f"{store.keys.prefix}:*")]
        if keys:
            await store.client.delete(*keys)
        await store.close()
