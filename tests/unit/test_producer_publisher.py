"""producer.kafka.Publisher: concurrent first publishes start one Kafka producer, not one each."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from llmbatch.adapters.kafka import Publisher
from llmbatch.settings import KafkaSettings

pytestmark = pytest.mark.unit


class CountingProducer:
    """Stands in for aiokafka's producer at the library edge: counts the producers made and closed."""

    made: list[CountingProducer] = []

    def __init__(self, **kwargs: Any) -> None:
        self.stopped = False
        CountingProducer.made.append(self)

    async def start(self) -> None:
        await asyncio.sleep(0.01)  # connecting takes a while: other callers arrive meanwhile

    async def stop(self) -> None:
        self.stopped = True


def test_concurrent_first_publishes_share_one_producer(monkeypatch: pytest.MonkeyPatch) -> None:
    import aiokafka

    CountingProducer.made = []
    monkeypatch.setattr(aiokafka, "AIOKafkaProducer", CountingProducer)
    publisher = Publisher(KafkaSettings(bootstrap_servers="127.0.0.1:1"))

    async def main() -> None:
        await asyncio.gather(*(publisher.start() for _ in range(50)))
        await publisher.stop()

    asyncio.run(main())
    # before the lock: 50 producers, 49 of them never closed ("Unclosed AIOKafkaProducer")
    assert len(CountingProducer.made) == 1 and CountingProducer.made[0].stopped
