"""Dead-letter replay, the edges: publish the planned records (Kafka, acks=all) and remember them
(Redis). What to replay and each record's bytes are decided in :mod:`llmbatch.dispatcher.ops.replay`.

**The ledger** (:class:`ReplayLedger`) is a Redis hash per dead-letter topic,
``<prefix>:dlq:replayed:<dlt topic>`` (see :meth:`llmbatch.dispatcher.domain.keys.Keys.replay_ledger`), field
``<partition>:<offset>``, value JSON ``{replay_id, round, at, by, to_topic, target_partition,
target_offset}``. An entry is written after the broker acknowledged the replayed record (acks=all):
an interrupted run leaves at most the record in hand unrecorded, and replaying that one again is
harmless (same replay id). Entries older than 60 days (past the dead-letter topic's 30-day retention)
are removed at each write (a sorted set by replay time beside the hash), and both keys expire 60 days
after their last write: the ledger stays bounded by the replays of 60 days.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from llmbatch.dispatcher.domain.keys import BatchKey
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.errors import StateStoreUnavailable, classify
from llmbatch.dispatcher.ops.dlq_reader import DeadLetterView
from llmbatch.dispatcher.ops.replay import (
    Decision,
    LedgerEntry,
    RateLimiter,
    ReplayItem,
    build_record,
    plan,
)
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.schemas.dlt import ReplayInfo

LEDGER_TTL_S = 60 * 86400
PRUNE_PAGE = 1000


# --- the ledger ----------------------------------------------------------------------------------------


class ReplayLedger:
    """Which dead letters of one topic were replayed (a Redis hash; see the module docstring)."""

    def __init__(self, store: StateStore, dlt_topic: str) -> None:
        self.store = store
        self.key = store.keys.replay_ledger(dlt_topic)
        self.times = store.keys.replay_ledger_times(dlt_topic)

    async def _call(self, fn: Callable[[], Awaitable[Any]]) -> Any:
        try:
            return await fn()
        except Exception as exc:
            raise classify(exc, default=StateStoreUnavailable) from exc

    async def entries(self, coordinates: Iterable[str]) -> dict[str, LedgerEntry]:
        wanted = list(dict.fromkeys(coordinates))
        if not wanted:
            return {}
        client = self.store.client
        raw = await self._call(lambda: client.hmget(self.key, wanted))
        out: dict[str, LedgerEntry] = {}
        for coordinate, value in zip(wanted, raw, strict=True):
            if value:
                try:
                    out[coordinate] = LedgerEntry.model_validate_json(value)
                except ValueError:
                    continue  # an unreadable entry counts as not replayed
        return out

    async def record(self, coordinate: str, entry: LedgerEntry) -> None:
        client = self.store.client
        data = entry.model_dump_json()

        at = entry.at.timestamp()

        async def write() -> None:
            async with client.pipeline(transaction=True) as pipe:
                pipe.hset(self.key, coordinate, data)
                pipe.zadd(self.times, {coordinate: at})
                pipe.expire(self.key, LEDGER_TTL_S)
                pipe.expire(self.times, LEDGER_TTL_S)
                await pipe.execute()

        await self._call(write)
        await self.prune(at - LEDGER_TTL_S)

    async def prune(self, before: float, page: int = PRUNE_PAGE) -> int:
        """Remove the entries replayed before ``before`` (unix s), a page at a time; return how many."""
        client, removed = self.store.client, 0
        while True:
            old = await self._call(
                lambda: client.zrangebyscore(self.times, "-inf", f"({before!r}", start=0, num=page)
            )
            if not old:
                return removed

            async def drop(old: list[Any] = old) -> None:
                async with client.pipeline(transaction=True) as pipe:
                    pipe.hdel(self.key, *old)
                    pipe.zrem(self.times, *old)
                    await pipe.execute()

            await self._call(drop)
            removed += len(old)


async def batch_states(store: StateStore, letters: Sequence[DeadLetterView]) -> dict[BatchKey, State | None]:
    """Current state of each dead letter's batch, ``None`` when Redis does not know it."""
    keys = sorted({k for v in letters if (k := v.batch_key) is not None})
    records = await store.get_many(keys)
    return {k: (r.state if r is not None else None) for k, r in zip(keys, records, strict=True)}


async def plan_replays(
    store: StateStore,
    dlt_topic: str,
    selected: Sequence[DeadLetterView],
    *,
    default_topic: str,
    to_topic: str | None,
    force: bool,
    include_replayed: bool,
) -> list[ReplayItem]:
    """:func:`llmbatch.dispatcher.ops.replay.plan` of ``selected`` against what the replay ledger and
    the batches' records in Redis say now."""
    ledger = await ReplayLedger(store, dlt_topic).entries(v.coordinate for v in selected)
    states = await batch_states(store, selected)
    return plan(
        selected,
        ledger=ledger,
        states=states,
        default_topic=default_topic,
        to_topic=to_topic,
        force=force,
        include_replayed=include_replayed,
    )


# --- publishing ----------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What happened to one item during ``--execute``."""

    item: ReplayItem
    ok: bool
    error: str | None = None
    partition: int | None = None
    offset: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "coordinate": self.item.letter.coordinate,
            "ok": self.ok,
            "error": self.error,
            "replay_id": self.item.replay_id,
            "topic": self.item.target_topic,
            "partition": self.partition,
            "offset": self.offset,
        }


async def execute(
    items: Sequence[ReplayItem],
    *,
    kafka: Any,
    ledger: ReplayLedger,
    by: str,
    limiter: RateLimiter,
    on_outcome: Callable[[Outcome], None] = lambda outcome: None,
    now: Callable[[], datetime] | None = None,
    connect_timeout_s: float = 10.0,
    replay_key: bytes | None = None,
) -> tuple[list[Outcome], bool]:
    """Publish every ``replay`` item (acks=all), then record it in the ledger.

    Returns the outcomes and whether the run was interrupted (Ctrl-C / task cancelled): what was
    acknowledged before that is in the ledger, so a rerun continues where this one stopped.
    """
    from datetime import UTC

    from aiokafka import AIOKafkaProducer
    from aiokafka.errors import KafkaError

    from llmbatch.dispatcher.ops.common import OpsError

    clock = now or (lambda: datetime.now(UTC))
    todo = [i for i in items if i.decision is Decision.REPLAY]
    outcomes: list[Outcome] = []
    if not todo:
        return outcomes, False
    producer = AIOKafkaProducer(
        acks="all", max_request_size=kafka.topics.max_message_bytes, **kafka.client_kwargs()
    )
    try:
        await asyncio.wait_for(producer.start(), connect_timeout_s)
    except (TimeoutError, KafkaError, OSError) as exc:
        await _stop_quietly(producer)
        raise OpsError(
            f"Kafka at {kafka.bootstrap_servers} did not answer ({type(exc).__name__}); "
            "check LLMBATCH_KAFKA__BOOTSTRAP_SERVERS"
        ) from None
    interrupted = False
    try:
        for item in todo:
            await limiter.acquire()
            info = ReplayInfo(replay_id=item.replay_id, replayed_at=clock(), replayed_by=by)
            record = build_record(item, info, replay_key)
            try:
                meta = await producer.send_and_wait(
                    record.topic, value=record.value, key=record.key, headers=record.headers
                )
            except (KafkaError, OSError) as exc:
                outcome = Outcome(item, False, f"{type(exc).__name__}: {exc}"[:300])
            else:
                entry = LedgerEntry(
                    replay_id=item.replay_id,
                    round=item.round,
                    at=info.replayed_at,
                    by=by,
                    to_topic=record.topic,
                    target_partition=int(meta.partition),
                    target_offset=int(meta.offset),
                )
                await ledger.record(item.letter.coordinate, entry)
                outcome = Outcome(item, True, None, int(meta.partition), int(meta.offset))
            outcomes.append(outcome)
            on_outcome(outcome)
    except asyncio.CancelledError:
        interrupted = True
    finally:
        await _stop_quietly(producer)
    return outcomes, interrupted


async def _stop_quietly(producer: Any) -> None:
    with contextlib.suppress(Exception):  # shutting down; outcomes are already recorded
        await producer.stop()
