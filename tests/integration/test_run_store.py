"""The batch runner's runs in a real Redis (:class:`~llmbatch.ray_job.batch_runner.run_store.RedisRuns`): any
replica answers for any run, a run of a replica that stopped beating is unknown, a stop asked of one replica
reaches the owner, and what Redis holds is not trusted."""

from __future__ import annotations

import secrets

import pytest
import redis

from llmbatch.ray_job.batch_runner.run_store import RedisRuns
from llmbatch.ray_job.storage import job_keys
from llmbatch.settings import RedisSettings

pytestmark = pytest.mark.integration


@pytest.fixture
def client(redis_settings: RedisSettings) -> redis.Redis:
    return redis.Redis.from_url(redis_settings.url, password=redis_settings.effective_password())


def test_runs_are_shared_by_the_replicas_and_orphans_turn_unknown(client: redis.Redis) -> None:
    prefix = "runstore-" + secrets.token_hex(4)
    one, two = RedisRuns(client, prefix, "r1"), RedisRuns(client, prefix, "r2")
    one.beat()
    two.beat()
    assert one.claim("s-a1", {"status": "RUNNING", "owner": "r1"})
    assert not two.claim("s-a1", {"status": "PENDING", "owner": "r2"})  # a second submit: no second run
    assert two.views(["s-a1", "never"]) == {"s-a1": {"status": "RUNNING", "owner": "r1"}, "never": None}
    # a stop asked of the other replica reaches the owner's poll
    assert two.ask_stop("s-a1") is True
    assert one.stops_asked(["s-a1"]) == {"s-a1"}
    one.forget("s-a1")
    assert one.stops_asked(["s-a1"]) == set()
    # the owner stops beating (killed): its open run is unknown, the dispatcher retries it as lost
    client.delete(job_keys.replica_key(prefix, "r1"))
    assert two.views(["s-a1"]) == {"s-a1": None}
    assert two.ask_stop("s-a1") is None
    # an ended run stays answerable whoever owned it
    two.claim("s-a2", {"status": "RUNNING", "owner": "r1"})
    two.save("s-a2", {"status": "SUCCEEDED", "owner": "r1", "driver_exit_code": 0})
    assert two.views(["s-a2"])["s-a2"] == {"status": "SUCCEEDED", "owner": "r1", "driver_exit_code": 0}
    assert two.ask_stop("s-a2") is False
    ttl = client.ttl(job_keys.run_key(prefix, "s-a2"))
    assert ttl > 86400  # days, not the hour the replica's memory kept it
    client.delete(*client.keys(prefix + ":*"))


@pytest.mark.parametrize("stored", [b"{not json", b"[1, 2]", b'{"status": 5}', b"\xff\xfe"])
def test_what_redis_holds_is_not_trusted(client: redis.Redis, stored: bytes) -> None:
    prefix = "runstore-" + secrets.token_hex(4)
    runs = RedisRuns(client, prefix, "r1")
    client.set(job_keys.run_key(prefix, "s-a1"), stored)
    assert runs.views(["s-a1"]) == {"s-a1": None}
    client.delete(job_keys.run_key(prefix, "s-a1"))
