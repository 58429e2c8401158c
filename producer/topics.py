"""Create the llmbatch topics when missing (the dispatcher and the local stack reuse this)."""

from __future__ import annotations

import asyncio
from typing import Any

from llmbatch.settings import KafkaSettings, LLMBatchSettings
from producer.errors import BrokerUnavailable, ProducerError

TOPIC_ALREADY_EXISTS = 36
DEAD_LETTER_RETENTION_MS = 30 * 24 * 3600 * 1000
"""Dead letters are inspected and replayed by humans: keep them a month."""


def topic_names(kafka: KafkaSettings) -> dict[str, str]:
    """``{"requests": ..., "results": ..., "dead_letter": ...}`` from the settings."""
    topics = kafka.topics
    return {"requests": topics.requests, "results": topics.results, "dead_letter": topics.dead_letter}


def topic_configs(kafka: KafkaSettings) -> dict[str, dict[str, str]]:
    """The configs each topic is created with, by role: explicit ``max.message.bytes`` from the
    settings (the brokers' default, 1 MiB, would not take an inline batch at the inline limits, and
    the dead-letter topic needs room for the ``kafka_dlt-*`` headers beyond the original record)."""
    topics = kafka.topics
    return {
        "requests": {"max.message.bytes": str(topics.max_message_bytes)},
        "results": {"max.message.bytes": str(topics.max_message_bytes)},
        "dead_letter": {
            "max.message.bytes": str(topics.dead_letter_max_message_bytes),
            "retention.ms": str(DEAD_LETTER_RETENTION_MS),
        },
    }


async def ensure_topics(
    settings: LLMBatchSettings | KafkaSettings,
    *,
    timeout_s: float = 15.0,
    configs: dict[str, dict[str, str]] | None = None,
) -> list[str]:
    """Create the requests, results and dead-letter topics that do not exist yet.

    Partitions, replication and ``max.message.bytes`` come from ``LLMBATCH_KAFKA__TOPICS__*``
    (:func:`topic_configs`; ``configs`` adds to or overrides them by role). Existing topics are left
    alone (neither their partition count nor their configs are changed). Returns the names created.

    Raises:
        BrokerUnavailable: the broker did not answer within ``timeout_s``.
        ProducerError: the broker refused to create a topic (e.g. not authorised).
    """
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.errors import KafkaError

    kafka = settings.kafka if isinstance(settings, LLMBatchSettings) else settings
    per_topic = topic_configs(kafka)
    for role, extra in (configs or {}).items():
        per_topic[role] = {**per_topic.get(role, {}), **extra}
    admin = AIOKafkaAdminClient(**kafka.client_kwargs())
    try:
        await asyncio.wait_for(admin.start(), timeout_s)
        existing = set(await asyncio.wait_for(admin.list_topics(), timeout_s))
        wanted = [
            NewTopic(
                name,
                num_partitions=kafka.topics.partitions,
                replication_factor=kafka.topics.replication_factor,
                topic_configs=per_topic.get(role, {}),
            )
            for role, name in topic_names(kafka).items()
            if name not in existing
        ]
        if not wanted:
            return []
        response = await asyncio.wait_for(admin.create_topics(wanted), timeout_s)
        created = []
        for name, code, message in _topic_errors(response):
            if code == 0:
                created.append(name)
            elif code != TOPIC_ALREADY_EXISTS:
                raise ProducerError(f"cannot create topic {name!r}: error {code} {message or ''}".strip())
        return created
    except (TimeoutError, KafkaError, OSError) as exc:
        raise BrokerUnavailable(
            f"Kafka at {kafka.bootstrap_servers} did not answer ({type(exc).__name__}); "
            "check LLMBATCH_KAFKA__BOOTSTRAP_SERVERS"
        ) from exc
    finally:
        await admin.close()


def _topic_errors(response: Any) -> list[tuple[str, int, str | None]]:
    out = []
    for entry in getattr(response, "topic_errors", None) or getattr(response, "topic_error_codes", []):
        name, code = entry[0], entry[1]
        message = entry[2] if len(entry) > 2 and isinstance(entry[2], str) else None
        out.append((name, int(code), message))
    return out
