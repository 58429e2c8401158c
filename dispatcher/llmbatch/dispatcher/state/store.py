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

import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import orjson
import redis.asyncio as aioredis

from llmbatch.dispatcher.domain import states
from llmbatch.dispatcher.domain.batch_record import BatchRecord, IntakeItem, IntakeResult, TransitionResult
from llmbatch.dispatcher.domain.keys import BatchKey, Keys, split_batch_key
from llmbatch.dispatcher.domain.retention import batch_member
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.domain.usage import MAX_DAYS, usage_day
from llmbatch.dispatcher.errors import ConflictError, StateStoreUnavailable, classify
from llmbatch.dispatcher.state import lua
from llmbatch.dispatcher.state.store_indexes import StoreIndexes, reply_text
from llmbatch.dispatcher.state.store_scripts import Scripts
from llmbatch.dispatcher.state.store_upkeep import StoreUpkeep
from llmbatch.schemas.common import API_BATCH_PREFIX
from llmbatch.settings import RedisSettings

OrphanIndex = Literal["ready", "delayed", "deadlines", "unpublished"] | State
"""An index whose stale entries :meth:`StateStore.drop_orphans` removes."""

T = TypeVar("T")

_TERMINAL_CSV = ",".join(sorted(s.value for s in states.TERMINAL))
# the state indexes an intake may touch: its initial state's (queued, dead_lettered) and, when it
# reopens a batch, the one it leaves (failed, dead_lettered)
_INTAKE_STATES = (State.QUEUED, State.DEAD_LETTERED, State.FAILED)
_INTAKE_STATES_CSV = ",".join(s.value for s in _INTAKE_STATES)
USAGE_TTL_S = (MAX_DAYS + 1) * 86400  # a usage hash outlives the longest report by a day


def _str_hash(raw: Mapping[Any, Any]) -> dict[str, str]:
    """A hash reply as str -> str (the client decodes already; this only narrows the type)."""
    return {reply_text(k): reply_text(v) for k, v in raw.items()}


log = logging.getLogger(__name__)

UNREADABLE_SAID_MAX = 10_000  # the batches whose unreadable record was logged (bounded: then said again)


def _fmt(value: float) -> str:
    return repr(float(value))


# --- store -------------------------------------------------------------------------------------


@dataclass
class StateStore(StoreIndexes, StoreUpkeep):
    """Async Redis state store. ``client`` must be created with ``decode_responses=True``.

    Reads of its indexes (batches per state, ready, deadlines, unpublished) come from
    :class:`~llmbatch.dispatcher.state.store_indexes.StoreIndexes`, its upkeep (expired index entries, Ray
    jobs to
    delete, leases, S3 sessions, health) from :class:`~llmbatch.dispatcher.state.store_upkeep.StoreUpkeep`."""

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
        fields["ready_score"] = _fmt(item.ready_score)
        if item.deadline is not None:
            fields["deadline"] = _fmt(item.deadline)
        tenant, batch_id = split_batch_key(item.key)
        # the tenant's list shows its accepted batches; the API lists the ones it made itself
        listed = item.initial is State.QUEUED and not batch_id.startswith(API_BATCH_PREFIX)
        args = [
            item.key,
            "" if item.initial is State.QUEUED else "1",
            _fmt(now),
            _fmt(item.ready_score),
            "" if item.deadline is None else _fmt(item.deadline),
            item.replay_id or "",
            item.initial.value,
            orjson.dumps(fields).decode(),
            _INTAKE_STATES_CSV,
            _TERMINAL_CSV,
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

    # -- reads ------------------------------------------------------------------------------------
    def _record(self, key: BatchKey, data: Mapping[str, str]) -> BatchRecord | None:
        """The record of a batch's hash; ``None`` (as for no batch: every index drops it as an orphan)
        when its state or version is unreadable. Redis is not trusted: one garbled hash read with others
        must not stop every step that reads them. Logged once per batch."""
        try:
            return BatchRecord.from_hash(key, data)
        except (KeyError, ValueError) as exc:
            if key not in self._unreadable_said:
                if len(self._unreadable_said) >= UNREADABLE_SAID_MAX:
                    self._unreadable_said.clear()
                self._unreadable_said.add(key)
                log.error(
                    "batch record unreadable: left out of every step (fix or delete its hash)",
                    extra={"batch_key": key[:200], "error": repr(exc)[:200]},
                )
            return None

    async def get(self, key: BatchKey) -> BatchRecord | None:
        data = _str_hash(await self._call(lambda: self.client.hgetall(self.keys.batch(key))))
        return self._record(key, data) if data else None

    async def get_many(self, batch_keys: Sequence[BatchKey]) -> list[BatchRecord | None]:
        async def run() -> list[Any]:
            async with self.client.pipeline(transaction=False) as pipe:
                for key in batch_keys:
                    pipe.hgetall(self.keys.batch(key))
                return list(await pipe.execute())

        raw = await self._call(run) if batch_keys else []
        return [self._record(k, d) if d else None for k, d in zip(batch_keys, raw, strict=True)]

    async def get_fields_many(
        self, batch_keys: Sequence[BatchKey], fields: Sequence[str]
    ) -> list[BatchRecord | None]:
        """Each batch's record with only ``fields`` (and its state and version), in one round trip
        (``None``: no such batch): for the steps that judge many batches by a few fields each, without
        reading their request bodies."""
        names = ("state", "version", *fields)

        async def run() -> list[Any]:
            async with self.client.pipeline(transaction=False) as pipe:
                for key in batch_keys:
                    pipe.hmget(self.keys.batch(key), names)
                return list(await pipe.execute())

        raw = await self._call(run) if batch_keys else []
        return [
            self._record(k, {n: v for n, v in zip(names, values, strict=True) if v is not None})
            if values and values[0]
            else None
            for k, values in zip(batch_keys, raw, strict=True)
        ]

    async def states_many(self, batch_keys: Sequence[BatchKey]) -> list[State | None]:
        """The state of each batch (``None``: no such batch, or its record is unreadable, as for
        :meth:`get`), in one round trip."""
        return [r.state if r is not None else None for r in await self.get_fields_many(batch_keys, ())]

    async def markers_exist(self, markers: Sequence[tuple[str, str]]) -> list[bool]:
        """Whether each command event (source, id) was already applied."""
        if not markers:
            return []

        async def run() -> list[Any]:
            async with self.client.pipeline(transaction=False) as pipe:
                for source, event_id in markers:
                    pipe.exists(self.keys.event(source, event_id))
                return list(await pipe.execute())

        return [bool(int(x)) for x in await self._call(run)]

    async def set_marker(self, marker: tuple[str, str]) -> None:
        await self.set_markers([marker])

    async def set_markers(self, markers: Sequence[tuple[str, str]]) -> None:
        async def run() -> None:
            async with self.client.pipeline(transaction=False) as pipe:
                for marker in markers:
                    pipe.set(self.keys.event(*marker), "1", ex=self.dedupe_ttl_s)
                await pipe.execute()

        if markers:
            await self._call(run)

    async def read_progress(self, key: BatchKey) -> dict[str, str]:
        return _str_hash(await self._call(lambda: self.client.hgetall(self.keys.progress(key))))

    async def read_progress_many(self, batch_keys: Sequence[BatchKey]) -> list[dict[str, str]]:
        """The progress hashes of ``batch_keys`` (one round trip; empty for a batch without one)."""
        if not batch_keys:
            return []

        async def run() -> list[Any]:
            async with self.client.pipeline(transaction=False) as pipe:
                for key in batch_keys:
                    pipe.hgetall(self.keys.progress(key))
                return list(await pipe.execute())

        return [_str_hash(h) for h in await self._call(run)]

    # -- writes -----------------------------------------------------------------------------------
    async def transition(
        self,
        key: BatchKey,
        to: State,
        *,
        expected_version: int | None = None,
        from_states: Iterable[State] | None = None,
        fields: Mapping[str, object] | None = None,
        delete: Iterable[str] = (),
        ready_score: float | None = None,
        not_before: float | None = None,
    ) -> TransitionResult:
        """Move batch ``key`` to ``to`` if it is in one of ``from_states`` (default: every state the
        lifecycle allows) and, when given, at ``expected_version``. ``to`` may equal the current
        non-terminal state to update fields under the same guard."""
        allowed = set(states.sources_of(to)) if from_states is None else set(from_states)
        for src in allowed:
            if src != to:
                states.check_transition(src, to)
            elif src in states.TERMINAL:
                raise states.TransitionError(f"{src.value} is terminal; its fields are immutable")
        now = self.clock()
        indexed = sorted(allowed | {to})  # the state indexes it may leave or enter, declared
        sets = {k: ("" if v is None else str(v)) for k, v in (fields or {}).items()}
        if not_before is not None:
            sets["not_before"] = _fmt(not_before)
        keys = [
            self.keys.batch(key),
            self.keys.ready,
            self.keys.delayed,
            self.keys.deadlines,
            self.keys.unpublished,
            *(self.keys.state_index(s) for s in indexed),
        ]
        args = [
            key,
            "" if expected_version is None else str(expected_version),
            ",".join(sorted(s.value for s in allowed)),
            to.value,
            _fmt(now),
            orjson.dumps(sets).decode(),
            orjson.dumps(list(delete)).decode(),
            "" if ready_score is None else _fmt(ready_score),
            "" if not_before is None else _fmt(not_before),
            ",".join(s.value for s in indexed),
            _TERMINAL_CSV,
        ]
        reply = await self._call(lambda: self._scripts.transition(keys=keys, args=args))
        outcome, state, version = (reply_text(x) for x in reply)
        return TransitionResult(outcome == "ok", outcome, State(state) if state else None, int(version))

    async def transition_or_raise(self, key: BatchKey, to: State, **kwargs: Any) -> TransitionResult:
        result = await self.transition(key, to, **kwargs)
        if not result.ok:
            raise ConflictError(
                f"{key}: cannot move to {to.value} ({result.outcome}, "
                f"state={result.state}, version={result.version})"
            )
        return result

    async def mark_dlt_written(self, key: BatchKey, event_id: str) -> bool:
        keys = [self.keys.batch(key)]
        args = [event_id, _fmt(self.clock()), _TERMINAL_CSV]
        return reply_text(await self._call(lambda: self._scripts.mark_dlt(keys=keys, args=args))) == "ok"

    async def mark_published(
        self, key: BatchKey, event_id: str, *, ended_at: float | None = None
    ) -> Literal["counted", "ok"] | None:
        """Mark the lifecycle's terminal event ``event_id`` published: ``counted`` the first time (its
        usage then goes to its tenant's usage of the day of ``ended_at``, when given, and a batch kept
        for ``retention_s`` is dated in the retention index), ``ok`` after, None when ``event_id`` is not
        the batch's terminal event (or the batch is gone)."""
        tenant, batch_id = split_batch_key(key)
        keys = [
            self.keys.batch(key),
            self.keys.unpublished,
            self.keys.progress(key),
            self.keys.quota_tokens(tenant),
            self.keys.retention_due,
            self.keys.retention_queue,
        ]
        if ended_at is not None:
            keys += [self.keys.usage(tenant, usage_day(ended_at)), self.keys.usage_tenants]
        now, ttl = _fmt(self.clock()), str(self.finished_ttl_s)
        args = [
            key,
            event_id,
            now,
            ttl,
            tenant if ended_at is not None else "",
            str(USAGE_TTL_S),
            batch_member(tenant, batch_id, ""),  # the script adds the lifecycle
            "" if ended_at is None else _fmt(ended_at),
            _TERMINAL_CSV,
        ]
        reply = reply_text(await self._call(lambda: self._scripts.mark_published(keys=keys, args=args)))
        if reply == "counted":
            return "counted"
        return "ok" if reply == "ok" else None

    async def promote_due(self, limit: int = 500) -> int:
        """Move queued batches whose retry backoff has elapsed back into the ``ready`` zset."""
        now = _fmt(self.clock())
        due = [
            reply_text(k)
            for k in await self._call(
                lambda: self.client.zrangebyscore(self.keys.delayed, "-inf", now, start=0, num=limit)
            )
        ]
        if not due:
            return 0
        # the script moves only these (each still delayed and due): every key it touches is declared
        keys = [self.keys.delayed, self.keys.ready, *(self.keys.batch(BatchKey(k)) for k in due)]
        return int(await self._call(lambda: self._scripts.promote(keys=keys, args=[now, *due])))

    async def drop_orphans(self, index: OrphanIndex, batch_keys: Sequence[BatchKey]) -> int:
        """Remove the entries of ``index`` among ``batch_keys`` whose batch is gone or no longer in
        a state that index holds (each checked atomically by the script); return how many went."""
        if not batch_keys:
            return 0
        kind, zset = self._orphan_index(index)
        keys = [zset, *(self.keys.batch(k) for k in batch_keys)]
        args = [kind, *batch_keys, _TERMINAL_CSV]
        return int(await self._call(lambda: self._scripts.drop_orphans(keys=keys, args=args)))

    def _orphan_index(self, index: OrphanIndex) -> tuple[str, str]:
        if isinstance(index, State):
            return f"state:{index.value}", self.keys.state_index(index)
        return index, {
            "ready": self.keys.ready,
            "delayed": self.keys.delayed,
            "deadlines": self.keys.deadlines,
            "unpublished": self.keys.unpublished,
        }[index]
