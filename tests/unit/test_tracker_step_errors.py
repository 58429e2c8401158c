"""The tracker's per-batch steps: a permanent error is said once per batch and step until it changes or
the step works again, not on every tick (a batch meets it tick after tick); outages stay throttled."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from llmbatch.dispatcher.domain.batch_record import BatchRecord
from llmbatch.dispatcher.domain.keys import BatchKey
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.errors import PermanentError
from llmbatch.dispatcher.runs.tracker import Tracker
from llmbatch.dispatcher.service import Dispatcher
from llmbatch.dispatcher.settings import DispatcherOptions, DispatcherSettings
from llmbatch.settings import RedisSettings
from tests.support.dispatcher_kit import registry
from tests.unit.test_dispatcher_registry import FakeBackend

pytestmark = pytest.mark.unit


@pytest.fixture
async def tracker() -> Any:
    settings = DispatcherSettings(
        _env_file=None,
        dispatcher=DispatcherOptions(metrics_port=None, shared_engines=False),
        redis=RedisSettings(url="redis://127.0.0.1:1/0"),  # never reached: the step is the test's
        engines=registry(),
    )
    backend: Any = FakeBackend()
    dispatcher = Dispatcher(settings, backend=backend)
    yield dispatcher.tracker
    await dispatcher.stop()


def record(key: str) -> BatchRecord:
    return BatchRecord(BatchKey(key), State.RUNNING, 3, {"batch_id": key})


def said(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [
        (r.getMessage().split(" (")[0], getattr(r, "error", ""))
        for r in caplog.records
        if r.name == "llmbatch.dispatcher.runs.tracker" and "batch step" in r.getMessage()
    ]


async def test_a_permanent_error_is_said_once_per_batch_until_it_changes_or_heals(
    tracker: Tracker, caplog: pytest.LogCaptureFixture
) -> None:
    errors: dict[str, str | None] = {"a": "S3 answered 400: bad", "b": "S3 answered 400: bad"}

    async def step(rec: BatchRecord) -> None:
        if errors[rec.key] is not None:
            raise PermanentError(str(errors[rec.key]))

    with caplog.at_level(logging.INFO, logger="llmbatch.dispatcher.runs.tracker"):
        for _ in range(5):  # five ticks
            await tracker._each([record("a"), record("b")], step)
        assert said(caplog) == [("batch step failed", "S3 answered 400: bad")] * 2  # once per batch
        errors["a"] = "S3 answered 403: other"
        await tracker._each([record("a"), record("b")], step)
        errors["b"] = None
        await tracker._each([record("a"), record("b")], step)
        await tracker._each([record("a"), record("b")], step)
    assert said(caplog)[2:] == [
        ("batch step failed", "S3 answered 403: other"),
        ("batch step works again", ""),
    ]


async def test_batches_no_longer_stepped_are_forgotten(tracker: Tracker) -> None:
    async def step(rec: BatchRecord) -> None:
        raise PermanentError("no")

    await tracker._each([record(f"b{i}") for i in range(100)], step)
    assert len(tracker._failing) == 100
    await tracker._each([record("b1")], step)  # the others ended
    assert list(tracker._failing) == [("check", "b1")]
    await tracker._each([record("b1")], step, step="expire")  # another step keeps its own
    assert len(tracker._failing) == 2
