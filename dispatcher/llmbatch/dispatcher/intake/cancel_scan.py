"""Cancels that take effect while the consumer is paused (backpressure).

With the queue full the consumer pauses its partitions, and a ``cancel_requested`` record sits behind
the backlog of requests: it would apply only when the queue drains. While paused, this scanner reads
ahead of the consumer's positions (a consumer of its own, outside the group, committing nothing) and
applies the cancels it finds for batches that are already known; the consumer meets them later and
skips them by their event-id marker. A cancel for a batch that is still in the unread backlog is left
for the consumer (in order, after the batch's own request), so it is never lost. Only the type header
of other records is looked at. One pass reads at most ``max_records`` records per partition and
resumes where the last one stopped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from llmbatch.dispatcher.domain.dlt import OriginalRecord
from llmbatch.dispatcher.errors import DispatcherError, KafkaUnavailable, classify
from llmbatch.dispatcher.intake.cancel import apply_cancel
from llmbatch.dispatcher.intake.commands import Cancel, IntakeRules
from llmbatch.dispatcher.intake.commands import classify as classify_record
from llmbatch.dispatcher.kafka.side_consumer import side_consumer
from llmbatch.dispatcher.metrics import Metrics
from llmbatch.dispatcher.settings import DispatcherSettings
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.schemas.cloudevents import peek_type
from llmbatch.schemas.events import EventType

log = logging.getLogger(__name__)

_CANCEL = EventType.CANCEL_REQUESTED.value


class CancelScanner:
    """Applies the cancels found ahead of a paused consumer (see the module docstring)."""

    def __init__(
        self,
        settings: DispatcherSettings,
        store: StateStore,
        rules: IntakeRules,
        metrics: Metrics,
        *,
        clock: Callable[[], float] = time.time,
        max_records: int = 5000,
    ) -> None:
        self.settings = settings
        self.store = store
        self.rules = rules
        self.metrics = metrics
        self.clock = clock
        self.max_records = max_records
        self._scanned: dict[Any, int] = {}  # partition -> next offset to scan

    def forget(self) -> None:
        """The consumer resumed: the next pause scans from its positions again."""
        self._scanned.clear()

    async def scan(self, positions: dict[Any, int]) -> int:
        """Read ahead of ``positions`` (partition -> the consumer's next offset) and apply the
        cancels of known batches; returns how many were applied."""
        starts = {tp: max(pos, self._scanned.get(tp, 0)) for tp, pos in positions.items()}
        consumer = side_consumer(self.settings.kafka)
        applied = 0
        try:
            await consumer.start()
            ends = await consumer.end_offsets(list(starts))
            todo = {tp for tp in starts if starts[tp] < ends[tp]}
            if not todo:
                return 0
            consumer.assign(list(todo))
            for tp in todo:
                consumer.seek(tp, starts[tp])
            budget = {tp: self.max_records for tp in todo}
            while todo:
                batches = await consumer.getmany(*todo, timeout_ms=1000, max_records=1000)
                if not batches:
                    break
                for tp, records in batches.items():
                    taken = records[: budget[tp]]  # a fetch may overshoot the budget: the rest waits
                    for record in taken:
                        if peek_type(list(record.headers or ())) == _CANCEL:
                            applied += await self._apply(record)
                        self._scanned[tp] = record.offset + 1
                    budget[tp] -= len(taken)
                    if self._scanned.get(tp, 0) >= ends[tp] or budget[tp] <= 0:
                        todo.discard(tp)
        except DispatcherError:
            raise
        except Exception as exc:
            raise classify(exc, default=KafkaUnavailable) from exc
        finally:
            await consumer.stop()
        if applied:
            log.info("cancels applied ahead of the paused backlog", extra={"cancels": applied})
        return applied

    async def _apply(self, record: Any) -> int:
        command = classify_record(OriginalRecord.from_consumer_record(record), self.rules, self.clock())
        if not isinstance(command, Cancel):  # invalid: the consumer dead-letters it in its turn
            return 0
        if (await self.store.markers_exist([command.marker]))[0]:  # applied by an earlier pass
            return 0
        [state] = await self.store.states_many([command.key])
        if state is None or state.is_terminal:
            # unknown: its request is still in the backlog (or it ended, and a replay may be there):
            # the consumer applies it in order
            return 0
        await apply_cancel(self.store, self.metrics, command, self.clock)
        self.metrics.processed.labels(outcome="cancel_ahead").inc()
        return 1
