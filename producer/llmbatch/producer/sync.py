"""Blocking wrapper of :class:`~llmbatch.producer.client.BatchClient` for scripts and non-async services.

It owns a private event loop (``asyncio.Runner``), so it must not be used from inside a running
event loop: use :class:`~llmbatch.producer.client.BatchClient` there.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

from llmbatch.adapters.errors import ProducerError
from llmbatch.adapters.kafka import Published
from llmbatch.producer.client import Answer, BatchClient, BatchHandle, ClientOptions
from llmbatch.producer.results import ResultSource
from llmbatch.schemas import BatchOutputLine, Envelope, Manifest
from llmbatch.schemas.compat import Runner
from llmbatch.settings import LLMBatchSettings

T = TypeVar("T")


class SyncBatchClient:
    """Same methods as :class:`BatchClient`, blocking. Use as ``with SyncBatchClient() as c:``."""

    def __init__(
        self, settings: LLMBatchSettings | None = None, *, options: ClientOptions | None = None
    ) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise ProducerError("SyncBatchClient cannot run inside an event loop; use BatchClient")
        self._runner = Runner()
        self._closed = False
        self.client = BatchClient(settings, options=options)

    def __enter__(self) -> SyncBatchClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, call: Callable[[], Awaitable[T]]) -> T:
        # the coroutine is made only once the loop is known to be open: a call after close() must
        # not leave one behind, never awaited
        if self._closed:
            raise ProducerError("this SyncBatchClient is closed; make a new one")
        return self._runner.run(_awaited(call))

    def close(self) -> None:
        """Close the Kafka producer and the private event loop (again: nothing to do)."""
        if self._closed:
            return
        try:
            self._run(self.client.close)
        finally:
            self._closed = True
            self._runner.close()

    def submit(self, requests: Any = None, **kwargs: Any) -> BatchHandle:
        """See :meth:`BatchClient.submit`."""
        handle: BatchHandle = self._run(lambda: self.client.submit(requests, **kwargs))
        return handle

    def cancel(self, batch_id: str, **kwargs: Any) -> Published:
        """See :meth:`BatchClient.cancel`."""
        published: Published = self._run(lambda: self.client.cancel(batch_id, **kwargs))
        return published

    def wait(self, batch_id: str, timeout: float | None = None, **kwargs: Any) -> Envelope[Answer]:
        """See :meth:`BatchClient.wait`."""
        result: Envelope[Answer] = self._run(lambda: self.client.wait(batch_id, timeout, **kwargs))
        return result

    def events(self, batch_id: str | None = None, **kwargs: Any) -> Iterator[Envelope[Any]]:
        """See :meth:`BatchClient.events` (closing the iterator closes the consumer)."""
        return self._iterate(self.client.events(batch_id, **kwargs))

    def manifest(self, batch_id: str, *, tenant: str = "default") -> Manifest:
        """See :meth:`BatchClient.manifest`."""
        manifest: Manifest = self._run(lambda: self.client.manifest(batch_id, tenant=tenant))
        return manifest

    def iter_results(self, source: ResultSource, *, errors: bool = False) -> Iterator[BatchOutputLine]:
        """See :meth:`BatchClient.iter_results`."""
        return self._iterate(self.client.iter_results(source, errors=errors))

    def results_by_custom_id(
        self, source: ResultSource, *, errors: bool = False
    ) -> dict[str, BatchOutputLine]:
        """See :meth:`BatchClient.results_by_custom_id`."""
        result: dict[str, BatchOutputLine] = self._run(
            lambda: self.client.results_by_custom_id(source, errors=errors)
        )
        return result

    def ensure_buckets(self) -> None:
        """See :meth:`BatchClient.ensure_buckets`."""
        self._run(self.client.ensure_buckets)

    def _iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        try:
            while True:
                try:
                    yield self._run(agen.__anext__)
                except StopAsyncIteration:
                    return
        finally:
            aclose = getattr(agen, "aclose", None)
            if aclose is not None and not self._closed:  # else the loop closed its async generators
                self._run(aclose)


async def _awaited(call: Callable[[], Awaitable[T]]) -> T:
    return await call()
