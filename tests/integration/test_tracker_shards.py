"""Dispatcher replicas share the tracker's work on a real Redis: one launching leader, the in-flight
batches' shards split between the live replicas (each checking and ending only its own), handed over
when a replica leaves or dies."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from pydantic import SecretStr

from llmbatch.dispatcher.backends.backend import JobInfo, JobState
from llmbatch.dispatcher.domain.keys import Keys, batch_key
from llmbatch.dispatcher.domain.shards import shard_of
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.metrics import Metrics
from llmbatch.dispatcher.runs.context import RunContext
from llmbatch.dispatcher.runs.leases import TrackerLeases
from llmbatch.dispatcher.runs.tracker import Tracker
from llmbatch.dispatcher.settings import DispatcherOptions, DispatcherSettings
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.schemas.engines import EngineRegistry
from llmbatch.settings import RedisSettings
from tests.integration.test_dispatcher_tracker import ENTRY, Jobs, drop, queue
from tests.support.dispatcher_kit import wait_for
from tests.support.scratch_store import scratch_store

pytestmark = pytest.mark.integration

SHARDS = 16


@pytest.fixture
async def store(redis_settings: RedisSettings) -> AsyncIterator[StateStore]:
    async with scratch_store(redis_settings.url, finished_ttl_s=3600, dedupe_ttl_s=3600) as s:
        yield s


def replicas(store: StateStore, n: int, ttl_s: float = 15.0) -> list[TrackerLeases]:
    return [
        TrackerLeases(store, Metrics(), token=f"r{i}/{uuid.uuid4().hex[:6]}", ttl_s=ttl_s, shard_count=SHARDS)
        for i in range(n)
    ]


async def settle(live: list[TrackerLeases], rounds: int = 6) -> None:
    """Each replica steps, in turn, ``rounds`` times (a shard moves once its old holder gave it back)."""
    for _ in range(rounds):
        for replica in live:
            await replica.step()


def assert_split(live: list[TrackerLeases]) -> None:
    every = [s for r in live for s in r.shards]
    assert sorted(every) == list(range(SHARDS)), [sorted(r.shards) for r in live]
    sizes = [len(r.shards) for r in live]
    assert max(sizes) - min(sizes) <= 1, sizes
    assert sum(r.is_leader for r in live) == 1


async def test_three_replicas_split_the_shards_evenly_and_one_leads(store: StateStore) -> None:
    live = replicas(store, 3)
    await live[0].step()
    assert len(live[0].shards) == SHARDS and live[0].is_leader  # alone, it takes everything
    await settle(live)
    assert_split(live)
    assert [r.members for r in live] == [3, 3, 3]
    assert [r.metrics.shards._value.get() for r in live] == [len(r.shards) for r in live]


async def test_a_replica_that_stops_hands_its_shards_and_the_lead_over_at_the_others_next_step(
    store: StateStore,
) -> None:
    live = replicas(store, 3)
    await settle(live)
    leader = next(r for r in live if r.is_leader)
    await leader.release()
    assert not leader.shards and not leader.is_leader
    rest = [r for r in live if r is not leader]
    await settle(rest, rounds=2)
    assert_split(rest)


async def test_a_dead_replica_s_shards_move_once_its_leases_expire(store: StateStore) -> None:
    live = replicas(store, 3, ttl_s=1.0)
    await settle(live)
    dead, rest = live[0], live[1:]  # it stops renewing: a crash, a frozen process

    async def taken_over() -> bool:
        await settle(rest, rounds=1)
        return sorted(s for r in rest for s in r.shards) == list(range(SHARDS))

    await wait_for(taken_over, 30, interval=0.2, what="the others to take the dead replica's shards")
    assert_split(rest)
    assert dead.shards  # what it believes: the next step of a replica that wakes up corrects it
    await settle(live)
    assert_split(live)  # it takes part again


@dataclass
class Watched(Jobs):
    """The job backend of one replica: which attempts it asked about."""

    asked: set[str] = field(default_factory=set)

    async def status(self, submission_id: str) -> JobInfo:
        self.asked.add(submission_id)
        return JobInfo(JobState.RUNNING)


async def test_each_replica_submits_and_checks_only_the_in_flight_batches_of_its_own_shards(
    redis_settings: RedisSettings,
) -> None:
    """Before the shards, the leader submitted and every poll of the leader checked every batch in
    flight (and no other replica did either): here the leader decides all 40 launches and submits its
    own shards' batches; the other replica submits its shards' at its next check, without asking the
    backend about an attempt that was never sent; then each checks its half, and together all, once."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    settings = DispatcherSettings(
        _env_file=None,
        redis=RedisSettings(url=redis_settings.url, password=SecretStr(""), key_prefix=prefix),
        dispatcher=DispatcherOptions(shared_engines=False, max_in_flight=100, tracker_shards=SHARDS),
        engines=EngineRegistry(models={"a": ENTRY}),
    )
    stores: list[StateStore] = []
    trackers: list[Tracker] = []
    backends: list[Watched] = []
    unused: Any = None  # nothing here reads results or publishes
    for _ in range(2):
        store = StateStore.from_url(redis_settings.url, keys=Keys(prefix), finished_ttl_s=3600)
        backend = Watched()
        jobs: Any = backend
        stores.append(store)
        backends.append(backend)
        trackers.append(Tracker(RunContext(settings, store, jobs, unused, unused, Metrics())))
    try:
        await settle([t.leases for t in trackers])
        assert_split([t.leases for t in trackers])
        leader = next(t for t in trackers if t.is_leader)
        for i in range(40):
            await queue(stores[0], f"b{i}", 2, offset=i)
        await leader.launch()
        launched = await stores[0].get_many(await stores[0].ids_in_state(State.SUBMITTED))
        submitted = {r.submission_id or "": r.key for r in launched if r is not None}
        assert len(submitted) == 40

        def shard_part(tracker: Tracker) -> set[str]:
            return {sid for sid, key in submitted.items() if shard_of(key, SHARDS) in tracker.leases.shards}

        def sent(backend: Watched) -> set[str]:
            return {spec.submission_id for spec in backend.submitted}

        assert sent(leader_backend(trackers, backends)) == shard_part(leader)
        for tracker in trackers:
            await tracker.poll_in_flight()
        for tracker, backend in zip(trackers, backends, strict=True):
            assert sent(backend) == shard_part(tracker) and len(backend.submitted) == len(shard_part(tracker))
            # the leader asks about what it sent; an attempt never sent is not asked about
            assert backend.asked == (shard_part(tracker) if tracker is leader else set())
            assert shard_part(tracker)  # each has some: the split is even
        confirmed = await stores[0].get_many(await stores[0].ids_in_state(State.SUBMITTED))
        assert all(r is not None and r.flag("confirmed") for r in confirmed)
        for backend in backends:
            backend.asked.clear()
        for tracker in trackers:
            await tracker.poll_in_flight()
        for tracker, backend in zip(trackers, backends, strict=True):
            assert backend.asked == shard_part(tracker)
        assert backends[0].asked | backends[1].asked == set(submitted)
    finally:
        for tracker in trackers:
            await tracker.leases.release()
        await drop(stores[0])
        await stores[1].close()


def leader_backend(trackers: list[Tracker], backends: list[Watched]) -> Watched:
    return next(b for t, b in zip(trackers, backends, strict=True) if t.is_leader)


async def test_a_batch_accepted_by_one_replica_is_launched_and_tracked_by_the_others_at_once(
    redis_settings: RedisSettings,
) -> None:
    """The replicas poll once an hour here: only the wake-ups move the batch from the replica that
    accepted it to the launching leader, and from the leader to its shard's holder."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    settings = DispatcherSettings(
        _env_file=None,
        redis=RedisSettings(url=redis_settings.url, password=SecretStr(""), key_prefix=prefix),
        dispatcher=DispatcherOptions(
            shared_engines=False, tracker_shards=SHARDS, poll_interval_s=3600, lease_ttl_s=3
        ),
        engines=EngineRegistry(models={"a": ENTRY}),
    )
    unused: Any = None
    stores = [
        StateStore.from_url(redis_settings.url, keys=Keys(prefix), finished_ttl_s=3600) for _ in range(2)
    ]
    jobs: list[Any] = [Watched(), Watched()]
    trackers = [
        Tracker(RunContext(settings, store, backend, unused, unused, Metrics()))
        for store, backend in zip(stores, jobs, strict=True)
    ]
    runs = [asyncio.create_task(t.run()) for t in trackers]
    try:

        def split_settled() -> bool:
            leases = [t.leases for t in trackers]
            return sum(len(x.shards) for x in leases) == SHARDS and all(x.shards for x in leases)

        await wait_for(split_settled, 60, interval=0.2, what="the two replicas to share the shards")
        follower = next(t for t in trackers if not t.is_leader)
        await queue(stores[0], "woken", 2)
        follower.accepted()  # what its consumer does after queueing a batch

        async def running() -> bool:
            record = await stores[0].get(batch_key("default", "woken"))
            return record is not None and record.state is State.RUNNING

        await wait_for(running, 60, interval=0.2, what="the batch to be launched and seen running")
        assert not any(run.done() for run in runs)
        assert all(t.wakeups.heard for t in trackers)
    finally:
        for tracker in trackers:
            tracker.request_stop()
        await asyncio.gather(*runs)
        await drop(stores[0])
        await stores[1].close()
