"""Create the llmbatch topics when missing (the dispatcher and the local stack reuse this)."""

from __future__ import annotations

import asyncio
from typing import Any

from llmbatch.adapters.errors import BrokerUnavailable, ProducerError
from llmbatch.schemas.compat import TIMEOUT_ERRORS
from llmbatch.settings import KafkaSettings, LLMBatchSettings

TOPIC_ALREADY_EXISTS = 36
TOPIC_AUTHORIZATION_FAILED = 29
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
            elif code == TOPIC_AUTHORIZATION_FAILED:
                raise ProducerError(
                    f"cannot create topic {name!r}: this Kafka user may not (TOPIC_AUTHORIZATION_FAILED); "
                    "a Kafka admin creates the topics (`llmbatch dispatcher kafka-acl --apply` does)"
                )
            elif code != TOPIC_ALREADY_EXISTS:
                raise ProducerError(f"cannot create topic {name!r}: error {code} {message or ''}".strip())
        return created
    except (*TIMEOUT_ERRORS, KafkaError, OSError) as exc:
        raise _unavailable(kafka, exc) from exc
    finally:
        await admin.close()


def size_problems(kafka: KafkaSettings, described: dict[str, dict[str, str]]) -> list[str]:
    """What an existing topic's ``max.message.bytes`` (``described``: topic -> its configs) refuses
    that the settings let through: one line per topic, naming the setting and both fixes. Pure."""
    wanted = {role: int(cfg["max.message.bytes"]) for role, cfg in topic_configs(kafka).items()}
    setting = {
        "requests": "LLMBATCH_KAFKA__TOPICS__MAX_MESSAGE_BYTES",
        "results": "LLMBATCH_KAFKA__TOPICS__MAX_MESSAGE_BYTES",
        "dead_letter": "LLMBATCH_KAFKA__TOPICS__DEAD_LETTER_MAX_MESSAGE_BYTES",
    }
    problems = []
    for role, name in topic_names(kafka).items():
        raw = described.get(name, {}).get("max.message.bytes")
        if raw is None or not raw.isdigit() or int(raw) >= wanted[role]:
            continue
        problems.append(
            f"topic {name!r} takes records up to max.message.bytes={raw}, less than {setting[role]}="
            f"{wanted[role]}: larger records would be refused by the broker; raise the topic's "
            f"max.message.bytes (kafka-configs --alter --entity-type topics --entity-name {name} "
            f"--add-config max.message.bytes={wanted[role]}) or lower the setting"
        )
    return problems


async def check_topic_sizes(
    settings: LLMBatchSettings | KafkaSettings, *, timeout_s: float = 15.0
) -> list[str]:
    """:func:`size_problems` of the llmbatch topics as the broker has them (topics that do not exist
    are skipped). Raises :class:`BrokerUnavailable` when the broker does not answer."""
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
    from aiokafka.errors import KafkaError

    kafka = settings.kafka if isinstance(settings, LLMBatchSettings) else settings
    admin = AIOKafkaAdminClient(**kafka.client_kwargs())
    try:
        await asyncio.wait_for(admin.start(), timeout_s)
        names = list(topic_names(kafka).values())  # one that does not exist answers an error: skipped
        resources = [
            ConfigResource(ConfigResourceType.TOPIC, n, configs={"max.message.bytes": None}) for n in names
        ]
        responses = await asyncio.wait_for(admin.describe_configs(resources), timeout_s)
    except (*TIMEOUT_ERRORS, KafkaError, OSError) as exc:
        raise _unavailable(kafka, exc) from exc
    finally:
        await admin.close()
    described: dict[str, dict[str, str]] = {}
    for response in responses:
        for resource in response.resources:
            error_code, name, entries = resource[0], resource[3], resource[4]
            if error_code == 0:
                described[name] = {str(e[0]): str(e[1]) for e in entries if e[1] is not None}
    return size_problems(kafka, described)


def _unavailable(kafka: KafkaSettings, exc: BaseException) -> BrokerUnavailable:
    return BrokerUnavailable(
        f"Kafka at {kafka.bootstrap_servers} did not answer ({type(exc).__name__}); "
        "check LLMBATCH_KAFKA__BOOTSTRAP_SERVERS"
    )


def _topic_errors(response: Any) -> list[tuple[str, int, str | None]]:
    out = []
    for entry in getattr(response, "topic_errors", None) or getattr(response, "topic_error_codes", []):
        name, code = entry[0], entry[1]
        message = entry[2] if len(entry) > 2 and isinstance(entry[2], str) else None
        out.append((name, int(code), message))
    return out
