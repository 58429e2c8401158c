"""The kubelet stand-in's readiness probes (tests/support/pod_runner.py): a probe that a kubelet
would fail fails here too, and ports are mapped from the pod's to this machine's."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.support.pod_runner import wait_ready

pytestmark = pytest.mark.unit


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        ok = self.path == "/api/local_raylet_healthz" and "Authorization" not in self.headers
        body = b"success" if ok else b"Unauthorized"
        self.send_response(200 if ok else 401)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        return


@pytest.fixture
def agent() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def _pod(probe: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "ray", "readinessProbe": probe}]}}


def test_an_http_probe_passes_on_the_mapped_port(agent: int) -> None:
    probe = {"httpGet": {"path": "/api/local_raylet_healthz", "port": 52365}, "timeoutSeconds": 2}
    assert wait_ready(_pod(probe), {52365: agent}, timeout=5) == "success"


def test_an_http_probe_answered_401_fails(agent: int) -> None:
    probe = {"httpGet": {"path": "/api/jobs/", "port": 52365}, "timeoutSeconds": 2}
    with pytest.raises(AssertionError, match="HTTP 401"):
        wait_ready(_pod(probe), {52365: agent}, timeout=1)


def test_an_exec_probe_runs_with_localhost_pointed_at_the_mapped_port(agent: int) -> None:
    command = [
        "bash",
        "-c",
        "wget --tries 1 -T 2 -q -O- http://localhost:52365/api/local_raylet_healthz | grep success",
    ]
    assert (
        wait_ready(_pod({"exec": {"command": command}, "timeoutSeconds": 2}), {52365: agent}, timeout=5)
        == "success"
    )
    failing = ["bash", "-c", "wget --tries 1 -T 2 -q -O- http://localhost:52365/nothing | grep success"]
    with pytest.raises(AssertionError, match="exit 1"):
        wait_ready(_pod({"exec": {"command": failing}, "timeoutSeconds": 2}), {52365: agent}, timeout=1)


def test_a_probe_on_a_port_the_pod_does_not_map_is_refused() -> None:
    probe = {"httpGet": {"path": "/", "port": 8000}}
    with pytest.raises(AssertionError, match="names port 8000"):
        wait_ready(_pod(probe), {52365: 1}, timeout=1)
