"""The tracker's leases on this replica (:class:`TrackerLeases`): the launching leader's and its shards.

- ``tracker``: one replica at a time launches (the in-flight limit and the engines' room are judged
  once, for everyone), expires queued batches, promotes retries, refreshes the state gauges, sweeps
  the indexes and runs the reconcile pass.
- ``tracker:shard:<i>``: the in-flight batches are split into ``tracker_shards`` shards
  (:mod:`llmbatch.dispatcher.domain.shards`); the replica holding a shard's lease checks the jobs of its
  batches, ends them and publishes their terminal events. The live replicas (a members zset in Redis,
  judged on Redis' clock) share the shards evenly: each takes the leases of its own and gives back
  the others, so adding a replica adds tracking.

Every lease is renewed every :func:`step_interval` (a third of its time to live, at most
:data:`MAX_STEP_S`); a replica that cannot reach Redis counts itself as holding nothing (its leases
expire on their own after ``lease_ttl_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from llmbatch.dispatcher.domain.keys import BatchKey
from llmbatch.dispatcher.domain.shards import shard_of, shards_for
from llmbatch.dispatcher.errors import DispatcherError
from llmbatch.dispatcher.metrics import Metrics
from llmbatch.dispatcher.state.store import StateStore

log = logging.getLogger(__name__)

LEASE = "tracker"
MAX_STEP_S = 2.0  # a shard moved to a new replica waits for its old holder's next step, at most this


def shard_lease(shard: int) -> str:
    """The lease name of shard ``shard``."""
    return f"{LEASE}:shard:{shard}"


def step_interval(ttl_s: float) -> float:
    """How often the leases are renewed (and members re-read): a third of their time to live, at most
    :data:`MAX_STEP_S`."""
    return min(ttl_s / 3, MAX_STEP_S)


class TrackerLeases:
    """What this replica holds: :attr:`is_leader` (the ``tracker`` lease) and :attr:`shards`."""

    def __init__(
        self,
        store: StateStore,
        metrics: Metrics,
        *,
        token: str,
        ttl_s: float,
        shard_count: int,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.token = token
        self.ttl_s = ttl_s
        self.shard_count = shard_count
        self.on_change = on_change  # called after a step that changed what this replica holds
        self.is_leader = False
        self.shards: frozenset[int] = frozenset()
        self.members = 0  # live replicas at the last step

    def owns(self, key: str) -> bool:
        """Whether batch ``key``'s shard is this replica's."""
        return shard_of(key, self.shard_count) in self.shards

    @property
    def owns_all(self) -> bool:
        """Whether every shard is this replica's (a replica alone: nothing to filter)."""
        return len(self.shards) == self.shard_count

    @property
    def alone(self) -> bool:
        """Whether no other replica takes part, as far as this one knows: it holds every shard and saw
        no other member at its last step (a replica that holds only some shards knows others exist, even
        before its next step counts them)."""
        return self.owns_all and self.members <= 1

    def mine(self, keys: list[BatchKey]) -> list[BatchKey]:
        """The keys of ``keys`` whose shard is this replica's, in order."""
        if self.owns_all:
            return keys
        if not self.shards:
            return []
        return [k for k in keys if shard_of(k, self.shard_count) in self.shards]

    async def step(self) -> None:
        """Renew or take the leases this replica should hold, give back the others."""
        try:
            leader = await self.store.acquire_lease(LEASE, self.token, self.ttl_s)
            members = await self.store.live_members(LEASE, self.token, self.ttl_s)
            mine = shards_for(self.token, members, self.shard_count)
            wanted = {shard_lease(s): s in mine for s in range(self.shard_count)}
            held = await self.store.hold_leases(wanted, self.token, self.ttl_s)
            shards = frozenset(s for s in range(self.shard_count) if shard_lease(s) in held)
            self.members = len(set(members) | {self.token})
        except DispatcherError as exc:
            self.metrics.transient_errors.labels(component="redis").inc()
            log.warning("lease check failed", extra={"error": str(exc)})
            leader, shards = False, frozenset()
        self._set(leader, shards)

    def _set(self, leader: bool, shards: frozenset[int]) -> None:
        changed = leader != self.is_leader or shards != self.shards
        if leader != self.is_leader:
            log.info("tracker leadership " + ("acquired" if leader else "lost"))
        if shards != self.shards:
            log.info(
                "tracker shards changed",
                extra={"shards": len(shards), "of": self.shard_count, "replicas": self.members},
            )
        self.is_leader = leader
        self.shards = shards
        self.metrics.leader.set(1 if leader else 0)
        self.metrics.shards.set(len(shards))
        if changed:
            self.on_change()

    async def run(self, stopping: asyncio.Event) -> None:
        """Step until ``stopping`` is set."""
        while not stopping.is_set():
            await self.step()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), step_interval(self.ttl_s))

    async def release(self) -> None:
        """Give every lease back and leave the members (a replica stopping): the others take over at
        their next step instead of after ``lease_ttl_s``."""
        with contextlib.suppress(Exception):
            await self.store.live_members(LEASE, self.token, self.ttl_s, leaving=True)
        with contextlib.suppress(Exception):
            wanted = {shard_lease(s): False for s in range(self.shard_count)}
            await self.store.hold_leases(wanted, self.token, self.ttl_s)
        with contextlib.suppress(Exception):
            await self.store.release_lease(LEASE, self.token)
        self._set(False, frozenset())
