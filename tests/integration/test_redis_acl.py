"""Least privilege in Redis (issue 14, item 2) on a real Redis loaded with ``llmbatch dispatcher
redis-acl``'s users: the dispatcher runs its state machine (Lua scripts included), a job writes its
progress through ray_job's own writer but can neither read nor write a batch's state, and the
operator reads everything but the jobs' S3 sessions and writes only the replay ledger."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import orjson
import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError

from llmbatch.dispatcher.domain.keys import Keys, batch_key
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.errors import StateStoreUnavailable
from llmbatch.dispatcher.ops.jobs import get_job, list_jobs
from llmbatch.dispatcher.ops.replay import LedgerEntry
from llmbatch.dispatcher.ops.replay_publish import ReplayLedger
from llmbatch.dispatcher.security.redis_acl import Role, acl_lines
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.dispatcher.webhooks.store import Delivery, WebhookStore
from llmbatch.ray_job.batch_runner.run_store import RedisRuns
from llmbatch.ray_job.job.progress import Counters, Progress
from llmbatch.ray_job.storage import job_keys, s3_session
from llmbatch.schemas.webhooks import WebhookEndpoint
from llmbatch.stack import services
from llmbatch.stack.process import alive, stop_tree
from tests.integration.test_dispatcher_tracker import queue

pytestmark = pytest.mark.integration


@dataclass
class AclRedis:
    port: int
    prefix: str
    passwords: dict[str, str]

    def url(self, user: str) -> str:
        return f"redis://{user}@127.0.0.1:{self.port}/0"

    def client(self, user: str) -> redis.Redis:
        return redis.Redis.from_url(self.url(user), password=self.passwords[user], socket_timeout=5)


@pytest.fixture(scope="module")
async def acl_redis(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[AclRedis]:
    prefix = f"acl{uuid.uuid4().hex[:6]}"
    passwords = {role: secrets.token_urlsafe(16) for role in ("dispatcher", "job", "operator")}
    lines = acl_lines(Keys(prefix), passwords)  # type: ignore[arg-type]
    rec = await asyncio.to_thread(
        services.start_redis,
        tmp_path_factory.mktemp("acl"),
        name="redis-acl",
        password=secrets.token_urlsafe(16),
        acl=lines,
    )
    try:
        yield AclRedis(rec.ports["redis"], prefix, passwords)
    finally:
        if alive(rec.pid):
            stop_tree(rec.pid)


async def test_the_dispatcher_user_runs_the_state_machine_and_nothing_dangerous(acl_redis: AclRedis) -> None:
    store = StateStore.from_url(
        acl_redis.url("dispatcher"), password=acl_redis.passwords["dispatcher"], keys=Keys(acl_redis.prefix)
    )
    try:
        await queue(store, "b1", 3)
        record = await store.get(batch_key(None, "b1"))
        assert record is not None and record.state is State.QUEUED
        moved = await store.transition(
            batch_key(None, "b1"), State.SUBMITTED, expected_version=record.version, fields={"attempt": "1"}
        )
        assert moved.ok
        assert await store.fsync_policy() in {"always", "everysec", "no"}  # CONFIG GET is allowed
    finally:
        await store.close()
    plain = acl_redis.client("dispatcher")
    with pytest.raises(NoPermissionError):
        plain.flushall()
    with pytest.raises(NoPermissionError):
        plain.set("other-app:key", "x")  # another deployment's keys


async def test_the_dispatchers_wake_each_others_trackers_on_their_one_channel(acl_redis: AclRedis) -> None:
    """The tracker's wake-up (a Pub/Sub channel): the dispatcher user may say and hear it, nothing else
    may be said by it, and a job can neither say it nor listen."""
    from llmbatch.dispatcher.runs.wakeups import Wakeups

    keys = Keys(acl_redis.prefix)
    store = StateStore.from_url(
        acl_redis.url("dispatcher"), password=acl_redis.passwords["dispatcher"], keys=keys
    )
    woken = asyncio.Event()
    stopping = asyncio.Event()
    wakeups = Wakeups(store, others=lambda: True, wake=woken.set)
    listener = asyncio.create_task(wakeups.listen(stopping))
    try:
        for _ in range(150):  # said until heard: the listener may not have subscribed yet
            await wakeups.tell()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woken.wait(), 0.2)
            if woken.is_set():
                break
        assert woken.is_set() and not listener.done()
        plain = acl_redis.client("dispatcher")
        with pytest.raises(NoPermissionError):
            plain.publish(f"{acl_redis.prefix}:other-channel", "x")
        job = acl_redis.client("job")
        with pytest.raises(NoPermissionError):
            job.publish(keys.tracker_wake, "x")
    finally:
        stopping.set()
        await listener
        await store.close()


async def test_a_job_writes_its_progress_and_cannot_touch_batch_state(
    acl_redis: AclRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = Keys(acl_redis.prefix)
    store = StateStore.from_url(
        acl_redis.url("dispatcher"), password=acl_redis.passwords["dispatcher"], keys=keys
    )
    try:
        await queue(store, "b2", 4)
        # the job connects as its own user; its password is in the Ray node's environment
        monkeypatch.setenv("LLMBATCH_REDIS__PASSWORD", acl_redis.passwords["job"])
        progress = Progress(
            acl_redis.url("job"),
            keys.progress(batch_key(None, "b2")),
            attempt=1,
            interval_s=60,
            base=Counters(completed=2, total=4),
        )
        try:
            progress.publish()
            assert progress.writes == 1 and progress.still_current()
        finally:
            progress.close()
        assert (await store.read_progress(batch_key(None, "b2")))["completed"] == "2"
    finally:
        await store.close()
    job = acl_redis.client("job")
    batch = keys.batch(batch_key(None, "b2"))
    for forbidden in (
        lambda: job.hset(batch, "state", "completed"),
        lambda: job.hgetall(batch),
        lambda: job.delete(keys.ready),
        lambda: job.keys("*"),
        lambda: job.flushall(),
        lambda: job.hset(keys.progress(batch_key(None, "x")).replace(":progress:", ":batch:"), "state", "x"),
    ):
        with pytest.raises(NoPermissionError):
            forbidden()


async def test_a_job_takes_its_s3_session_once_and_nothing_else_of_the_sessions(
    acl_redis: AclRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dispatcher keeps an attempt's S3 session; the job's user takes it with GETDEL through
    ray_job's own fetch, once, and can neither list the sessions nor read one without taking it."""
    keys = Keys(acl_redis.prefix)
    store = StateStore.from_url(
        acl_redis.url("dispatcher"), password=acl_redis.passwords["dispatcher"], keys=keys
    )
    secret = secrets.token_urlsafe(12)
    session = {"access_key": "AK", "secret_key": secret, "session_token": "tok", "expires_at": None}
    try:
        await store.put_s3_session("n1", orjson.dumps(session), 60)
        await store.put_s3_session("n2", orjson.dumps(session), 60)
        with pytest.raises(StateStoreUnavailable, match="exists already"):
            await store.put_s3_session("n1", b"{}", 60)  # never over another
        await store.put_s3_session("bad", b'{"access_key": "AK"}', 60)
    finally:
        await store.close()
    monkeypatch.setenv("LLMBATCH_REDIS__PASSWORD", acl_redis.passwords["job"])
    taken = s3_session.fetch(acl_redis.url("job"), keys.s3_session("n1"))
    assert taken.secret_key.get_secret_value() == secret
    with pytest.raises(s3_session.SessionMissingError, match="not in Redis") as missing:
        s3_session.fetch(acl_redis.url("job"), keys.s3_session("n1"))  # taken already
    assert secret not in str(missing.value)
    with pytest.raises(s3_session.SessionMissingError, match=r"unreadable \(secret_key, session_token\)"):
        s3_session.fetch(acl_redis.url("job"), keys.s3_session("bad"))
    job = acl_redis.client("job")
    for forbidden in (
        lambda: job.get(keys.s3_session("n2")),
        lambda: job.keys(keys.s3_session("*")),
        lambda: job.scan(match=keys.s3_session("*")),
        lambda: job.set(keys.s3_session("n3"), "x"),
        lambda: job.getdel(keys.batch(batch_key(None, "b1"))),
    ):
        with pytest.raises(NoPermissionError):
            forbidden()


def test_the_batch_runner_keeps_its_runs_as_the_jobs_user_and_nothing_else(acl_redis: AclRedis) -> None:
    """The runner (the jobs' Redis user, on the Ray nodes) claims, saves, reads and stops its runs under
    ``<p>:runner:*`` through the real store, and cannot use those commands on any other key."""
    keys = Keys(acl_redis.prefix)
    job = acl_redis.client("job")
    runs = RedisRuns(job, acl_redis.prefix, "r1")
    runs.beat()
    assert runs.claim("s-a1", {"status": "RUNNING", "owner": "r1"})
    assert runs.ask_stop("s-a1") is True and runs.stops_asked(["s-a1"]) == {"s-a1"}
    runs.forget("s-a1")
    runs.save("s-a1", {"status": "SUCCEEDED", "owner": "r1"})
    assert runs.views(["s-a1"])["s-a1"] == {"status": "SUCCEEDED", "owner": "r1"}
    for forbidden in (
        lambda: job.set(keys.batch(batch_key(None, "b1")), "x"),
        lambda: job.get(keys.lease("tracker")),
        lambda: job.mget([keys.batch(batch_key(None, "b1"))]),
        lambda: job.delete(keys.ready),
        lambda: job.keys(job_keys.runner_prefix(acl_redis.prefix) + "*"),
    ):
        with pytest.raises(NoPermissionError):
            forbidden()


async def test_the_operator_reads_all_but_s3_sessions_and_writes_only_the_replay_ledger(
    acl_redis: AclRedis,
) -> None:
    keys = Keys(acl_redis.prefix)
    store = StateStore.from_url(
        acl_redis.url("dispatcher"), password=acl_redis.passwords["dispatcher"], keys=keys
    )
    try:
        await queue(store, "b3", 1)
        await store.put_s3_session("op", b"{}", 60)
    finally:
        await store.close()
    operator = aioredis.Redis.from_url(acl_redis.url("operator"), password=acl_redis.passwords["operator"])
    try:
        assert (await operator.hgetall(keys.batch(batch_key(None, "b3"))))[b"state"] == b"queued"
        assert await operator.zcard(keys.ready) >= 1
        assert await operator.zcard(keys.state_index(State.QUEUED)) >= 1
        await operator.hset(keys.replay_ledger("t.dlt"), "0:1", "{}")
        # what `llmbatch dlq replay` writes, as the operator: an entry, its time, the pruning of old ones
        as_replayer = StateStore.from_url(
            acl_redis.url("operator"), password=acl_redis.passwords["operator"], keys=keys
        )
        try:
            ledger = ReplayLedger(as_replayer, "t.dlt")
            old = LedgerEntry(
                replay_id="r0", round=1, at=datetime(2026, 1, 1, tzinfo=UTC), by="op", to_topic="t"
            )
            await ledger.record("0:2", old)
            await ledger.record("0:3", old.model_copy(update={"at": datetime(2026, 6, 1, tzinfo=UTC)}))
            assert set(await ledger.entries(["0:2", "0:3"])) == {"0:3"}  # the old one was pruned
        finally:
            await as_replayer.close()
        with pytest.raises(NoPermissionError):
            await operator.get(keys.s3_session("op"))  # a job's S3 keys are no operator's business
        # what `llmbatch jobs list/get` run, as the operator
        as_operator = StateStore.from_url(
            acl_redis.url("operator"), password=acl_redis.passwords["operator"], keys=keys
        )
        try:
            assert "b3" in [job.batch_id for job in await list_jobs(as_operator)]
            detail = await get_job(as_operator, "b3")
            assert detail is not None and detail.state is State.QUEUED
        finally:
            await as_operator.close()
        with pytest.raises(NoPermissionError):
            await operator.hset(keys.batch(batch_key(None, "b3")), "state", "cancelled")
        with pytest.raises(NoPermissionError):
            await operator.delete(keys.ready)
        # the HTTP API (as the operator) manages the tenants' webhook endpoints, and nothing of the queue
        endpoint = WebhookEndpoint(
            id="whep_" + "c" * 24, tenant="acme", url="https://h.example.com", created_at=1
        )
        hooks = WebhookStore(operator, keys)
        await hooks.put_endpoint(endpoint)
        assert await hooks.endpoints("acme") == [endpoint]
        assert await hooks.delete_endpoint("acme", endpoint.id)
        assert await hooks.dead() == [] and await hooks.depth() == 0  # `llmbatch webhooks` reads
        with pytest.raises(NoPermissionError):
            await operator.zadd(keys.webhook_due, {"whd_x": 1})
    finally:
        await operator.aclose()


async def test_the_dispatcher_user_runs_the_webhook_queue(acl_redis: AclRedis) -> None:
    dispatcher = aioredis.Redis.from_url(
        acl_redis.url("dispatcher"), password=acl_redis.passwords["dispatcher"]
    )
    try:
        hooks = WebhookStore(dispatcher, Keys(acl_redis.prefix))
        delivery = Delivery("acme", "whep_" + "d" * 24, "evt-1", "batch.completed", 1, "b")
        assert await hooks.enqueue([delivery], 1_000) == 1
        ((_, did, token),) = await hooks.claim(1_000, 60_000, 10)
        assert await hooks.settle(did, token, "delivered", now_ms=1_001)
    finally:
        await dispatcher.aclose()


def test_acl_file_lines_hold_no_password(tmp_path: Path) -> None:
    passwords: dict[Role, str] = {"dispatcher": "pw-dispatcher-1", "job": "pw-job-2"}
    lines = acl_lines(Keys("p"), passwords)
    assert [line.split()[1] for line in lines] == ["dispatcher", "job"]
    assert not [p for p in passwords.values() if any(p in line for line in lines)]
    with pytest.raises(ValueError, match="unknown Redis role 'admin'"):
        acl_lines(Keys("p"), {"admin": "x"})  # type: ignore[dict-item]
