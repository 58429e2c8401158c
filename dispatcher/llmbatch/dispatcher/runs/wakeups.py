"""Waking the other replicas' trackers (:class:`Wakeups`): a Redis Pub/Sub channel,
``<p>:tracker:wake``.

With the tracker's work shared (:mod:`llmbatch.dispatcher.runs.leases`), what one replica does is often
for another to go on with: a batch accepted here is launched by the leader, a batch the leader launched
is tracked by its shard's holder. Each says so on the channel and every replica's tracker ticks at once,
instead of at its next poll (``poll_interval_s``). A replica alone says nothing (it wakes itself). A
lost message costs one poll interval, never a batch: Redis' state stays the truth.

The listener reconnects after an outage, logged once when it starts and once when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from llmbatch.dispatcher.state.store import StateStore

log = logging.getLogger(__name__)

RETRY_S = 2.0  # between attempts to listen again after Redis went away


class Wakeups:
    """Says "tick now" to the other replicas (:meth:`tell`) and hears it from them (:meth:`listen`)."""

    def __init__(self, store: StateStore, *, others: Callable[[], bool], wake: Callable[[], None]) -> None:
        self.store = store
        self.others = others  # whether other replicas are live (else nothing is said)
        self.wake = wake
        self.heard = 0
        self._down = False

    @property
    def channel(self) -> str:
        return self.store.keys.tracker_wake

    async def tell(self) -> None:
        """Wake every other replica's tracker (best effort: a failure costs a poll interval)."""
        if not self.others():
            return
        with contextlib.suppress(Exception):
            await self.store.client.publish(self.channel, b"1")

    async def listen(self, stopping: asyncio.Event) -> None:
        """Wake this replica's tracker at each message, until ``stopping``; reconnects after outages."""
        while not stopping.is_set():
            try:
                await self._listen(stopping)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis went away: listen again (said once per outage)
                if not self._down:
                    self._down = True
                    log.warning("tracker wake-ups unavailable; polling meanwhile", extra={"error": str(exc)})
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), RETRY_S)

    async def _listen(self, stopping: asyncio.Event) -> None:
        pubsub: Any = self.store.client.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(self.channel)
            if self._down:
                self._down = False
                log.info("tracker wake-ups work again")
            while not stopping.is_set():
                message = await pubsub.get_message(timeout=1.0)
                if message is not None and message.get("type") == "message":
                    self.heard += 1
                    self.wake()
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()
