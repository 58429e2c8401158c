"""Input file sizes: asked of S3 once per batch, shared by the tracker's admission and the route."""

from __future__ import annotations

import asyncio

import pytest

from llmbatch.dispatcher.backends.input_sizes import InputSizes
from llmbatch.dispatcher.settings import DispatcherSettings
from tests.support.clock import Clock

pytestmark = pytest.mark.unit


class Objects:
    """Object sizes by URI, counting the asks."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self.sizes = sizes
        self.asked: list[str] = []

    async def size(self, uri: str) -> int | None:
        self.asked.append(uri)
        return self.sizes.get(uri)


def test_a_size_is_asked_once_then_again_after_its_time() -> None:
    objects, clock = Objects({"s3://in/a": 10}), Clock(1000.0)
    sizes = InputSizes(objects.size, ttl_s=60, clock=clock)
    assert asyncio.run(sizes("s3://in/a")) == 10
    objects.sizes["s3://in/a"] = 20  # replaced: the answer stays until it expires
    clock.now += 59
    assert asyncio.run(sizes("s3://in/a")) == 10
    clock.now += 1
    assert asyncio.run(sizes("s3://in/a")) == 20
    assert objects.asked == ["s3://in/a", "s3://in/a"]


def test_a_missing_object_is_remembered_too() -> None:
    objects = Objects({})
    sizes = InputSizes(objects.size, clock=Clock(1000.0))
    assert asyncio.run(sizes("s3://in/gone")) is None
    assert asyncio.run(sizes("s3://in/gone")) is None
    assert objects.asked == ["s3://in/gone"]


def test_the_memory_is_bounded_and_forgets_the_oldest() -> None:
    objects = Objects({f"s3://in/{n}": n for n in range(5)})
    sizes = InputSizes(objects.size, kept=3, clock=Clock(1000.0))
    for n in range(5):
        asyncio.run(sizes(f"s3://in/{n}"))
    assert len(sizes) == 3
    asyncio.run(sizes("s3://in/4"))  # kept
    asyncio.run(sizes("s3://in/0"))  # forgotten: asked again
    assert objects.asked == [f"s3://in/{n}" for n in range(5)] + ["s3://in/0"]
    with pytest.raises(ValueError, match="kept"):
        InputSizes(objects.size, kept=0)


def test_the_tracker_and_the_runner_backend_share_one_memory() -> None:
    """Admission (does the batch need a job slot?) and submission (which route?) ask the same cache:
    one S3 HEAD per file batch, and the route it was admitted for."""
    from llmbatch.dispatcher.backends.runner_backend import RoutedBackend
    from llmbatch.dispatcher.service import Dispatcher

    async def build() -> tuple[object, object]:
        settings = DispatcherSettings()
        opts = settings.dispatcher.model_copy(update={"shared_engines": True, "short_path_max_lines": 8})
        dispatcher = Dispatcher(settings.model_copy(update={"dispatcher": opts}))
        try:
            assert isinstance(dispatcher.backend, RoutedBackend)
            return dispatcher.tracker.launcher.size_of, dispatcher.backend.size_of
        finally:
            await dispatcher.producer.stop()
            await dispatcher.backend.close()
            await dispatcher.store.close()

    admission, route = asyncio.run(build())
    assert isinstance(admission, InputSizes) and admission is route
