"""The dispatcher's group-less Kafka consumers (read by position, commit nothing): the reconcile
pass, the cancel read-ahead and the record reader all make theirs here, so they read alike."""

from __future__ import annotations

from typing import Any

from llmbatch.settings import KafkaSettings


def side_consumer(kafka: KafkaSettings) -> Any:
    """A consumer in no group, committing nothing, reading committed records only, from the log
    start when a position is gone, and fetching records as large as the topics take."""
    from aiokafka import AIOKafkaConsumer

    return AIOKafkaConsumer(
        **kafka.client_kwargs(),
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        isolation_level="read_committed",
        max_partition_fetch_bytes=max(1 << 20, kafka.topics.max_message_bytes),
    )
