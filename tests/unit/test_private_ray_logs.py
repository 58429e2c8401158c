"""The tests' private Ray nodes keep the logs of a start that failed (their temp dir is deleted on stop)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import private_ray
from tests.support.private_ray import keep_session_logs

pytestmark = pytest.mark.unit


def test_the_ray_processes_logs_are_kept_and_only_their_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(private_ray, "KEPT_LOG_BYTES", 10)
    logs = tmp_path / "temp" / "session_2026" / "logs"
    logs.mkdir(parents=True)
    (tmp_path / "temp" / "session_latest").symlink_to(logs.parent)
    (logs / "raylet.out").write_text("start ... Failed to register\n")
    (logs / "gcs_server.err").write_text("")
    (logs / "events").mkdir()
    (logs / "worker.pid").write_text("1")

    keep_session_logs(tmp_path / "temp", tmp_path / "kept")

    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["gcs_server.err", "raylet.out"]
    assert (tmp_path / "kept" / "raylet.out").read_text() == " register\n"


def test_a_node_that_never_made_a_session_leaves_nothing_to_keep(tmp_path: Path) -> None:
    keep_session_logs(tmp_path / "temp", tmp_path / "kept")
    assert not (tmp_path / "kept").exists()


def test_a_head_is_ready_only_once_its_ray_client_server_listens(tmp_path: Path) -> None:
    """``ray start --block`` stops the head when its Ray Client server gives up waiting for the node,
    a second after the node listed itself ALIVE: until that server listens the head is not ready."""
    import json
    import socket

    from tests.support.private_ray import PrivateRay
    from tests.support.scripted_http import ScriptedHttpServer

    dashboard = ScriptedHttpServer()
    nodes = {"data": {"result": {"result": [{"node_id": "n1", "is_head_node": True, "state": "ALIVE"}]}}}
    dashboard.answers[("GET", "/api/jobs/")] = (200, b"[]")
    dashboard.answers[("GET", "/api/v0/nodes?limit=100&detail=true")] = (200, json.dumps(nodes).encode())
    head = PrivateRay(tmp_path)
    head.dashboard = dashboard.port
    try:
        assert not head._ready()  # Jobs API and ALIVE node, but nothing on the client port
        with socket.socket() as client:
            client.bind(("127.0.0.1", head.client))
            client.listen()
            assert head._ready()
    finally:
        dashboard.close()
