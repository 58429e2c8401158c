"""What the parts of the tracking loop share (:class:`RunContext`), built once by the tracker."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from llmbatch.dispatcher.backends.backend import JobBackend
from llmbatch.dispatcher.domain.keys import Keys
from llmbatch.dispatcher.kafka.publisher import EventProducer
from llmbatch.dispatcher.metrics import Metrics
from llmbatch.dispatcher.runs.results import ResultStore
from llmbatch.dispatcher.settings import DispatcherOptions, DispatcherSettings
from llmbatch.dispatcher.state.store import StateStore


def no_crash(point: str) -> None:
    """The crash hook of a real run: nothing (tests plug one in, see ``Dispatcher(crash=...)``)."""


@dataclass(frozen=True)
class RunContext:
    """The settings, the state store, the job backend, the results' storage, the event producer and
    the metrics of one dispatcher, with its clock and crash hook: what the tracker, the launcher, the
    in-flight checks, the finisher and the outcome reader all work with."""

    settings: DispatcherSettings
    store: StateStore
    backend: JobBackend
    results: ResultStore
    producer: EventProducer
    metrics: Metrics
    clock: Callable[[], float] = field(default=time.time)
    crash: Callable[[str], None] = field(default=no_crash)

    @property
    def opts(self) -> DispatcherOptions:
        """The dispatcher's own options (``settings.dispatcher``)."""
        return self.settings.dispatcher

    @property
    def keys(self) -> Keys:
        """The store's Redis key names."""
        return self.store.keys
