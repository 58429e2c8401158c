"""Ray's HTTP hops over TLS, on real sockets without Ray: the settings (https addresses, the CA bundle,
Serve's certificate), the Serve config that turns on TLS in Serve's proxy, the dashboard's TLS front
(:mod:`llmbatch.stack.tls_front`) relaying to a plain HTTP server, and the clients (Serve API, batch
runner) verifying it with the CA and sending Ray's token only to the dashboard. A real Ray head behind
them: tests/e2e/test_tls_e2e.py."""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError

from llmbatch.dispatcher.backends.engines import cluster_serve_config, serve_config
from llmbatch.dispatcher.backends.runner_backend import RunnerClient
from llmbatch.dispatcher.backends.serve_api import PATH, ServeApi
from llmbatch.dispatcher.errors import RayUnavailable
from llmbatch.dispatcher.settings import DispatcherSettings
from llmbatch.ray_job.batch_runner.runner_http import ROUTE_PREFIX
from llmbatch.schemas.engines import EngineRegistry
from llmbatch.settings import RaySettings
from llmbatch.stack import tls_front
from llmbatch.stack.tls import TlsFiles, make_local_ca
from tests.support.scripted_http import ScriptedHttpServer

pytestmark = pytest.mark.unit

TOKEN = "ray-token-" + "x" * 24


# --- settings and the Serve config ------------------------------------------------------------------


def test_an_https_serve_address_needs_the_certificate_and_key_and_names_the_settings() -> None:
    both = "LLMBATCH_RAY__SERVE_SSL_CERTFILE and LLMBATCH_RAY__SERVE_SSL_KEYFILE"
    with pytest.raises(ValidationError, match=both):
        RaySettings(serve_address="https://ray-head:8000", serve_ssl_certfile="/tls/tls.crt")
    with pytest.raises(ValidationError, match="need an https://"):
        RaySettings(serve_ssl_certfile="/tls/tls.crt", serve_ssl_keyfile="/tls/tls.key")
    with pytest.raises(ValidationError, match="LLMBATCH_RAY__ADDRESS must be an http:// or https://"):
        RaySettings(address="ray://ray-head:10001")
    ray = RaySettings(
        address="https://ray-head:8443/",
        serve_address="https://ray-head:8000",
        serve_ssl_certfile="/tls/tls.crt",
        serve_ssl_keyfile="/tls/tls.key",
    )
    assert ray.address == "https://ray-head:8443"


def test_the_serve_config_turns_on_tls_in_serves_proxy_exactly_for_https() -> None:
    plain = serve_config(EngineRegistry(models={}), http_address="http://127.0.0.1:8000")
    assert plain["http_options"] == {"host": "127.0.0.1", "port": 8000}
    tls = serve_config(
        EngineRegistry(models={}), http_address="https://ray-head", ssl_files=("/tls/tls.crt", "/tls/tls.key")
    )
    assert tls["http_options"] == {
        "host": "0.0.0.0",
        "port": 443,
        "ssl_certfile": "/tls/tls.crt",
        "ssl_keyfile": "/tls/tls.key",
    }
    with pytest.raises(ValueError, match="exactly when it is https"):
        serve_config(EngineRegistry(models={}), http_address="https://ray-head:8000")
    with pytest.raises(ValueError, match="exactly when it is https"):
        serve_config(EngineRegistry(models={}), http_address="http://ray-head:8000", ssl_files=("a", "b"))
    settings = DispatcherSettings.model_validate(
        {
            "ray": {
                "serve_address": "https://ray-head:8000",
                "serve_ssl_certfile": "/tls/tls.crt",
                "serve_ssl_keyfile": "/tls/tls.key",
            }
        }
    )
    options = cluster_serve_config(settings)["http_options"]
    assert (options["ssl_certfile"], options["ssl_keyfile"]) == ("/tls/tls.crt", "/tls/tls.key")
    assert options["port"] == 8000


# --- the TLS front and the clients, on real sockets ------------------------------------------------


class _Front:
    """A :class:`tls_front.TlsFront` on its own event loop thread."""

    def __init__(self, target_port: int, files: TlsFiles) -> None:
        self.loop = asyncio.new_event_loop()
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = int(probe.getsockname()[1])
        self.front = tls_front.TlsFront(
            target_port, tls_front.server_context(str(files.server_cert), str(files.server_key))
        )
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            started = asyncio.Event()
            task = self.loop.create_task(self.front.serve(self.port, started))
            self.loop.run_until_complete(started.wait())
            ready.set()
            self.loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
            rest = asyncio.all_tasks(self.loop)  # connections still open: end them too
            for left in rest:
                left.cancel()
            self.loop.run_until_complete(asyncio.gather(*rest, return_exceptions=True))
            self.loop.close()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(10)
        self.address = f"https://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(lambda: [task.cancel() for task in asyncio.all_tasks(self.loop)])
        self.thread.join(10)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_local_ca(tmp_path_factory.mktemp("ray-https"))


@pytest.fixture
def plain() -> Iterator[ScriptedHttpServer]:
    """A plain HTTP server that answers every request with ``{}`` (the runner's engines with none)."""
    server = ScriptedHttpServer(default=(200, b"{}"))
    server.answers[("GET", ROUTE_PREFIX + "/engines")] = (200, b'{"engines": {}}')
    yield server
    server.close()


@pytest.fixture
def front(plain: ScriptedHttpServer, files: TlsFiles) -> Iterator[_Front]:
    relay = _Front(plain.port, files)
    yield relay
    relay.stop()


def test_the_serve_api_reaches_the_dashboard_through_the_front_with_the_ca_and_the_token(
    plain: ScriptedHttpServer, front: _Front, files: TlsFiles
) -> None:
    ray = RaySettings(address=front.address, ca_file=files.ca_cert, auth_token=SecretStr(TOKEN))
    api = ServeApi.of(ray, timeout_s=5)
    assert asyncio.run(api.status()) == {}
    asyncio.run(api.deploy({"applications": []}))
    assert [(s.method, s.path) for s in plain.seen] == [("GET", PATH), ("PUT", PATH)]
    assert all(s.headers["Authorization"] == f"Bearer {TOKEN}" for s in plain.seen)


def test_the_batch_runner_client_verifies_serves_certificate_and_sends_no_ray_token(
    plain: ScriptedHttpServer, front: _Front, files: TlsFiles
) -> None:
    ray = RaySettings(
        serve_address=front.address,
        serve_ssl_certfile="c",
        serve_ssl_keyfile="k",
        ca_file=files.ca_cert,
        auth_token=SecretStr(TOKEN),
    )
    assert asyncio.run(RunnerClient.of(ray, timeout_s=5).engines()) == {}
    [(method, path, _, headers)] = plain.seen
    assert (method, path) == ("GET", ROUTE_PREFIX + "/engines") and "Authorization" not in headers


def test_clients_without_the_ca_are_refused_and_say_why(plain: ScriptedHttpServer, front: _Front) -> None:
    ray = RaySettings(
        address=front.address, serve_address=front.address, serve_ssl_certfile="c", serve_ssl_keyfile="k"
    )
    with pytest.raises(RayUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
        asyncio.run(ServeApi.of(ray, timeout_s=5).status())
    with pytest.raises(RayUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
        asyncio.run(RunnerClient.of(ray, timeout_s=5).engines())
    assert plain.seen == []


def test_the_front_speaks_tls_only(plain: ScriptedHttpServer, front: _Front) -> None:
    with pytest.raises(RayUnavailable):
        asyncio.run(ServeApi(front.address.replace("https://", "http://"), timeout_s=5).status())
    assert plain.seen == []


def test_the_front_closes_connections_beyond_its_limit_and_serves_again_after(
    plain: ScriptedHttpServer, front: _Front, files: TlsFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tls_front, "MAX_CONNECTIONS", 1)
    context = ssl.create_default_context(cafile=str(files.ca_cert))
    with (
        socket.create_connection(("127.0.0.1", front.port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as held,
    ):
        held.sendall(b"GET /api/version HTTP/1.1\r\nHost: x\r\n\r\n")
        assert held.recv(100).startswith(b"HTTP/1.1 200")  # the one allowed connection, kept alive
        with pytest.raises(RayUnavailable):
            asyncio.run(ServeApi(front.address, timeout_s=5, ca_file=files.ca_cert).status())
    for _ in range(50):  # the held connection's end reaches the front
        if front.front.open == 0:
            break
        threading.Event().wait(0.1)
    assert asyncio.run(ServeApi(front.address, timeout_s=5, ca_file=files.ca_cert).status()) == {}


def test_the_fronts_command_line(tmp_path: Path, files: TlsFiles, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as shown:
        tls_front.parse_args(["--help"])
    assert shown.value.code == 0 and "--target-port" in capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:
        tls_front.parse_args(["--listen-port=0", "--target-port=1", "--cert=c", "--key=k"])
    assert refused.value.code == 2 and "--listen-port must be a port number" in capsys.readouterr().err
    missing = [
        "--listen-port=1",
        "--target-port=2",
        f"--cert={tmp_path / 'none.pem'}",
        f"--key={files.server_key}",
    ]
    assert tls_front.main(missing) == 2
    assert "cannot load --cert/--key" in capsys.readouterr().err
