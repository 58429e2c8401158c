"""Topic creation and the size check of existing topics (producer.topics) against a real Kafka."""

from __future__ import annotations

import uuid

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from llmbatch.adapters.topics import check_topic_sizes, ensure_topics, size_problems
from llmbatch.settings import KafkaSettings, TopicSettings
from tests.support.dispatcher_kit import wait_for

pytestmark = pytest.mark.integration


def with_topics(kafka: KafkaSettings) -> KafkaSettings:
    tag = uuid.uuid4().hex[:8]
    topics = TopicSettings(requests=f"req-{tag}", results=f"res-{tag}", dead_letter=f"req-{tag}.dlt")
    return kafka.model_copy(update={"topics": topics})


async def test_topics_created_from_the_settings_pass_the_size_check(kafka_settings: KafkaSettings) -> None:
    kafka = with_topics(kafka_settings)
    assert await check_topic_sizes(kafka) == []  # none exists yet: nothing to say
    assert sorted(await ensure_topics(kafka)) == sorted(
        [kafka.topics.requests, kafka.topics.results, kafka.topics.dead_letter]
    )
    assert await check_topic_sizes(kafka) == []


async def test_an_existing_topic_smaller_than_the_settings_is_named_with_the_fix(
    kafka_settings: KafkaSettings,
) -> None:
    """A dead-letter topic made by hand with 64 KiB (ensure_topics leaves existing topics alone)."""
    kafka = with_topics(kafka_settings)
    admin = AIOKafkaAdminClient(**kafka.client_kwargs())
    await admin.start()
    try:
        await admin.create_topics(
            [
                NewTopic(
                    kafka.topics.dead_letter,
                    num_partitions=1,
                    replication_factor=1,
                    topic_configs={"max.message.bytes": "65536"},
                )
            ]
        )
    finally:
        await admin.close()
    await ensure_topics(kafka)
    # a topic just created may not be described yet (metadata still spreading): ask until it is
    [problem] = await wait_for(lambda: check_topic_sizes(kafka), 30, what="the small topic described")
    assert f"'{kafka.topics.dead_letter}'" in problem and "max.message.bytes=65536" in problem
    wanted = kafka.topics.dead_letter_max_message_bytes
    assert f"LLMBATCH_KAFKA__TOPICS__DEAD_LETTER_MAX_MESSAGE_BYTES={wanted}" in problem


def test_size_problems_compares_each_role_with_its_own_setting(kafka_settings: KafkaSettings) -> None:
    kafka = with_topics(kafka_settings)
    t = kafka.topics
    same = t.max_message_bytes
    described = {
        t.requests: {"max.message.bytes": str(same - 1)},
        t.results: {"max.message.bytes": str(same)},
        t.dead_letter: {"max.message.bytes": str(t.dead_letter_max_message_bytes)},
    }
    [problem] = size_problems(kafka, described)
    assert f"'{t.requests}'" in problem and "LLMBATCH_KAFKA__TOPICS__MAX_MESSAGE_BYTES" in problem
    assert size_problems(kafka, {t.requests: {"max.message.bytes": "junk"}}) == []
