"""The probe/metrics endpoint and the settings (no services: a loopback socket only)."""

from __future__ import annotations

import asyncio

import pytest

from dispatcher.http import HealthServer
from dispatcher.metrics import Metrics
from dispatcher.settings import DispatcherSettings

pytestmark = pytest.mark.unit


async def _get(port: int, path: str) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    raw = await reader.read()
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


async def test_livez_readyz_metrics() -> None:
    metrics = Metrics()
    metrics.dead_lettered.labels(reason="invalid_event").inc()
    state = {"live": True, "ready": False}

    async def ready() -> tuple[bool, dict[str, str]]:
        return state["ready"], {"redis": "ok" if state["ready"] else "unavailable"}

    server = HealthServer(metrics, live=lambda: state["live"], ready=ready, host="127.0.0.1", port=0)
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


def test_settings_from_environment_and_secrets_masked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMBATCH_DISPATCHER__MAX_IN_FLIGHT", "7")
    monkeypatch.setenv("LLMBATCH_ENGINES__MODELS", '{"m": {"path": "/m", "engine": {"backend": "fake"}}}')
    monkeypatch.setenv("LLMBATCH_JOB__PIP", '["vllm==0.32.0"]')
    monkeypatch.setenv("LLMBATCH_S3__SECRET_KEY", "hunter2")
    monkeypatch.setenv("LLMBATCH_DISPATCHER__CRASH_AT", '["after_submit"]')
    settings = DispatcherSettings(_env_file=None)  # type: ignore[call-arg]
    assert settings.dispatcher.max_in_flight == 7
    assert settings.engines.get("m").engine.backend == "fake" and settings.job.pip == ["vllm==0.32.0"]
    assert settings.dispatcher.crash_at == ["after_submit"]
    assert settings.s3.secret_key.get_secret_value() == "hunter2"
    assert "hunter2" not in str(settings.redacted()) and "hunter2" not in repr(settings)
    policy = settings.dispatcher.attempt_policy
    assert policy.max_attempts == settings.dispatcher.max_attempts


def test_incoherent_settings_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMBATCH_DISPATCHER__RETRY_BACKOFF_BASE_S", "10")
    monkeypatch.setenv("LLMBATCH_DISPATCHER__RETRY_BACKOFF_MAX_S", "1")
    with pytest.raises(ValueError, match="retry_backoff_max_s"):
        DispatcherSettings(_env_file=None)  # type: ignore[call-arg]
