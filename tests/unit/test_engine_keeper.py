"""The dispatcher's engine loops (dispatcher.engine_keeper), against a real local HTTP server in the
dashboard's and Serve proxy's place: the deploy loop says once that the deploy keeps failing (before,
nothing above debug while Ray answered its jobs API but the deploy failed), and a bug in one poll does
not end it; the figures loop exports the engines' figures on the tracker leader only."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

import llmbatch.dispatcher.runs.engine_keeper as keeper_module
from llmbatch.dispatcher.backends.runner_backend import RunnerClient
from llmbatch.dispatcher.backends.serve_api import PATH
from llmbatch.dispatcher.service import Dispatcher
from llmbatch.dispatcher.settings import DispatcherOptions, DispatcherSettings
from llmbatch.ray_job.batch_runner.runner_http import ROUTE_PREFIX
from llmbatch.settings import RaySettings, RedisSettings
from tests.support.dispatcher_kit import registry, wait_for
from tests.support.scripted_http import ScriptedHttpServer
from tests.unit.test_dispatcher_registry import FakeBackend

pytestmark = pytest.mark.unit
KEEPER = keeper_module.__name__  # its logger


@pytest.fixture
async def dispatcher(dashboard: ScriptedHttpServer, monkeypatch: pytest.MonkeyPatch) -> Dispatcher:
    monkeypatch.setattr(keeper_module, "ENGINE_POLL_S", 0.05)
    settings = DispatcherSettings(
        _env_file=None,
        dispatcher=DispatcherOptions(metrics_port=None, shared_engines=True),
        redis=RedisSettings(url="redis://127.0.0.1:1/0"),  # never reached
        ray=RaySettings(address=dashboard.address),
        engines=registry(),
    )
    backend: Any = FakeBackend()
    return Dispatcher(settings, backend=backend)


def _puts(dashboard: ScriptedHttpServer) -> int:
    return sum(1 for s in dashboard.seen if s.method == "PUT")


async def _run_until_deployed(dispatcher: Dispatcher, dashboard: ScriptedHttpServer, puts: int) -> None:
    loop = asyncio.create_task(dispatcher.engines.keep_deployed(None))
    try:
        await wait_for(
            lambda: _puts(dashboard) >= puts and not loop.done(), 30, interval=0.05, what=f"{puts} deploys"
        )
        await wait_for(
            lambda: any(s.method == "GET" for s in dashboard.seen),
            30,
            interval=0.05,
            what="the status read after a deploy",
        )
    finally:
        dispatcher._stop.set()
        await asyncio.wait_for(loop, 30)
        await dispatcher.stop()


async def test_a_deploy_that_keeps_failing_is_said_once_then_its_success(
    dispatcher: Dispatcher, dashboard: ScriptedHttpServer, caplog: pytest.LogCaptureFixture
) -> None:
    dashboard.answers[("PUT", PATH)] = (503, b"Serve controller is starting")

    async def heal() -> None:
        await wait_for(lambda: _puts(dashboard) >= 5, 30, interval=0.05, what="5 refused deploys")
        dashboard.answers[("PUT", PATH)] = (200, b"")

    with caplog.at_level(logging.DEBUG, logger=KEEPER):
        healing = asyncio.create_task(heal())
        await _run_until_deployed(dispatcher, dashboard, puts=6)
        await healing
    said = [
        (r.levelno, r.getMessage())
        for r in caplog.records
        if r.name == KEEPER and r.levelno >= logging.INFO and "engine" in r.getMessage()
    ]
    assert said == [
        (logging.WARNING, "engines still not deployed; trying again every 0 s"),
        (logging.INFO, "engines deployed"),
    ]
    warning = next(r for r in caplog.records if r.levelno == logging.WARNING)
    assert "Serve controller is starting" in warning.error  # type: ignore[attr-defined]


async def test_a_bug_in_one_poll_does_not_end_the_loop(
    dispatcher: Dispatcher,
    dashboard: ScriptedHttpServer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    real = dispatcher.engines.config
    calls = 0

    def config_with_a_bug_once() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise KeyError("a bug")
        return real()

    monkeypatch.setattr(dispatcher.engines, "config", config_with_a_bug_once)
    with caplog.at_level(logging.INFO, logger=KEEPER):
        await _run_until_deployed(dispatcher, dashboard, puts=1)
    assert calls >= 2
    messages = [r.getMessage() for r in caplog.records if r.name == KEEPER]
    assert messages[0] == "engine deployment check failed unexpectedly; the next poll tries again"
    assert "engines deployed" in messages


async def test_figures_are_exported_by_the_leader_only_and_size_admission(
    dispatcher: Dispatcher, dashboard: ScriptedHttpServer
) -> None:
    figures = b'{"engines": {"m": {"replicas": 2, "queued": 3.0}, "n": {"replicas": "?"}}}'
    dashboard.answers[("GET", ROUTE_PREFIX + "/engines")] = (200, figures)
    gauge = dispatcher.metrics.engine["queued_requests"]

    def queued() -> float | None:
        samples = [s for m in gauge.collect() for s in m.samples if s.labels.get("model") == "m"]
        return samples[0].value if samples else None

    loop = asyncio.create_task(dispatcher.engines.watch(RunnerClient(dashboard.address)))
    try:
        await asyncio.sleep(0.3)  # several polls as a standby: nothing asked, nothing exported
        assert not any(s.path.endswith("/engines") for s in dashboard.seen) and queued() is None
        dispatcher.tracker.is_leader = True
        await wait_for(lambda: queued() == 3.0, 30, interval=0.05, what="the leader's export")
        assert dispatcher.tracker.launcher.engine_replicas == {
            "m": 2
        }  # a count that is not a number is not used
        dispatcher.tracker.is_leader = False  # leadership moved: this replica's gauges are cleared
        await wait_for(
            lambda: queued() is None and dispatcher.tracker.launcher.engine_replicas == {},
            30,
            interval=0.05,
            what="the gauges cleared",
        )
    finally:
        dispatcher.engines.stopping.set()
        await asyncio.wait_for(loop, 30)
        await dispatcher.stop()
