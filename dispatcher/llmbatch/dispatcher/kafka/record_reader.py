"""Reading single Kafka records back by their coordinates (topic, partition, offset).

The tracker reads a batch's request record back at launch when its body was too large to keep in
Redis (see :mod:`llmbatch.dispatcher.kafka.request_body`); the reconcile pass reads the request of a batch
whose
state Redis lost. One consumer without a group is kept open and used by one read at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from llmbatch.dispatcher.domain.dlt import OriginalRecord
from llmbatch.dispatcher.errors import KafkaUnavailable, classify
from llmbatch.dispatcher.kafka.side_consumer import side_consumer
from llmbatch.schemas.events import RecordRef
from llmbatch.settings import KafkaSettings


class RecordReader:
    """Reads records by coordinates; ``None`` when the topic no longer has the record."""

    def __init__(self, kafka: KafkaSettings, *, read_timeout_s: float = 30.0) -> None:
        self.kafka = kafka
        self.read_timeout_s = read_timeout_s
        self._consumer: Any = None
        self._lock = asyncio.Lock()

    async def read(self, ref: RecordRef) -> OriginalRecord | None:
        """The record at ``ref``; ``None`` when retention (or compaction) removed it.

        Raises :class:`~llmbatch.dispatcher.errors.KafkaUnavailable` when Kafka does not answer."""
        from aiokafka import TopicPartition

        tp = TopicPartition(ref.topic, ref.partition)
        async with self._lock:
            try:
                consumer = await self._started()
                consumer.assign([tp])
                consumer.seek(tp, ref.offset)
                loop = asyncio.get_running_loop()
                deadline = loop.time() + self.read_timeout_s
                asked_range = False
                while loop.time() < deadline:
                    batches = await consumer.getmany(tp, timeout_ms=1000, max_records=1)
                    for record in batches.get(tp, []):
                        # an offset retention removed is out of range: the consumer starts over at the
                        # earliest record, another offset
                        if record.offset != ref.offset:
                            return None
                        return OriginalRecord.from_consumer_record(record)
                    if not asked_range:  # nothing yet: an emptied partition sends nothing at all
                        asked_range = True
                        start = (await consumer.beginning_offsets([tp]))[tp]
                        end = (await consumer.end_offsets([tp]))[tp]
                        if not start <= ref.offset < end:
                            return None
                raise KafkaUnavailable(
                    f"no record of {ref.topic}[{ref.partition}] at or after offset {ref.offset} came within "
                    f"{self.read_timeout_s:.0f}s"
                )
            except KafkaUnavailable:
                await self._reset()
                raise
            except Exception as exc:
                await self._reset()
                raise classify(exc, default=KafkaUnavailable) from exc

    async def close(self) -> None:
        async with self._lock:
            await self._reset()

    async def _started(self) -> Any:
        if self._consumer is None:
            consumer = side_consumer(self.kafka)
            await consumer.start()
            self._consumer = consumer
        return self._consumer

    async def _reset(self) -> None:
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            with contextlib.suppress(Exception):  # closing a consumer that already failed
                await consumer.stop()
