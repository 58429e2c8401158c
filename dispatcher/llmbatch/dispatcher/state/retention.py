"""The retention index in Redis: what expires when, and the collector's claims on it.

Two zsets hold the same members (:mod:`llmbatch.dispatcher.domain.retention`): ``<p>:retention:due``
scores each by when it expires (what reads show as ``expires_at``, and what makes a read answer
``expired``), ``<p>:retention:queue`` by when a collector may take it next. A collector claims due
members (each claim moves its queue score a lease ahead: the claim's token), deletes, then settles;
a collector that dies mid-way leaves its members to be claimed again after the lease, and every step
of a deletion can be done twice. ``mark_published.lua`` adds a batch's lifecycle as its end is
published; the HTTP API adds its uploads.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import redis.asyncio as aioredis

from llmbatch.dispatcher.domain import states
from llmbatch.dispatcher.domain.keys import Keys, batch_key
from llmbatch.dispatcher.domain.retention import Expiring
from llmbatch.dispatcher.errors import StateStoreUnavailable, classify
from llmbatch.dispatcher.state import lua
from llmbatch.dispatcher.state.store_indexes import reply_text

T = TypeVar("T")
_TERMINAL_CSV = ",".join(s.value for s in states.TERMINAL)
Retired = Literal["retired", "newer", "running", "lost"]


def _fmt(value: float) -> str:
    return f"{value:.3f}"


@dataclass(frozen=True, slots=True)
class Claim:
    """A member a collector holds until its token (the member's queue score) changes."""

    member: str
    token: str


@dataclass
class RetentionIndex:
    """The retention index over a client created with ``decode_responses=True``."""

    client: aioredis.Redis
    keys: Keys = field(default_factory=Keys)
    clock: Callable[[], float] = time.time

    def __post_init__(self) -> None:
        reg = self.client.register_script
        self._claim = reg(lua.load("retention_claim"))
        self._settle = reg(lua.load("retention_settle"))
        self._retire = reg(lua.load("retention_retire"))

    async def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
        try:
            return await fn()
        except Exception as exc:
            raise classify(exc, default=StateStoreUnavailable) from exc

    async def schedule(self, member: str, due: float) -> None:
        """Date ``member`` to expire at ``due`` (again: the new date wins)."""
        keys = self.keys

        async def run() -> None:
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.zadd(keys.retention_due, {member: due})
                pipe.zadd(keys.retention_queue, {member: due})
                await pipe.execute()

        await self._call(run)

    async def due_of(self, members: Sequence[str]) -> list[float | None]:
        """When each of ``members`` expires (``None``: not in the index)."""
        if not members:
            return []
        raw = await self._call(lambda: self.client.zmscore(self.keys.retention_due, list(members)))
        return [None if s is None else float(s) for s in raw]

    async def gone_at(self, name: str) -> float | None:
        """When a removed file or batch expired (its tombstone), ``None`` when there is none."""
        raw = await self._call(lambda: self.client.get(self.keys.retention_gone(name)))
        try:
            return None if raw is None else float(reply_text(raw))
        except ValueError:  # not a tombstone this module wrote
            return None

    async def pending(self, now: float) -> tuple[int, int]:
        """How many members the index holds, and how many of them have expired by ``now``."""

        async def run() -> tuple[int, int]:
            total = await self.client.zcard(self.keys.retention_due)
            due = await self.client.zcount(self.keys.retention_due, "-inf", now)
            return int(total), int(due)

        return await self._call(run)

    async def claim(self, now: float, *, lease_s: float, limit: int) -> list[Claim]:
        """Up to ``limit`` expired members for this caller alone for ``lease_s``."""
        keys, args = [self.keys.retention_queue], [_fmt(now), _fmt(lease_s), str(limit)]
        flat = await self._call(lambda: self._claim(keys=keys, args=args))
        items = [reply_text(x) for x in flat]
        return [Claim(items[i], items[i + 1]) for i in range(0, len(items) - 1, 2)]

    async def done(self, claim: Claim) -> bool:
        """Drop the member (nothing to leave behind); False when the claim was lost."""
        return await self._settle_call(claim, "done")

    async def defer(self, claim: Claim, until: float) -> bool:
        """Take the member again at ``until`` (its expiry stands); False when the claim was lost."""
        return await self._settle_call(claim, "defer", _fmt(until))

    async def gone(self, claim: Claim, item: Expiring, expired_at: float, forget_after_s: int) -> bool:
        """Drop the member and leave its tombstone for ``forget_after_s``; False when the claim was lost."""
        return await self._settle_call(claim, "gone", _fmt(expired_at), str(forget_after_s), item=item)

    async def _settle_call(
        self, claim: Claim, action: str, *extra: str, item: Expiring | None = None
    ) -> bool:
        keys = [self.keys.retention_due, self.keys.retention_queue]
        if item is not None:
            keys.append(self.keys.retention_gone(item.gone_name))
        args = [claim.member, claim.token, action, *extra]
        return reply_text(await self._call(lambda: self._settle(keys=keys, args=args))) == "ok"

    async def retire_batch(self, claim: Claim, item: Expiring, now: float, forget_after_s: int) -> Retired:
        """Forget an expired lifecycle's state before its results go (see ``retention_retire.lua``); its
        tombstone holds the member's expiry (``now`` if it has none)."""
        key = batch_key(item.tenant, item.id)
        keys = [
            self.keys.retention_queue,
            self.keys.retention_due,
            self.keys.batch(key),
            self.keys.progress(key),
            self.keys.tenant_batches(item.tenant),
            self.keys.retention_gone(item.gone_name),
        ]
        args = [
            claim.member,
            claim.token,
            item.lifecycle,
            item.id,
            _fmt(now),
            str(forget_after_s),
            _TERMINAL_CSV,
        ]
        reply = reply_text(await self._call(lambda: self._retire(keys=keys, args=args)))
        if reply not in ("retired", "newer", "running"):
            return "lost"
        return reply  # type: ignore[return-value]
