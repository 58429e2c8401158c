"""The state store's compare-and-set writes after intake: a batch's transitions along its lifecycle, the
bookkeeping of its terminal event (dead letter written, event published), retries whose backoff elapsed
promoted, and index entries whose batch moved on dropped. Each is one Lua script (see ``lua/``) that
checks the batch's state (and version, when given) before it writes. Mixed into
:class:`llmbatch.dispatcher.state.store.StateStore`, whose client, keys, clock, scripts and error
translation (``_call``) it uses."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import orjson

from llmbatch.dispatcher.domain import states
from llmbatch.dispatcher.domain.batch_record import TransitionResult
from llmbatch.dispatcher.domain.keys import BatchKey, split_batch_key
from llmbatch.dispatcher.domain.retention import batch_member
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.domain.usage import MAX_DAYS, usage_day
from llmbatch.dispatcher.errors import ConflictError
from llmbatch.dispatcher.state.store_host import StoreHost
from llmbatch.dispatcher.state.store_indexes import reply_text

OrphanIndex = Literal["ready", "delayed", "deadlines", "unpublished"] | State
"""An index whose stale entries :meth:`StoreTransitions.drop_orphans` removes."""

TERMINAL_CSV = ",".join(sorted(s.value for s in states.TERMINAL))
"""The terminal states, as the scripts take them (one ARGV)."""
USAGE_TTL_S = (MAX_DAYS + 1) * 86400  # a usage hash outlives the longest report by a day


def fmt(value: float) -> str:
    """A number as a script argument (a float's exact text)."""
    return repr(float(value))


class StoreTransitions(StoreHost):
    """Compare-and-set writes of the Redis state store (see the module docstring)."""

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
            sets["not_before"] = fmt(not_before)
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
            fmt(now),
            orjson.dumps(sets).decode(),
            orjson.dumps(list(delete)).decode(),
            "" if ready_score is None else fmt(ready_score),
            "" if not_before is None else fmt(not_before),
            ",".join(s.value for s in indexed),
            TERMINAL_CSV,
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
        args = [event_id, fmt(self.clock()), TERMINAL_CSV]
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
        now, ttl = fmt(self.clock()), str(self.finished_ttl_s)
        args = [
            key,
            event_id,
            now,
            ttl,
            tenant if ended_at is not None else "",
            str(USAGE_TTL_S),
            batch_member(tenant, batch_id, ""),  # the script adds the lifecycle
            "" if ended_at is None else fmt(ended_at),
            TERMINAL_CSV,
        ]
        reply = reply_text(await self._call(lambda: self._scripts.mark_published(keys=keys, args=args)))
        if reply == "counted":
            return "counted"
        return "ok" if reply == "ok" else None

    async def promote_due(self, limit: int = 500) -> int:
        """Move queued batches whose retry backoff has elapsed back into the ``ready`` zset."""
        now = fmt(self.clock())
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
        args = [kind, *batch_keys, TERMINAL_CSV]
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
