"""What the service benchmark records while it runs: every event of its results topic (:class:`Ledger`)
and the 1-minute load average (:class:`Load`), for the figures of each phase."""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import time
from collections.abc import Callable
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from bench.service.common import BenchError

if TYPE_CHECKING:
    from llmbatch.demo.run import DispatcherProcess
    from llmbatch.producer import BatchClient
    from llmbatch.schemas.cloudevents import Envelope


class Load:
    """Samples the 1-minute load average every 2 s, for the figures of each phase."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []

    async def run(self) -> None:
        while True:
            self.samples.append((time.time(), os.getloadavg()[0]))
            await asyncio.sleep(2)

    def window(self, start: float, end: float) -> dict[str, float]:
        values = [v for t, v in self.samples if start <= t <= end] or [os.getloadavg()[0]]
        return {"mean": round(statistics.fmean(values), 2), "max": round(max(values), 2)}


class Ledger:
    """Every event of the run's results topic, kept by batch: accepted, last progress, terminal."""

    def __init__(self) -> None:
        self.accepted: dict[str, Envelope[Any]] = {}
        self.terminal: dict[str, Envelope[Any]] = {}
        self.progress: dict[str, int] = {}
        self.events = 0  # every event read from the results topic
        self.changed = asyncio.Condition()
        self.task: asyncio.Task[None] | None = None

    async def follow(self, client: BatchClient) -> None:
        from llmbatch.schemas.events import EventType

        async with aclosing(client.events(stop_at_terminal=False)) as stream:
            async for envelope in stream:
                self.events += 1
                batch_id = envelope.batch_id
                if envelope.type is EventType.ACCEPTED:
                    self.accepted.setdefault(batch_id, envelope)
                elif envelope.is_terminal:
                    self.terminal.setdefault(batch_id, envelope)
                elif envelope.type is EventType.PROGRESS:
                    counts = envelope.data.request_counts
                    self.progress[batch_id] = counts.completed + counts.failed
                async with self.changed:
                    self.changed.notify_all()

    async def until(
        self, check: Callable[[], bool], within: float, proc: DispatcherProcess, what: str
    ) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        async with self.changed:
            while not check():
                if self.task is not None and self.task.done():
                    raise BenchError(f"following the results topic ended: {self.task.exception()!r}")
                if not proc.alive():
                    raise BenchError(f"the dispatcher exited ({proc.proc.returncode}) waiting for {what}")
                left = deadline - loop.time()
                if left <= 0:
                    raise BenchError(f"no {what} within {within:.0f} s")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), min(left, 2.0))
