"""Redis state store: one hash per batch, index zsets, every change by one Lua compare-and-set.

Each script runs atomically in Redis and checks the batch's current ``state`` (and, when given, its
``version``) before it writes, so concurrent replicas cannot both win a transition. Terminal states
are immutable: only the publication bookkeeping (``dlt_written``, ``published``) may still change,
and only intake may reopen a ``failed`` (explicit replay) or ``dead_lettered`` batch.

A hash keeps the request body (``request``: the original record's value, inline requests included)
only while the state machine needs it, to launch attempts and to write a late dead letter: once the
terminal event is published, ``request`` and ``origin`` are deleted and only the bookkeeping stays
for ``finished_ttl_s``.

Redis errors are translated into :class:`~llmbatch.dispatcher.errors.StateStoreUnavailable` (retriable) or
:class:`~llmbatch.dispatcher.errors.PermanentError` here, at the boundary.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson
import redis.asyncio as aioredis

from llmbatch.dispatcher.domain.batch_record import IntakeItem, IntakeResult
from llmbatch.dispatcher.domain.keys import BatchKey, Keys, split_batch_key
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.errors import StateStoreUnavailable, classify
from llmbatch.dispatcher.state import lua
from llmbatch.dispatcher.state.store_indexes import StoreIndexes, reply_text
from llmbatch.dispatcher.state.store_records import StoreRecords
from llmbatch.dispatcher.state.store_scripts import Scripts
from llmbatch.dispatcher.state.store_transitions import TERMINAL_CSV, StoreTransitions, fmt
from llmbatch.dispatcher.state.store_upkeep import StoreUpkeep
from llmbatch.schemas.common import API_BATCH_PREFIX
from llmbatch.settings import RedisSettings

T = TypeVar("T")

# the state indexes an intake may touch: its initial state's (queued, dead_lettered) and, when it
# reopens a batch, the one it leaves (failed, dead_lettered)
_INTAKE_STATES = (State.QUEUED, State.DEAD_LETTERED, State.FAILED)
_INTAKE_STATES_CSV = ",".join(s.value for s in _INTAKE_STATES)


@dataclass
class StateStore(StoreRecords, StoreTransitions, StoreIndexes, StoreUpkeep):
    """Async Redis state store. ``client`` must be created with ``decode_responses=True``.

    Intake is its own; the reads of a batch's record, progress and command markers come from
    :class:`~llmbatch.dispatcher.state.store_records.StoreRecords`, its transitions and the terminal
    event's bookkeeping from :class:`~llmbatch.dispatcher.state.store_transitions.StoreTransitions`, the
    reads of its indexes (batches per state, ready, deadlines, unpublished) from
    :class:`~llmbatch.dispatcher.state.store_indexes.StoreIndexes`, its upkeep (expired index entries, Ray
    jobs to delete, leases, S3 sessions, health) from
    :class:`~llmbatch.dispatcher.state.store_upkeep.StoreUpkeep`."""

    client: aioredis.Redis
    keys: Keys = field(default_factory=Keys)
    finished_ttl_s: int = 7 * 86400
    dedupe_ttl_s: int = 7 * 86400
    clock: Callable[[], float] = time.time

    def __post_init__(self) -> None:
        self._unreadable_said: set[BatchKey] = set()
        if any(ch in self.keys.prefix for ch in "'\\\n\r"):
            raise ValueError("the Redis key prefix may not contain quotes, backslashes or newlines")
        reg = self.client.register_script
        self._scripts = Scripts(
            intake=reg(
                lua.load("intake")
                .replace("@DEDUPE_TTL@", str(self.dedupe_ttl_s))
                .replace("@FINISHED_TTL@", str(self.finished_ttl_s))
            ),
            transition=reg(lua.load("transition")),
            mark_published=reg(lua.load("mark_published")),
            mark_dlt=reg(lua.load("mark_dlt_written")),
            promote=reg(lua.load("promote_due")),
            lease_acquire=reg(lua.load("acquire_lease")),
            lease_release=reg(lua.load("release_lease")),
            leases_hold=reg(lua.load("hold_leases")),
            members=reg(lua.load("tracker_members")),
            drop_orphans=reg(lua.load("drop_orphans")),
        )

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        password: str | None = None,
        keys: Keys | None = None,
        finished_ttl_s: int = 7 * 86400,
        dedupe_ttl_s: int = 7 * 86400,
        socket_timeout: float = 5.0,
        ssl_ca_certs: str | None = None,
    ) -> StateStore:
        """A store on ``url``; ``ssl_ca_certs``: the CA that signed a ``rediss://`` server's certificate."""
        tls: dict[str, Any] = {}
        if ssl_ca_certs and url.startswith("rediss://"):
            tls["ssl_ca_certs"] = ssl_ca_certs
        client = aioredis.Redis.from_url(
            url,
            **tls,
            password=password,
            decode_responses=True,
            # a byte that is not UTF-8 in a reply is read as U+FFFD and judged by the checks of the
            # value it is in, instead of failing the whole reply (and every batch read with it)
            encoding_errors="replace",
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_timeout,
            health_check_interval=15,
            retry_on_timeout=False,
        )
        return cls(client, keys or Keys(), finished_ttl_s, dedupe_ttl_s)

    @classmethod
    def from_settings(cls, redis: RedisSettings, **options: Any) -> StateStore:
        """A store on the Redis of ``redis``: its URL, password, CA bundle and key prefix;
        ``options`` as :meth:`from_url`'s (TTLs, ``socket_timeout``)."""
        return cls.from_url(
            redis.url,
            password=redis.effective_password(),
            keys=Keys(redis.key_prefix),
            ssl_ca_certs=str(redis.ssl_ca_certs) if redis.ssl_ca_certs else None,
            **options,
        )

    async def close(self) -> None:
        await self.client.aclose()

    async def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
        try:
            return await fn()
        except Exception as exc:
            raise classify(exc, default=StateStoreUnavailable) from exc

    # -- intake ----------------------------------------------------------------------------------
    def _intake_args(self, item: IntakeItem, now: float) -> tuple[list[str], list[str]]:
        fields = dict(item.fields)
        fields.setdefault("batch_id", split_batch_key(item.key)[1])
        fields["ready_score"] = fmt(item.ready_score)
        if item.deadline is not None:
            fields["deadline"] = fmt(item.deadline)
        tenant, batch_id = split_batch_key(item.key)
        # the tenant's list shows its accepted batches; the API lists the ones it made itself
        listed = item.initial is State.QUEUED and not batch_id.startswith(API_BATCH_PREFIX)
        args = [
            item.key,
            "" if item.initial is State.QUEUED else "1",
            fmt(now),
            fmt(item.ready_score),
            "" if item.deadline is None else fmt(item.deadline),
            item.replay_id or "",
            item.initial.value,
            orjson.dumps(fields).decode(),
            _INTAKE_STATES_CSV,
            TERMINAL_CSV,
            tenant if listed else "",
            batch_id,
            str(item.tokens),
            "" if item.token_limit is None else str(item.token_limit),
        ]
        keys = [
            self.keys.batch(item.key),
            self.keys.progress(item.key),
            self.keys.event(*item.marker),
            self.keys.ready,
            self.keys.delayed,
            self.keys.deadlines,
            self.keys.unpublished,
            self.keys.tenant_batches(tenant),
            self.keys.tenants,
            self.keys.quota_tokens(tenant),
            *(self.keys.state_index(s) for s in _INTAKE_STATES),
        ]
        return keys, args

    async def intake_many(self, items: Sequence[IntakeItem]) -> list[IntakeResult]:
        """Create (or dedupe) many batches in one round trip; results in the same order."""
        if not items:
            return []
        now = self.clock()

        async def run() -> list[Any]:
            async with self.client.pipeline(transaction=False) as pipe:
                for item in items:
                    keys, args = self._intake_args(item, now)
                    await self._scripts.intake(keys=keys, args=args, client=pipe)
                return list(await pipe.execute())

        raw = await self._call(run)
        out = []
        for reply in raw:
            outcome, state, version, generation = (reply_text(x) for x in reply)
            if outcome == "over_quota":  # nothing written; the reply carries the quota's figures
                quota = (int(state), int(version), int(generation))
                out.append(IntakeResult(outcome, None, 0, 0, quota=quota))
                continue
            out.append(IntakeResult(outcome, State(state) if state else None, int(version), int(generation)))
        return out

    async def intake(self, item: IntakeItem) -> IntakeResult:
        return (await self.intake_many([item]))[0]
