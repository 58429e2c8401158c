"""Redis keeps data across a restart (AOF), as the state store relies on."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest
import redis

from llmbatch.settings import RedisSettings
from llmbatch.stack import services as stack_services
from llmbatch.stack.process import StackError, alive, stop_tree

pytestmark = pytest.mark.integration


def _wait_dead(pid: int) -> None:
    for _ in range(100):
        if not alive(pid):
            return
        time.sleep(0.05)
    raise AssertionError(f"redis pid {pid} still alive after SIGKILL")


def test_shared_redis_answers(redis_settings: RedisSettings) -> None:
    client = redis.Redis.from_url(redis_settings.url)
    client.set("llmbatch:test:ping", "pong")
    assert client.get("llmbatch:test:ping") == b"pong"
    assert client.config_get("appendonly")["appendonly"] == "yes"


def test_data_survives_restart_with_aof(tmp_path: Path) -> None:
    # a private server: restarting the shared one would disturb other tests
    run_dir = tmp_path / "redis-aof"
    rec = stack_services.start_redis(run_dir, name="redis-aof")
    port = rec.ports["redis"]
    try:
        client = redis.Redis(host="127.0.0.1", port=port)
        client.hset("batch:1", mapping={"state": "running", "version": "3"})
        client.zadd("idx:running", {"1": 1.0})
        # appendfsync always: a write is on disk before its reply, so a SIGKILL right after loses
        # nothing (everysec may keep the newest writes in the AOF buffer for up to 2 s: seen in CI)
        assert client.config_get("appendfsync")["appendfsync"] == "always"
        client.close()
        # a hard kill, not a clean shutdown: only the append-only file can bring the data back
        os.kill(rec.pid, signal.SIGKILL)
        _wait_dead(rec.pid)
        # the same data dir; the old port if it is still free, else a fresh one (another process
        # may take a freed port at any time): the client follows the record either way
        rec = stack_services.start_redis(run_dir, port=port, name="redis-aof", fresh_port_if_taken=True)
        client = redis.Redis(host="127.0.0.1", port=rec.ports["redis"])
        assert client.hgetall("batch:1") == {b"state": b"running", b"version": b"3"}
        assert client.zscore("idx:running", "1") == 1.0
        client.close()
    finally:
        stop_tree(rec.pid)


def test_restart_moves_to_a_fresh_port_when_the_old_one_was_taken(tmp_path: Path) -> None:
    run_dir = tmp_path / "redis-moved"
    rec = stack_services.start_redis(run_dir, name="redis-moved")
    port = rec.ports["redis"]
    squatter = socket.socket()
    try:
        client = redis.Redis(host="127.0.0.1", port=port)
        client.set("kept", "yes")
        client.close()
        os.kill(rec.pid, signal.SIGKILL)
        _wait_dead(rec.pid)
        squatter.bind(("127.0.0.1", port))  # another process takes the freed port
        squatter.listen()
        with pytest.raises(StackError, match=f"port {port}"):
            stack_services.start_redis(run_dir, port=port, name="redis-moved")
        rec = stack_services.start_redis(run_dir, port=port, name="redis-moved", fresh_port_if_taken=True)
        assert rec.ports["redis"] != port and rec.address == f"redis://127.0.0.1:{rec.ports['redis']}/0"
        client = redis.Redis.from_url(rec.address)
        assert client.get("kept") == b"yes"  # same data dir, new address
        client.close()
    finally:
        squatter.close()
        stop_tree(rec.pid)
