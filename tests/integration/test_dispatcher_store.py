"""The Redis state store against a real Redis: Lua compare-and-set, indexes, dedupe, leases."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import NoReturn

import pytest

from llmbatch.dispatcher.domain.batch_record import IntakeItem
from llmbatch.dispatcher.domain.keys import BatchKey, batch_key
from llmbatch.dispatcher.domain.states import State, TransitionError
from llmbatch.dispatcher.errors import StateStoreUnavailable
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.settings import RedisSettings
from tests.support.clock import Clock
from tests.support.scratch_store import scratch_store

pytestmark = pytest.mark.integration

B1, B2, NOPE = batch_key(None, "b1"), batch_key(None, "b2"), batch_key(None, "nope")


@pytest.fixture
async def store(redis_settings: RedisSettings) -> AsyncIterator[StateStore]:
    async with scratch_store(redis_settings.url, finished_ttl_s=3600, dedupe_ttl_s=3600) as s:
        s.clock = Clock()
        yield s


def item(
    key: BatchKey,
    event: str = "e1",
    *,
    priority_score: float = 1.0,
    replay: str | None = None,
    initial: State = State.QUEUED,
    lifecycle: str | None = None,
) -> IntakeItem:
    fields = {"model": "m", "attempt": "0", "request": "{}", "source": "src", "event_id": event}
    if lifecycle is not None:
        fields["lifecycle"] = lifecycle
    return IntakeItem(
        key=key,
        fields=fields,
        marker=("src", event if replay is None else f"{event}#replay:{replay}"),
        initial=initial,
        ready_score=priority_score,
        deadline=1_790_000_600.0,
        replay_id=replay,
    )


async def test_intake_creates_queued_batch_with_indexes(store: StateStore) -> None:
    [res] = await store.intake_many([item(B1)])
    assert (res.outcome, res.state, res.version, res.generation) == ("created", State.QUEUED, 1, 0)
    rec = await store.get(B1)
    assert rec is not None and rec.state is State.QUEUED and rec.fields["model"] == "m"
    assert await store.ready_ids(10) == ["b1"]
    assert await store.ids_in_state(State.QUEUED) == ["b1"]
    assert await store.queued_count() == 1
    assert await store.due_deadlines(1_790_000_601.0) == ["b1"]
    assert await store.due_deadlines(1_790_000_599.0) == []


async def test_a_projected_read_gives_the_fields_asked_with_state_and_version_and_no_request(
    store: StateStore,
) -> None:
    await store.intake_many([item(B1), item(B2, "e2", lifecycle="L2")])
    one, two, gone = await store.get_fields_many([B1, B2, NOPE], ["model", "lifecycle"])
    assert gone is None
    assert one is not None and one.state is State.QUEUED and one.version == 1
    assert dict(one.fields) == {"state": "queued", "version": "1", "model": "m"}  # no lifecycle: none kept
    assert two is not None and two.get("lifecycle") == "L2" and "request" not in two.fields
    assert await store.get_fields_many([], ["model"]) == []


async def test_a_garbled_state_reads_as_no_batch_in_every_read_not_as_an_error(store: StateStore) -> None:
    """Intake asks the states of the batches its records name: one garbled hash raised ValueError there."""
    await store.intake_many([item(B1), item(B2, "e2")])
    await store.client.hset(store.keys.batch(B1), "state", "not-a-state")
    assert await store.states_many([B1, B2, NOPE]) == [None, State.QUEUED, None]
    assert await store.get(B1) is None and (await store.get_many([B1])) == [None]


async def test_duplicates_never_create_a_second_batch(store: StateStore) -> None:
    results = await store.intake_many([item(B1, "e1"), item(B1, "e1"), item(B1, "e2")])
    assert [r.outcome for r in results] == ["created", "dup_event", "duplicate"]
    assert [r.version for r in results] == [1, 1, 1]
    assert await store.count(State.QUEUED) == 1


async def test_ready_order_is_by_score(store: StateStore) -> None:
    await store.intake_many(
        [
            item(batch_key(None, "late"), "1", priority_score=30.0),
            item(batch_key(None, "first"), "2", priority_score=10.0),
            item(batch_key(None, "mid"), "3", priority_score=20.0),
        ]
    )
    assert await store.ready_ids(2) == ["first", "mid"]


async def test_compare_and_set_checks_version_and_state(store: StateStore) -> None:
    await store.intake(item(B1))
    stale = await store.transition(B1, State.SUBMITTED, expected_version=7)
    assert (stale.ok, stale.outcome, stale.state, stale.version) == (False, "conflict", State.QUEUED, 1)
    ok = await store.transition(B1, State.SUBMITTED, expected_version=1, fields={"attempt": 1})
    assert ok.ok and ok.version == 2
    assert await store.ready_ids(10) == []  # left the ready queue
    wrong_state = await store.transition(B1, State.FINALIZING, from_states=[State.RUNNING])
    assert not wrong_state.ok and wrong_state.state is State.SUBMITTED
    missing = await store.transition(NOPE, State.SUBMITTED)
    assert missing.outcome == "missing"
    rec = await store.get(B1)
    assert rec is not None and rec.version == 2 and rec.attempt == 1


async def test_illegal_transitions_are_refused_before_redis(store: StateStore) -> None:
    await store.intake(item(B1))
    with pytest.raises(TransitionError):
        await store.transition(B1, State.COMPLETED, from_states=[State.QUEUED])


async def test_concurrent_cas_has_exactly_one_winner(store: StateStore) -> None:
    await store.intake(item(B1))
    results = await asyncio.gather(
        *(
            store.transition(B1, State.SUBMITTED, expected_version=1, fields={"winner": str(i)})
            for i in range(20)
        )
    )
    winners = [r for r in results if r.ok]
    assert len(winners) == 1
    rec = await store.get(B1)
    assert rec is not None and rec.version == 2


async def test_terminal_state_is_immutable_and_awaits_publication(store: StateStore) -> None:
    await store.intake(item(B1))
    done = await store.transition(B1, State.CANCELLED, fields={"terminal_event_id": "ev-1"})
    assert done.ok
    assert await store.unpublished_ids() == ["b1"]
    assert await store.due_deadlines(2e9) == []
    for target in (State.QUEUED, State.FAILED, State.SUBMITTED):
        result = await store.transition(B1, target)
        assert not result.ok and result.state is State.CANCELLED
    # the script itself refuses to leave a terminal state even when told the source is allowed
    keys = [
        store.keys.batch(B1),
        store.keys.ready,
        store.keys.delayed,
        store.keys.deadlines,
        store.keys.unpublished,
    ]
    args = [
        "b1",
        "",
        "cancelled",
        "queued",
        "1",
        "{}",
        "[]",
        "",
        "",
        store.keys.prefix + ":state:",
        "cancelled,completed,dead_lettered,expired,failed",
    ]
    reply = await store._scripts.transition(keys=keys, args=args)
    assert reply[0] == "conflict"
    # publication bookkeeping: only with the recorded event id
    assert not await store.mark_published(B1, "other-id")
    assert await store.mark_published(B1, "ev-1")
    assert await store.unpublished_ids() == []
    ttl = await store.client.ttl(store.keys.batch(B1))
    assert 0 < ttl <= 3600


async def test_a_published_batch_keeps_no_request_body(store: StateStore) -> None:
    """The request body (inline requests included) and the original record serve launches and a late
    dead letter; once the terminal event is published, Redis drops them and keeps the bookkeeping."""
    body = '{"batch_id": "b1", "requests": [' + ", ".join(['{"custom_id": "x"}'] * 2000) + "]}"
    fields = {**item(B1).fields, "request": body, "origin": '{"t": "req", "p": 0, "o": 7}', "total": "2000"}
    await store.intake(IntakeItem(B1, fields, ("src", "e1"), deadline=1_790_000_600.0))
    running = await store.get(B1)
    assert running is not None and running.get("request") == body  # needed to launch (and relaunch)
    assert (await store.transition(B1, State.FAILED, fields={"terminal_event_id": "ev-1"})).ok
    assert await store.mark_dlt_written(B1, "ev-1")
    failed = await store.get(B1)
    assert failed is not None and failed.get("request") == body  # still there for the late dead letter
    assert await store.mark_published(B1, "ev-1")
    finished = await store.get(B1)
    assert finished is not None and finished.state is State.FAILED
    assert "request" not in finished.fields and "origin" not in finished.fields
    assert finished.flag("published") and finished.flag("dlt_written") and finished.get("total") == "2000"
    assert finished.get("terminal_event_id") == "ev-1" and finished.get("model") == "m"


async def test_retry_backoff_goes_through_the_delayed_queue(store: StateStore) -> None:
    clock = store.clock
    assert isinstance(clock, Clock)
    await store.intake(item(B1))
    await store.transition(B1, State.SUBMITTED)
    back = await store.transition(B1, State.QUEUED, not_before=clock.now + 30)
    assert back.ok
    assert await store.ready_ids(10) == []
    assert await store.promote_due() == 0
    clock.now += 31
    assert await store.promote_due() == 1
    assert await store.ready_ids(10) == ["b1"]
    rec = await store.get(B1)
    assert rec is not None and rec.state is State.QUEUED


async def test_dead_lettered_batch_reopens_for_a_new_valid_event(store: StateStore) -> None:
    rejected = await store.intake(item(B1, "bad", initial=State.DEAD_LETTERED))
    assert rejected.outcome == "created" and rejected.state is State.DEAD_LETTERED
    assert await store.ready_ids(10) == []
    assert 0 < await store.client.ttl(store.keys.batch(B1)) <= 3600
    again = await store.intake(item(B1, "bad", initial=State.DEAD_LETTERED))
    assert again.outcome == "dup_event"
    fixed = await store.intake(item(B1, "good"))
    assert (fixed.outcome, fixed.state, fixed.generation) == ("reopened", State.QUEUED, 1)
    assert await store.client.ttl(store.keys.batch(B1)) == -1
    assert await store.ids_in_state(State.DEAD_LETTERED) == []


async def test_failed_batch_reopens_only_by_replay_and_keeps_counting_attempts(store: StateStore) -> None:
    await store.intake(item(B1, "e1"))
    await store.transition(B1, State.SUBMITTED, fields={"attempt": 3})
    await store.transition(B1, State.FAILED, fields={"terminal_event_id": "f"})
    plain = await store.intake(item(B1, "e2"))
    assert plain.outcome == "duplicate" and plain.state is State.FAILED
    replayed = await store.intake(item(B1, "e1", replay="r1"))
    assert (replayed.outcome, replayed.generation) == ("reopened", 1)
    rec = await store.get(B1)
    assert rec is not None and rec.attempt == 3 and rec.attempts_made == 0 and rec.get("replay_id") == "r1"
    assert await store.unpublished_ids() == []
    await store.transition(B1, State.SUBMITTED, fields={"attempt": 4})
    await store.transition(B1, State.FAILED, fields={"terminal_event_id": "f2"})
    same_replay = await store.intake(item(B1, "e1-other-source-id", replay="r1"))
    assert same_replay.outcome == "duplicate"  # a redelivered replay does not reopen twice
    completed_replay = await store.intake(item(B1, "e1", replay="r2"))
    assert completed_replay.outcome == "reopened" and completed_replay.generation == 2


async def test_a_replay_keeps_its_lifecycle_a_dead_lettered_batch_takes_a_new_one(store: StateStore) -> None:
    await store.intake(item(B1, "e1", lifecycle="aaa"))
    await store.transition(B1, State.SUBMITTED, fields={"attempt": 2})
    await store.transition(B1, State.FAILED, fields={"terminal_event_id": "f"})
    replayed = await store.intake(item(B1, "e1", replay="r1", lifecycle="bbb"))
    assert replayed.outcome == "reopened"
    rec = await store.get(B1)  # the same results prefix and submission ids: attempt 3 may resume
    assert rec is not None and rec.get("lifecycle") == "aaa" and rec.attempt == 2

    await store.intake(item(B2, "bad", initial=State.DEAD_LETTERED))  # rejected: no lifecycle
    fixed = await store.intake(item(B2, "good", lifecycle="ccc"))
    assert fixed.outcome == "reopened"
    rec = await store.get(B2)
    assert rec is not None and rec.get("lifecycle") == "ccc"


async def test_completed_batch_is_never_reopened(store: StateStore) -> None:
    await store.intake(item(B1))
    for state in (State.SUBMITTED, State.RUNNING, State.FINALIZING, State.COMPLETED):
        assert (await store.transition(B1, state)).ok
    result = await store.intake(item(B1, "e9", replay="r9"))
    assert result.outcome == "duplicate" and result.state is State.COMPLETED


async def test_markers(store: StateStore) -> None:
    assert await store.markers_exist([("s", "1"), ("s", "2")]) == [False, False]
    await store.set_marker(("s", "2"))
    assert await store.markers_exist([("s", "1"), ("s", "2")]) == [False, True]


async def test_lease_is_exclusive_renewable_and_releasable(store: StateStore) -> None:
    assert await store.acquire_lease("tracker", "a", 5)
    assert await store.acquire_lease("tracker", "a", 5)  # renew
    assert not await store.acquire_lease("tracker", "b", 5)
    assert not await store.release_lease("tracker", "b")
    assert await store.release_lease("tracker", "a")
    assert await store.acquire_lease("tracker", "b", 5)


async def test_lease_expires(store: StateStore) -> None:
    assert await store.acquire_lease("tracker", "a", 0.2)
    for _ in range(50):
        if await store.acquire_lease("tracker", "b", 5):
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("lease never expired")


async def test_counts_and_sweep(store: StateStore) -> None:
    clock = store.clock
    assert isinstance(clock, Clock)
    await store.intake_many([item(batch_key(None, "a"), "1"), item(batch_key(None, "b"), "2")])
    await store.transition(batch_key(None, "a"), State.EXPIRED, fields={"terminal_event_id": "x"})
    counts = await store.counts()
    assert counts[State.QUEUED] == 1 and counts[State.EXPIRED] == 1
    clock.now += 3601
    assert await store.sweep_finished() == 1
    assert (await store.counts())[State.EXPIRED] == 0


async def test_redis_down_is_a_retriable_error() -> None:
    from llmbatch.stack.ports import free_port

    s = StateStore.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_timeout=1)
    try:
        with pytest.raises(StateStoreUnavailable) as info:
            await s.get(batch_key(None, "x"))
        assert info.value.retriable is True
    finally:
        await s.close()


async def test_fsync_policy_reads_what_the_server_runs_with(store: StateStore) -> None:
    """The project's Redis runs with appendonly yes + appendfsync always (durable intake); the
    dispatcher warns at start when a Redis does not, and says nothing when CONFIG is refused."""
    assert await store.fsync_policy() == "always"
    await store.client.config_set("appendfsync", "everysec")
    try:
        assert await store.fsync_policy() == "everysec"
    finally:
        await store.client.config_set("appendfsync", "always")

    async def refused(*_: object, **__: object) -> NoReturn:
        raise RuntimeError("ERR unknown command 'CONFIG'")

    store.client.config_get = refused  # type: ignore[method-assign]  # a Redis that refuses CONFIG
    assert await store.fsync_policy() is None


async def test_a_tenants_batches_from_kafka_are_listed_newest_first_and_pruned(store: StateStore) -> None:
    """What ``GET /v1/batches`` lists beside the API's own: accepted batches by tenant, newest
    millisecond first, ids descending within one; not the API's ids, nor a refused request; a cursor
    goes on after any of them; the sweep prunes what no record can still back."""
    clock = store.clock
    assert isinstance(clock, Clock)
    acme = [batch_key("acme", f"k{i}") for i in (1, 2, 3)]
    first = [item(k, f"e-{k}") for k in acme]  # one intake: one millisecond
    first.append(item(batch_key("acme", "batch_00000000000010000000000000000"), "e-api"))
    first.append(item(batch_key("acme", "refused"), "e-refused", initial=State.DEAD_LETTERED))
    first.append(item(batch_key("globex", "k9"), "e-globex"))
    await store.intake_many(first)
    ms1 = int(clock.now * 1000)
    clock.now += 0.25
    await store.intake_many([item(batch_key("acme", "k4"), "e-k4")])
    ms2 = int(clock.now * 1000)

    expected = [("k4", ms2), ("k3", ms1), ("k2", ms1), ("k1", ms1)]
    assert await store.listed("acme", after=None, limit=10) == expected
    assert await store.listed("globex", after=None, limit=10) == [("k9", ms1)]
    for limit in (1, 2, 3):
        paged: list[tuple[str, int]] = []
        while page := await store.listed(
            "acme", after=(paged[-1][1], paged[-1][0]) if paged else None, limit=limit
        ):
            paged += page
        assert paged == expected, limit
    # after every batch of a later millisecond: the whole of ms1 follows
    assert await store.listed("acme", after=(ms1, None), limit=10) == expected[1:]
    assert await store.listed_at("acme", "k2") == ms1
    assert await store.listed_at("acme", "refused") is None
    assert await store.listed_at("acme", "batch_00000000000010000000000000000") is None

    clock.now += 3600 + 7 * 86_400  # the records' TTL and the longest window: not yet
    await store.sweep_finished()
    assert len(await store.listed("acme", after=None, limit=10)) == 4
    clock.now += 86_400 + 1
    await store.sweep_finished()
    assert await store.listed("acme", after=None, limit=10) == []
    assert await store.listed("globex", after=None, limit=10) == []
