"""One lookup for many callers: the keys asked for in the same event-loop turn go in one call.

The tracker checks every in-flight batch at once each tick (``asyncio.gather``); on the short path each
check asked the batch runner for one run's state, an HTTP request through Serve's proxy each, so the
proxy and the runner worked per batch in flight per second on the cores the engine computes on.
:class:`Coalescer` gathers the keys asked for before the loop runs its next callback and hands them to
one ``fetch`` (at most ``max_keys`` per call); each caller gets its own key's answer, or the exception
the call raised.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Coalescer(Generic[K, V]):
    """Coalesces :meth:`get` calls into ``fetch(keys)`` calls, one per loop turn and ``max_keys``.

    ``fetch`` returns an answer for each key it was given (a key it leaves out answers ``missing``)."""

    def __init__(
        self, fetch: Callable[[Sequence[K]], Awaitable[Mapping[K, V]]], *, missing: V, max_keys: int = 500
    ) -> None:
        if max_keys < 1:
            raise ValueError("max_keys must be at least 1")
        self._fetch = fetch
        self._missing = missing
        self._max_keys = max_keys
        self._waiting: dict[K, list[asyncio.Future[V]]] = {}
        self._flush_on: asyncio.AbstractEventLoop | None = None  # the loop a flush is due on
        self._tasks: set[asyncio.Task[None]] = set()  # the loop holds its tasks weakly

    async def get(self, key: K) -> V:
        """``key``'s answer from the next ``fetch`` (shared with every caller of the same turn)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[V] = loop.create_future()
        self._waiting.setdefault(key, []).append(future)
        if self._flush_on is not loop:
            self._flush_on = loop
            loop.call_soon(self._flush)  # after the callbacks already due: the rest of this turn's callers
        return await future

    def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        self._flush_on = None
        # callers of a loop that ended before its flush ran are gone with it
        waiting: dict[K, list[asyncio.Future[V]]] = {}
        for key, futures in self._waiting.items():
            if alive := [f for f in futures if f.get_loop() is loop]:
                waiting[key] = alive
        self._waiting = {}
        keys = list(waiting)
        for start in range(0, len(keys), self._max_keys):
            group = {k: waiting[k] for k in keys[start : start + self._max_keys]}
            task = loop.create_task(self._answer(group))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _answer(self, group: dict[K, list[asyncio.Future[V]]]) -> None:
        try:
            answers = await self._fetch(list(group))
        except asyncio.CancelledError:
            for futures in group.values():
                for future in futures:
                    future.cancel()
            raise
        except Exception as exc:  # every caller of the group sees the call's own error
            for futures in group.values():
                for future in futures:
                    if not future.done():
                        future.set_exception(exc)
            return
        for key, futures in group.items():
            for future in futures:
                if not future.done():  # a caller that was cancelled meanwhile
                    future.set_result(answers.get(key, self._missing))
