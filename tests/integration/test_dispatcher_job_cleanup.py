"""Deleting finished batches' Ray jobs (dispatcher.job_cleanup) against a real Redis; the Ray head is a
stand-in here (the real head's delete is covered by test_dispatcher_tracker's lifecycle test)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from dispatcher import store as store_module
from dispatcher.errors import JobRejected, RayUnavailable
from dispatcher.job_cleanup import JobCleanup
from dispatcher.states import State
from dispatcher.store import BatchRecord, StateStore
from llmbatch.settings import RedisSettings
from tests.support.scratch_store import scratch_store

pytestmark = pytest.mark.integration


@dataclass
class Head:
    """Deletes jobs unless ``down`` (a head or agent that times out) or the id is in ``refuse``."""

    down: bool = False
    refuse: set[str] = field(default_factory=set)
    jobs: set[str] = field(default_factory=set)
    calls: list[str] = field(default_factory=list)

    async def delete(self, submission_id: str) -> bool:
        self.calls.append(submission_id)
        if self.down:
            raise RayUnavailable("Ray delete: TimeoutError")
        if submission_id in self.refuse:
            raise JobRejected("Ray refused delete: 403")
        if submission_id in self.jobs:
            self.jobs.remove(submission_id)
            return True
        return False


class Clock:
    now = 1_790_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def store(redis_settings: RedisSettings) -> AsyncIterator[StateStore]:
    async with scratch_store(redis_settings.url) as s:
        yield s


def finished(batch_id: str, attempts: int, lifecycle: str = "0123456789") -> BatchRecord:
    fields = {"state": "completed", "attempt": str(attempts), "lifecycle": lifecycle}
    return BatchRecord(batch_id, State.COMPLETED, 3, fields)


def sids(batch_id: str, attempts: int, lifecycle: str = "0123456789") -> list[str]:
    return [f"{batch_id}-{lifecycle}-a{n}" for n in range(1, attempts + 1)]


async def test_every_attempt_of_a_finished_batch_is_deleted(store: StateStore) -> None:
    head = Head(jobs=set(sids("b1", 3)))
    cleanup = JobCleanup(store, head, clock=Clock())  # type: ignore[arg-type]
    await cleanup.forget(finished("b1", 3))
    assert head.jobs == set() and head.calls == sids("b1", 3)
    assert await store.due_job_deletes(2e9) == []


async def test_a_delete_the_head_cannot_answer_is_tried_again_later(store: StateStore) -> None:
    head = Head(down=True, jobs=set(sids("b1", 2)))
    clock = Clock()
    cleanup = JobCleanup(store, head, retry_after_s=60, clock=clock)  # type: ignore[arg-type]
    await cleanup.forget(finished("b1", 2))
    assert head.jobs == set(sids("b1", 2)) and cleanup.deferred == 2
    assert await cleanup.retry_due() == 0  # not due yet: nothing asked of the head
    assert head.calls == sids("b1", 1)
    clock.now += 61
    assert await cleanup.retry_due() == 0  # due, the head still down: put off again
    assert await store.due_job_deletes(clock.now) == []
    head.down = False
    clock.now += 61
    assert await cleanup.retry_due() == 2
    assert head.jobs == set() and await store.due_job_deletes(2e9) == []


async def test_a_refused_delete_is_not_retried_and_does_not_hold_back_the_others(store: StateStore) -> None:
    head = Head(jobs=set(sids("b1", 2)), refuse={sids("b1", 2)[0]})
    cleanup = JobCleanup(store, head, clock=Clock())  # type: ignore[arg-type]
    await cleanup.forget(finished("b1", 2))
    assert head.jobs == {sids("b1", 2)[0]} and await store.due_job_deletes(2e9) == []


async def test_the_deletes_waiting_are_bounded(store: StateStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_module, "MAX_JOB_DELETES", 3)
    for n in range(5):
        await store.defer_job_deletes([f"j{n}"], 1000.0 + n)
    assert await store.due_job_deletes(2e9) == ["j2", "j3", "j4"]
    await store.drop_job_deletes(["j3"])
    assert await store.due_job_deletes(1003.0) == ["j2"]
