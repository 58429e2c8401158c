"""What the state store hands out and takes: a batch's record, and the results of intake and transitions.

Plain values with no Redis in them, so the pure domain (events, job specs, outcomes) can read a batch's
record without importing the store (:mod:`llmbatch.dispatcher.state.store`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from llmbatch.dispatcher.domain.keys import BatchKey, split_batch_key
from llmbatch.dispatcher.domain.states import State


@dataclass(frozen=True)
class BatchRecord:
    """A snapshot of one batch hash (all values are the strings Redis stores). ``key`` is what the
    store names it by (:func:`llmbatch.dispatcher.domain.keys.batch_key`); ``batch_id`` the id its request
    gave."""

    key: BatchKey
    state: State
    version: int
    fields: Mapping[str, str]

    @classmethod
    def from_hash(cls, key: BatchKey, data: Mapping[str, str]) -> BatchRecord:
        return cls(key, State(data["state"]), int(data.get("version", "0")), dict(data))

    @property
    def batch_id(self) -> str:
        """The batch id the request gave (without its tenant)."""
        return self.fields.get("batch_id") or split_batch_key(self.key)[1]

    def get(self, name: str, default: str | None = None) -> str | None:
        value = self.fields.get(name)
        return default if value in (None, "") else value

    def number(self, name: str) -> float | None:
        value = self.get(name)
        return float(value) if value is not None else None

    def flag(self, name: str) -> bool:
        return self.fields.get(name) == "1"

    @property
    def tenant(self) -> str:
        """The tenant the batch belongs to (``default`` when its request named none)."""
        return self.fields.get("tenant") or split_batch_key(self.key)[0]

    @property
    def generation(self) -> int:
        return int(self.fields.get("generation", "0") or 0)

    @property
    def attempt(self) -> int:
        return int(self.fields.get("attempt", "0") or 0)

    @property
    def attempts_made(self) -> int:
        """Attempts of the current lifecycle (attempt numbers keep counting across a reopen)."""
        return max(0, self.attempt - int(self.fields.get("attempt_base", "0") or 0))

    @property
    def submission_id(self) -> str | None:
        return self.get("submission_id")

    @property
    def deadline(self) -> float | None:
        return self.number("deadline")

    def json_field(self, name: str) -> Any:
        value = self.get(name)
        return orjson.loads(value) if value is not None else None


@dataclass(frozen=True)
class IntakeItem:
    """One batch to create (state ``queued``) or to record as rejected (``dead_lettered``)."""

    key: BatchKey
    fields: Mapping[str, str]
    marker: tuple[str, str]  # (ce_source, dedupe id)
    initial: State = State.QUEUED
    ready_score: float = 0.0
    deadline: float | None = None
    replay_id: str | None = None
    tokens: int = 0  # its estimated tokens (dispatcher.domain.quota), held while it is not ended
    token_limit: int | None = None  # its tenant's limit of enqueued tokens (None: no limit)


@dataclass(frozen=True)
class IntakeResult:
    outcome: str  # created | reopened | duplicate | dup_event | over_quota
    state: State | None
    version: int
    generation: int
    quota: tuple[int, int, int] | None = None  # over_quota: (tokens enqueued, this batch's, the limit)

    @property
    def is_new(self) -> bool:
        return self.outcome in {"created", "reopened"}


@dataclass(frozen=True)
class TransitionResult:
    ok: bool
    outcome: str  # ok | conflict | missing
    state: State | None
    version: int
