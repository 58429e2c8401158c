"""The probe/metrics endpoint and the settings (no services: a loopback socket only)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import pytest

from llmbatch.dispatcher.http import HealthServer
from llmbatch.dispatcher.metrics import Metrics
from llmbatch.dispatcher.settings import DispatcherSettings
from llmbatch.ray_job.engines.backends import FAKE_BACKEND

pytestmark = pytest.mark.unit


async def _exchange(port: int, request: bytes, within: float = 10) -> bytes:
    """Send raw ``request`` bytes on a new connection; everything the server sends until it closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), within)
    finally:
        writer.close()


async def _get(port: int, path: str) -> tuple[int, bytes]:
    raw = await _exchange(port, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


async def test_livez_readyz_metrics() -> None:
    metrics = Metrics()
    metrics.dead_lettered.labels(reason="invalid_event").inc()
    state = {"live": True, "ready": False}

    async def ready() -> tuple[bool, dict[str, str]]:
        return state["ready"], {"redis": "ok" if state["ready"] else "unavailable"}

    server = HealthServer(
        metrics, live=lambda: state["live"], ready=ready, host="127.0.0.1", port=0, ready_cache_s=0
    )
    await server.start()
    try:
        port = server.bound_port
        assert await _get(port, "/livez") == (200, b"ok\n")
        status, body = await _get(port, "/readyz")
        assert status == 503 and b"redis: unavailable" in body
        state["ready"] = True
        assert (await _get(port, "/readyz"))[0] == 200
        status, body = await _get(port, "/metrics")
        assert status == 200
        assert b'llmbatch_dispatcher_dead_letters_total{reason="invalid_event"} 1.0' in body
        assert b"batch_id" not in body  # no per-batch labels
        state["live"] = False
        assert (await _get(port, "/livez"))[0] == 503
        assert (await _get(port, "/nope"))[0] == 404
    finally:
        await server.stop()


@contextlib.asynccontextmanager
async def _serving(
    ready_calls: list[int] | None = None, cache_s: float = 60.0
) -> AsyncIterator[HealthServer]:
    """A started server that is always live and ready (``ready_calls`` counts the readiness checks)."""

    async def ready() -> tuple[bool, dict[str, str]]:
        if ready_calls is not None:
            ready_calls.append(1)
        return True, {"redis": "ok"}

    server = HealthServer(
        Metrics(), live=lambda: True, ready=ready, host="127.0.0.1", port=0, ready_cache_s=cache_s
    )
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def test_readyz_answers_from_a_recent_result_not_one_check_per_probe() -> None:
    calls: list[int] = []
    async with _serving(calls) as server:
        results = await asyncio.gather(*(_get(server.bound_port, "/readyz") for _ in range(20)))
        assert {status for status, _ in results} == {200} and len(calls) == 1


async def test_a_request_head_sent_a_line_at_a_time_is_cut_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """One header line every 0.2 s kept a connection for ever (the timeout was per line)."""
    import llmbatch.dispatcher.http as http

    monkeypatch.setattr(http, "HEAD_TIMEOUT_S", 0.5)
    async with _serving() as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.bound_port)
        writer.write(b"GET /livez HTTP/1.1\r\n")
        closed = False
        for i in range(25):  # 5 s of headers, ten times the head timeout
            await asyncio.sleep(0.2)
            try:
                writer.write(f"X-Slow-{i}: 1\r\n".encode())
                await writer.drain()
            except ConnectionError:
                closed = True
                break
            if reader.at_eof() or (await _eof_within(reader, 0.01)):
                closed = True
                break
        writer.close()
        assert closed


async def _eof_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), seconds) == b""
    except TimeoutError:
        return False


@pytest.mark.parametrize(
    "head",
    [
        b"GET /livez HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(100)) + b"\r\n",
        b"GET /livez HTTP/1.1\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n",
    ],
)
async def test_too_many_or_too_long_header_lines_get_431(head: bytes) -> None:
    async with _serving() as server:
        assert (await _exchange(server.bound_port, head)).startswith(b"HTTP/1.1 431 ")
        assert (await _get(server.bound_port, "/livez"))[0] == 200  # and the server goes on


async def test_connections_over_the_limit_are_closed_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import llmbatch.dispatcher.http as http

    monkeypatch.setattr(http, "MAX_CONNECTIONS", 2)
    async with _serving() as server:
        idle = [await asyncio.open_connection("127.0.0.1", server.bound_port) for _ in range(2)]
        await asyncio.sleep(0.2)  # both are being served (waiting for their request line)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.bound_port)
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed without an answer
        writer.close()
        for _, w in idle:
            w.close()
        await asyncio.sleep(0.2)
        assert (await _get(server.bound_port, "/livez"))[0] == 200


def test_settings_from_environment_and_secrets_masked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMBATCH_DISPATCHER__MAX_IN_FLIGHT", "7")
    monkeypatch.setenv(
        "LLMBATCH_ENGINES__MODELS", json.dumps({"m": {"path": "/m", "engine": {"backend": FAKE_BACKEND}}})
    )
    monkeypatch.setenv("LLMBATCH_JOB__PIP", '["vllm==0.32.0"]')
    monkeypatch.setenv("LLMBATCH_S3__SECRET_KEY", "hunter2")
    settings = DispatcherSettings(_env_file=None)
    assert settings.dispatcher.max_in_flight == 7
    assert settings.engines.get("m").engine.backend == FAKE_BACKEND and settings.job.pip == ["vllm==0.32.0"]
    assert settings.s3.secret_key.get_secret_value() == "hunter2"
    assert "hunter2" not in str(settings.redacted()) and "hunter2" not in repr(settings)
    policy = settings.dispatcher.attempt_policy
    assert policy.max_attempts == settings.dispatcher.max_attempts


def test_a_password_written_into_a_url_is_masked_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "LLMBATCH_ENGINES__MODELS", json.dumps({"m": {"path": "/m", "engine": {"backend": FAKE_BACKEND}}})
    )
    monkeypatch.setenv("LLMBATCH_REDIS__URL", "redis://default:s3cr3t-pw@redis.internal:6379/0")
    settings = DispatcherSettings(_env_file=None)
    shown = str(settings.redacted())
    assert "s3cr3t-pw" not in shown and "redis://default:**********@redis.internal:6379/0" in shown


def test_incoherent_settings_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMBATCH_DISPATCHER__RETRY_BACKOFF_BASE_S", "10")
    monkeypatch.setenv("LLMBATCH_DISPATCHER__RETRY_BACKOFF_MAX_S", "1")
    with pytest.raises(ValueError, match="retry_backoff_max_s"):
        DispatcherSettings(_env_file=None)
