"""The requests-topic consumer's offsets to commit: per partition it still holds, the offset after the
last record whose effects are durable, and committing them to the group. A partition revoked while a
segment was in hand is marked no more: its new owner reads it again (every effect is idempotent).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from aiokafka import AIOKafkaConsumer, TopicPartition

from llmbatch.dispatcher.metrics import Metrics

log = logging.getLogger(__name__)


class DoneOffsets:
    """The next offset to commit per assigned partition, effects durable (see the module docstring)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.done: dict[TopicPartition, int] = {}  # next offset to commit, effects durable
        self.assigned: set[TopicPartition] = set()

    def mark(self, records: Iterable[tuple[TopicPartition, int]]) -> None:
        """The records at these (partition, offset) are done: their effects are durable."""
        for tp, offset in records:
            if tp not in self.assigned:
                # revoked while this segment was in hand (a slow Redis outlived the rebalance wait):
                # the new owner re-reads it; committing it here would fail every later commit
                continue
            if offset + 1 > self.done.get(tp, -1):
                self.done[tp] = offset + 1

    def resume_at(self, tp: TopicPartition, first: int) -> int:
        """Where to read ``tp`` again when a fetch that began at ``first`` did not finish."""
        return max(self.done.get(tp, first), first)

    def forget(self, revoked: Iterable[TopicPartition]) -> None:
        """Drop what is kept of partitions this consumer no longer holds."""
        for tp in revoked:
            self.done.pop(tp, None)

    async def commit(
        self, consumer: AIOKafkaConsumer | None, only: set[TopicPartition] | None = None
    ) -> None:
        """Commit the done offsets (of ``only``'s partitions, when given); a failed commit is counted
        and logged, and the offsets stay to be committed again."""
        if consumer is None or not self.done:
            return
        offsets = {tp: off for tp, off in self.done.items() if only is None or tp in only}
        if not offsets:
            return
        try:
            await consumer.commit(offsets)
            self.metrics.commits.labels(result="ok").inc()
            for tp, off in offsets.items():
                if self.done.get(tp) == off:
                    del self.done[tp]
        except Exception as exc:
            # a rebalance took the partitions: the new owner re-reads them, all effects are idempotent
            self.metrics.commits.labels(result="failed").inc()
            log.warning("offset commit failed", extra={"error": f"{type(exc).__name__}: {exc}"})
