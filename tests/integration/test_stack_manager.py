"""`llmbatch stack`: idempotent start, health, and a stop by PID that leaves nothing running."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from bench.bench_stack import serve_an_app
from llmbatch.stack import manager
from llmbatch.stack.process import alive, stop_tree
from llmbatch.stack.ray_head import QUIET_LOG_MONITOR_ENV
from tests.support.proc_env import environ_of_first

pytestmark = pytest.mark.integration


def _tree(pid: int) -> list[int]:
    return [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]


def test_up_is_idempotent_and_down_stops_everything(tmp_path: Path) -> None:
    names = ["redis", "minio", "kafka", "ray"]
    state = manager.up(tmp_path, names)
    try:
        first = {n: r.pid for n, r in state.services.items()}
        assert set(first) == set(names)
        rows = {r.name: r for r in manager.status(tmp_path)}
        assert all(rows[n].healthy for n in names), rows
        assert all(rows[n].rss_bytes > 0 for n in names)
        # a second `up` reuses the healthy services: same PIDs
        again = manager.up(tmp_path, names)
        assert {n: r.pid for n, r in again.services.items()} == first
        trees = {n: _tree(pid) for n, pid in first.items()}
        assert len(trees["ray"]) > 3, "the Ray head runs gcs, raylet, dashboard... as children"
        # its log monitor looks for new worker logs every 2 s, not every 0.1 s (idle CPU)
        monitor_env = environ_of_first(
            trees["ray"], lambda argv: any(a.endswith("log_monitor.py") for a in argv)
        )
        assert monitor_env is not None, "no log monitor under the Ray head"
        assert QUIET_LOG_MONITOR_ENV.items() <= monitor_env.items()
        # a head running Serve applications stops on SIGTERM: Ray's drain on SIGTERM (30 s by default,
        # for Serve's replicas to move to another node) found no other node here and waited out the
        # stop's 20 s, so every Ray process was SIGKILLed
        ray = state.services["ray"]
        serve_an_app(ray.address, ray.ports["serve"])
        trees["ray"] = _tree(ray.pid)
        assert stop_tree(ray.pid) == [], "Ray processes had to be killed"
    finally:
        stopped = manager.down(tmp_path, names)
    assert sorted(stopped) == sorted(set(names) - {"ray"})  # stopped above
    leftovers = [p for pids in trees.values() for p in pids if alive(p)]
    assert leftovers == [], f"processes left running: {leftovers}"
    assert not any(r.running for r in manager.status(tmp_path))


def test_failed_start_names_the_cause(tmp_path: Path) -> None:
    from llmbatch.stack import services
    from llmbatch.stack.process import StackError, stop_tree

    first = services.start_redis(tmp_path / "a")
    try:
        with pytest.raises(StackError) as info:
            services.start_redis(tmp_path / "b", port=first.ports["redis"])
        assert f"port {first.ports['redis']}" in str(info.value)
    finally:
        stop_tree(first.pid)
