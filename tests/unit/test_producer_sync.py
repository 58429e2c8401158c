"""The blocking SDK client (producer.sync.SyncBatchClient) over a BatchClient whose I/O methods are
replaced by coroutines and async iterators that record how they were run: one private event loop for
every call, refused inside a running loop, iterators whose async source is closed when they are closed
early or run out, and a close that ends the loop even when the client's close fails."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from llmbatch.producer import ProducerError, SyncBatchClient
from llmbatch.producer.client import BatchClient, ClientOptions
from llmbatch.settings import KafkaSettings, LLMBatchSettings

pytestmark = pytest.mark.unit

SETTINGS = LLMBatchSettings(kafka=KafkaSettings(bootstrap_servers="kafka.test:9092"))


class Source:
    """What one async source of a sync iterator went through, and in which loop."""

    def __init__(self, items: list[int], *, fail_after: int | None = None) -> None:
        self.items = items
        self.fail_after = fail_after
        self.handed: list[int] = []
        self.cleaned_up = False
        self.loops: set[asyncio.AbstractEventLoop] = set()

    async def generator(self) -> AsyncIterator[int]:
        """An async generator (as BatchClient.events and iter_results are), with cleanup to await."""
        try:
            for item in self.items:
                self.loops.add(asyncio.get_running_loop())
                if self.fail_after is not None and len(self.handed) == self.fail_after:
                    raise ProducerError("results went away")
                self.handed.append(item)
                yield item
        finally:
            await asyncio.sleep(0)  # cleanup that needs the loop (a consumer's stop)
            self.cleaned_up = True


class Closable:
    """An async iterator that is no generator: only an explicit ``aclose`` cleans it up."""

    def __init__(self, items: list[int]) -> None:
        self.items = list(items)
        self.aclosed = 0

    def __aiter__(self) -> Closable:
        return self

    async def __anext__(self) -> int:
        if not self.items:
            raise StopAsyncIteration
        return self.items.pop(0)

    async def aclose(self) -> None:
        self.aclosed += 1


class Bare:
    """An async iterator without ``aclose``."""

    def __init__(self, items: list[int]) -> None:
        self.items = list(items)

    def __aiter__(self) -> Bare:
        return self

    async def __anext__(self) -> int:
        if not self.items:
            raise StopAsyncIteration
        return self.items.pop(0)


@pytest.fixture
def sync(clean_env: pytest.MonkeyPatch) -> Iterator[Any]:
    """A client whose methods the test replaces (typed ``Any``: the fakes return other types); closed
    at the end."""
    with SyncBatchClient(SETTINGS, options=ClientOptions(source="urn:t")) as client:
        yield client


def test_it_refuses_to_run_inside_an_event_loop(clean_env: pytest.MonkeyPatch) -> None:
    async def inside() -> None:
        SyncBatchClient(SETTINGS)

    with pytest.raises(ProducerError, match="cannot run inside an event loop; use BatchClient"):
        asyncio.run(inside())


def test_every_call_runs_in_one_private_loop_with_its_arguments(clean_env: pytest.MonkeyPatch) -> None:
    sync: Any = SyncBatchClient(SETTINGS, options=ClientOptions(source="urn:t"))
    assert isinstance(sync.client, BatchClient) and sync.client.settings is SETTINGS
    assert sync.client.options.source == "urn:t"
    calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
    loops: list[asyncio.AbstractEventLoop] = []

    def recording(name: str) -> Any:
        async def method(*args: Any, **kwargs: Any) -> str:
            loops.append(asyncio.get_running_loop())
            calls.append((name, args, kwargs))
            return f"{name}-result"

        return method

    for name in ("submit", "cancel", "wait", "manifest", "results_by_custom_id", "ensure_buckets", "close"):
        setattr(sync.client, name, recording(name))
    lines = [{"custom_id": "a"}]
    assert sync.submit(lines, model="m", tenant="acme") == "submit-result"
    assert sync.cancel("b1", reason="r") == "cancel-result"
    assert sync.wait("b1", 30.0, tenant="acme") == "wait-result"
    assert sync.manifest("b1", tenant="acme") == "manifest-result"
    assert sync.results_by_custom_id(["s3://r/x"], errors=True) == "results_by_custom_id-result"
    assert sync.ensure_buckets() is None
    assert calls == [
        ("submit", (lines,), {"model": "m", "tenant": "acme"}),
        ("cancel", ("b1",), {"reason": "r"}),
        ("wait", ("b1", 30.0), {"tenant": "acme"}),
        ("manifest", ("b1",), {"tenant": "acme"}),
        ("results_by_custom_id", (["s3://r/x"],), {"errors": True}),
        ("ensure_buckets", (), {}),
    ]
    # one loop for all (the Kafka producer a first call starts is bound to it), kept between calls
    assert len(set(loops)) == 1 and not loops[0].is_running() and not loops[0].is_closed()
    sync.close()
    assert calls[-1][0] == "close" and loops[-1] is loops[0] and loops[0].is_closed()


def test_closing_an_iterator_early_closes_its_async_source_in_the_loop(sync: Any) -> None:
    events, results = Source([1, 2, 3]), Source([7, 8, 9])
    sync.client.events = lambda *a, **k: events.generator()
    sync.client.iter_results = lambda *a, **k: results.generator()
    stream = sync.events("b1")
    assert next(stream) == 1
    stream.close()
    assert events.cleaned_up and events.handed == [1]  # at once, not when the loop shuts down
    with contextlib.closing(sync.iter_results(["s3://r/x"])) as rows:
        assert [next(rows), next(rows)] == [7, 8]
    assert results.cleaned_up and results.handed == [7, 8]
    assert len(events.loops | results.loops) == 1


def test_an_iterator_run_out_closes_its_source(sync: Any) -> None:
    source = Closable([1, 2, 3])
    sync.client.events = lambda *a, **k: source
    assert list(sync.events("b1")) == [1, 2, 3]
    assert source.aclosed == 1
    generator = Source([4, 5])
    sync.client.iter_results = lambda *a, **k: generator.generator()
    assert list(sync.iter_results(["s3://r/x"])) == [4, 5] and generator.cleaned_up
    bare = Bare([6])
    sync.client.events = lambda *a, **k: bare
    assert list(sync.events()) == [6]


def test_an_error_of_the_source_reaches_the_caller_after_its_cleanup(sync: Any) -> None:
    source = Source([1, 2, 3], fail_after=1)
    sync.client.iter_results = lambda *a, **k: source.generator()
    rows = sync.iter_results(["s3://r/x"])
    assert next(rows) == 1
    with pytest.raises(ProducerError, match="results went away"):
        next(rows)
    assert source.handed == [1] and source.cleaned_up


def test_close_ends_the_loop_even_when_the_clients_close_fails(clean_env: pytest.MonkeyPatch) -> None:
    sync: Any = SyncBatchClient(SETTINGS)
    loops: list[asyncio.AbstractEventLoop] = []

    async def failing_close() -> None:
        loops.append(asyncio.get_running_loop())
        raise ProducerError("flush failed")

    sync.client.close = failing_close
    with pytest.raises(ProducerError, match="flush failed"):
        sync.close()
    [loop] = loops
    assert loop.is_closed()


def test_the_with_block_closes_client_and_loop(clean_env: pytest.MonkeyPatch) -> None:
    closed: list[asyncio.AbstractEventLoop] = []

    async def close() -> None:
        closed.append(asyncio.get_running_loop())

    with SyncBatchClient(SETTINGS) as client:
        inner: Any = client.client
        inner.close = close
        assert closed == []
    [loop] = closed
    assert loop.is_closed()


def test_close_twice_is_harmless_and_a_call_after_it_says_so(clean_env: pytest.MonkeyPatch) -> None:
    closes: list[int] = []
    made: list[str] = []

    async def close() -> None:
        closes.append(1)

    async def manifest(batch_id: str, *, tenant: str) -> None:
        made.append(batch_id)  # never reached: no coroutine is made once the client is closed

    with SyncBatchClient(SETTINGS) as client:
        inner: Any = client.client
        inner.close, inner.manifest = close, manifest
        client.close()  # inside the with block: __exit__ closes again
    client.close()
    assert closes == [1]
    with pytest.raises(ProducerError, match="closed; make a new one"):
        client.manifest("b1")
    assert made == []


def test_an_iterator_outliving_its_client_closes_quietly(clean_env: pytest.MonkeyPatch) -> None:
    source = Source([1, 2, 3])
    client: Any = SyncBatchClient(SETTINGS)
    inner: Any = client.client
    inner.events = lambda *a, **k: source.generator()

    async def close() -> None:
        pass

    inner.close = close
    stream = client.events("b1")
    assert next(stream) == 1
    client.close()  # the loop's shutdown closes the generator it still holds
    assert source.cleaned_up
    stream.close()
