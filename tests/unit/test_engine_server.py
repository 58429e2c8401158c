"""The shared engine's replica body (:class:`llmbatch.ray_job.engines.serve_engine.EngineServer`) without
Serve: many batches call it at once, each with its own request keys (input line numbers, so they repeat)."""

from __future__ import annotations

import asyncio

import pytest

from llmbatch.ray_job.engines.backends import FAKE_BACKEND
from llmbatch.ray_job.engines.serve_engine import EngineServer
from llmbatch.ray_job.lines.records import GenRequest
from llmbatch.schemas.engines import EngineModel, Scaling
from llmbatch.schemas.job import EngineConfig

pytestmark = pytest.mark.unit


def _server() -> EngineServer:
    entry = EngineModel(
        path="fake",
        engine=EngineConfig(backend=FAKE_BACKEND, backend_options={"delay_s": 0.2}),
        scaling=Scaling(max_ongoing_requests=8),
    )
    return EngineServer("m", entry.model_dump(mode="json"))


def _requests(batch: str, n: int) -> list[GenRequest]:
    # two batches' line numbers are the same keys ("0", "1", ...); their prompts differ
    return [
        GenRequest(
            str(i), [1, 2, 3 + i], {"max_tokens": 8}, prompt_text=f"{batch} {i}", custom_id=f"{batch}-{i}"
        )
        for i in range(n)
    ]


def test_concurrent_calls_with_the_same_keys_each_get_their_own_answers() -> None:
    server = _server()

    async def all_at_once() -> list[list[tuple[str, str]]]:
        calls = [server.generate(_requests(b, n)) for b, n in (("a", 5), ("b", 3), ("c", 5))]
        done = await asyncio.wait_for(asyncio.gather(*calls), 30)
        return [[(g.key, g.text) for g in out] for out in done]

    got = asyncio.run(all_at_once())
    # each call gets back its own keys, in its order, with the answers to its own prompts
    assert got == [
        [(str(i), f"fake reply to: {b} {i}") for i in range(n)] for b, n in (("a", 5), ("b", 3), ("c", 5))
    ]
    assert server.info()["requests"] == 13


def test_info_reports_queue_activity_and_idle_time() -> None:
    server = _server()

    async def during_and_after() -> tuple[dict[str, object], float, dict[str, object]]:
        call = asyncio.ensure_future(server.generate(_requests("a", 3), "tenant/a", 7))
        await asyncio.sleep(0.1)
        busy = server.info()
        busy_idle = server.idle_s()
        await asyncio.wait_for(call, 30)
        await asyncio.sleep(0.05)
        return busy, busy_idle, server.info()

    busy, busy_idle, after = asyncio.run(during_and_after())
    assert busy_idle == 0.0 and busy["active"] == 3 and busy["requests"] == 0
    assert after["active"] == 0 and after["queued"] == 0 and after["requests"] == 3
    assert isinstance(after["idle_s"], float) and after["idle_s"] > 0
    assert not server._metrics.enabled
