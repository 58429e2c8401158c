"""Dead-letter replay: choose what to replay and build its records (pure), pace it.

**Planning** (:func:`plan`, pure): the dead letters matching a :class:`ReplayFilter` (the first
``limit`` of them, oldest first) each get a :class:`Decision`:

- ``replay`` - the batch is unknown, ``dead_lettered`` or ``failed``: the dispatcher accepts the
  replayed event as a new lifecycle (a ``failed`` batch is reopened with a fresh attempt number);
  cancel commands are always replayable;
- ``already_replayed`` - the replay ledger says this dead letter was replayed before (rerun-safe);
  ``--include-replayed`` replays it again under a new replay id;
- ``refused`` - its batch ``completed`` (a successful terminal state), ended ``cancelled``/``expired``
  (the dispatcher never reopens those), or is still in flight: replaying would run finished work again
  or be dropped as a duplicate. ``--force`` overrides. A *reduced* dead letter (too large for the
  dead-letter topic, so without its value) is always refused: the why names the original record.

**Records** (:func:`build_record`): the original key, value (byte for byte, so ``ce_id`` and the data
are unchanged) and headers, minus the ``kafka_dlt-*``/``llmbatch-dlt-reason`` headers and earlier
replay headers, plus ``llmbatch-replay-id``, ``llmbatch-replay-at``, ``llmbatch-replay-by``. The target
is the original topic (``kafka_dlt-original-topic``) unless ``--to-topic`` says otherwise.

**Replay ids** are deterministic per dead letter and round: ``rp-<sha256(dlt topic, partition,
offset)[:20]>-<round>``. The dispatcher dedupes command events by ``ce_source`` + ``ce_id`` + replay
id, so re-publishing the same replay after a crash cannot start a second job.

Publishing and the ledger of what was replayed are in :mod:`llmbatch.dispatcher.ops.replay_publish`.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from llmbatch.dispatcher.domain.keys import BatchKey
from llmbatch.dispatcher.domain.states import NON_TERMINAL, State
from llmbatch.dispatcher.ops.dlq_reader import DeadLetterView
from llmbatch.schemas.cloudevents import H_ID, H_SOURCE
from llmbatch.schemas.dlt import ReplayInfo
from llmbatch.schemas.events import EventType

_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:/\s*(s|sec|second|m|min|minute))?\s*$")


class Decision(StrEnum):
    REPLAY = "replay"
    ALREADY_REPLAYED = "already_replayed"
    REFUSED = "refused"


class ReplayFilter(BaseModel):
    """Which dead letters to consider (all filters must match)."""

    model_config = ConfigDict(frozen=True)

    reasons: frozenset[str] = frozenset()
    keys: frozenset[str] = frozenset()
    since: datetime | None = None
    until: datetime | None = None
    limit: int | None = Field(default=None, ge=1)

    def matches(self, letter: DeadLetterView) -> bool:
        if self.reasons and letter.reason not in self.reasons:
            return False
        if self.keys and letter.key_text not in self.keys:
            return False
        when = letter.time
        if self.since is not None and (when is None or when < self.since):
            return False
        return not (self.until is not None and (when is None or when > self.until))

    def select(self, letters: Iterable[DeadLetterView]) -> list[DeadLetterView]:
        """Matching letters in time order, the first ``limit`` of them."""
        chosen = [v for v in letters if self.matches(v)]
        return chosen[: self.limit] if self.limit is not None else chosen


class LedgerEntry(BaseModel):
    """What the ledger remembers about one replayed dead letter."""

    replay_id: str
    round: int = Field(ge=1)
    at: datetime
    by: str
    to_topic: str
    target_partition: int | None = None
    target_offset: int | None = None


@dataclass
class ReplayItem:
    """One dead letter and what the replay does with it."""

    letter: DeadLetterView
    decision: Decision
    why: str
    target_topic: str
    replay_id: str
    round: int
    batch_state: State | None = None
    previous: LedgerEntry | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            **self.letter.summary(),
            "decision": self.decision.value,
            "why": self.why,
            "target_topic": self.target_topic,
            "replay_id": self.replay_id,
            "batch_state": self.batch_state.value if self.batch_state else None,
            "previously_replayed": self.previous.model_dump(mode="json") if self.previous else None,
        }


def replay_id_for(letter: DeadLetterView, round_: int = 1) -> str:
    digest = hashlib.sha256(f"{letter.topic}\x1f{letter.partition}\x1f{letter.offset}".encode()).hexdigest()
    return f"rp-{digest[:20]}-{round_}"


def target_topic_for(letter: DeadLetterView, to_topic: str | None, default_topic: str) -> str:
    if to_topic:
        return to_topic
    original = letter.record.original_topic if letter.record is not None else ""
    return original or default_topic


def _state_rule(state: State | None) -> tuple[Decision, str]:
    if state is None:
        return Decision.REPLAY, "batch unknown to Redis: the dispatcher accepts it as new"
    if state is State.DEAD_LETTERED:
        return Decision.REPLAY, "batch was dead-lettered at intake: the dispatcher accepts it again"
    if state is State.FAILED:
        return Decision.REPLAY, "batch failed: the dispatcher reopens it with a new attempt"
    if state is State.COMPLETED:
        return Decision.REFUSED, "batch already completed (pass --force to replay anyway)"
    if state in {State.CANCELLED, State.EXPIRED}:
        return Decision.REFUSED, f"batch ended {state.value}; the dispatcher does not reopen it (--force)"
    if state in NON_TERMINAL:
        return Decision.REFUSED, f"batch is {state.value}: a replay would be ignored as a duplicate (--force)"
    return Decision.REFUSED, f"batch is {state.value} (--force)"  # pragma: no cover - states are exhaustive


def plan(
    letters: Sequence[DeadLetterView],
    *,
    ledger: Mapping[str, LedgerEntry],
    states: Mapping[BatchKey, State | None],
    default_topic: str,
    to_topic: str | None = None,
    force: bool = False,
    include_replayed: bool = False,
) -> list[ReplayItem]:
    """Decide for each (already filtered) dead letter; pure."""
    items: list[ReplayItem] = []
    for letter in letters:
        previous = ledger.get(letter.coordinate)
        round_ = previous.round + 1 if previous is not None else 1
        target = target_topic_for(letter, to_topic, default_topic)
        key = letter.batch_key
        state = states.get(key) if key is not None else None
        item = ReplayItem(
            letter, Decision.REPLAY, "", target, replay_id_for(letter, round_), round_, state, previous
        )
        if letter.record is not None and letter.record.reduced:
            record = letter.record
            item.decision = Decision.REFUSED
            item.why = (
                f"reduced dead letter: its value ({record.original_value_bytes} bytes, sha256 "
                f"{(record.original_value_sha256 or '?')[:12]}...) did not fit the dead-letter topic; the "
                f"original is {record.original_topic} partition {record.original_partition} offset "
                f"{record.original_offset}"
            )
        elif previous is not None and not include_replayed:
            item.decision = Decision.ALREADY_REPLAYED
            item.replay_id = previous.replay_id
            item.round = previous.round
            item.why = f"replayed {previous.at:%Y-%m-%d %H:%M:%SZ} by {previous.by} as {previous.replay_id}"
        elif letter.event_type == EventType.CANCEL_REQUESTED.value:
            item.why = "cancel command: replayed as is"
        else:
            decision, why = _state_rule(state)
            if decision is Decision.REFUSED and force:
                decision, why = Decision.REPLAY, "forced: " + why.split(" (", 1)[0]
            item.decision, item.why = decision, why
        if previous is not None and include_replayed and item.decision is Decision.REPLAY:
            item.why += f" (again: round {round_})"
        items.append(item)
    return items


@dataclass(frozen=True)
class OutgoingRecord:
    topic: str
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]


def build_record(item: ReplayItem, info: ReplayInfo, key: bytes | None = None) -> OutgoingRecord:
    """The record to publish: original key/value/headers plus the replay provenance headers, signed
    for the original event (its ``ce_source`` / ``ce_id``) when the replay ``key`` is given."""
    letter = item.letter
    if key is not None:
        original = dict(letter.original_headers)
        info = info.signed(
            key,
            source=original.get(H_SOURCE, b"").decode(errors="replace"),
            event_id=original.get(H_ID, b"").decode(errors="replace"),
        )
    headers = [*letter.original_headers, *info.to_headers()]
    return OutgoingRecord(item.target_topic, letter.key, letter.value, headers)


@dataclass
class Summary:
    selected: int = 0
    replayed: int = 0
    already_replayed: int = 0
    refused: int = 0
    failed: int = 0
    interrupted: bool = False
    dry_run: bool = True
    by_reason: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, items: Sequence[ReplayItem], *, dry_run: bool) -> Summary:
        summary = cls(selected=len(items), dry_run=dry_run)
        for item in items:
            summary.by_reason[item.letter.reason] = summary.by_reason.get(item.letter.reason, 0) + 1
            if item.decision is Decision.ALREADY_REPLAYED:
                summary.already_replayed += 1
            elif item.decision is Decision.REFUSED:
                summary.refused += 1
        return summary

    @property
    def to_replay(self) -> int:
        return self.selected - self.already_replayed - self.refused

    def to_json(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "selected": self.selected,
            "to_replay": self.to_replay,
            "replayed": self.replayed,
            "already_replayed": self.already_replayed,
            "refused": self.refused,
            "failed": self.failed,
            "interrupted": self.interrupted,
            "by_reason": self.by_reason,
        }


# --- pacing ------------------------------------------------------------------------------------------


def parse_rate(text: str | None) -> float | None:
    """``--rate``: ``10``, ``10/s``, ``120/m`` -> records per second (``None``/``0`` = unlimited)."""
    if text is None:
        return None
    match = _RATE_RE.fullmatch(text)
    if not match:
        raise ValueError(f"--rate {text!r}: use N, N/s or N/m, e.g. 10/s")
    value = float(match.group(1))
    if value <= 0:
        return None
    unit = (match.group(2) or "s")[0]
    return value / 60.0 if unit == "m" else value


class RateLimiter:
    """Paces calls to ``rate`` per second (a token bucket holding one token: no bursts)."""

    def __init__(
        self,
        rate: float | None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        self.interval = 1.0 / rate if rate else 0.0
        self.clock = clock
        self.sleep = sleep
        self._next: float | None = None

    async def acquire(self) -> float:
        """Wait for the next slot; returns the seconds waited."""
        if not self.interval:
            return 0.0
        now = self.clock()
        if self._next is None or self._next <= now:
            self._next = now + self.interval
            return 0.0
        wait = self._next - now
        self._next += self.interval
        await self.sleep(wait)
        return wait
