"""Least privilege in Kafka (issue 14, item 2) on a real broker: a private KRaft Kafka with SCRAM-SHA-512
users and the StandardAuthorizer (nothing allowed without an ACL), loaded with ``llmbatch dispatcher
kafka-acl --apply``'s bindings. The producer writes requests and is refused on the results topic; only
the dispatcher reads requests (in its group) and writes results and dead letters; the operator reads
dead letters and replays to the requests topic; a user without ACLs reads nothing; a wrong password is
refused as such. Each refusal is checked to be the project's non-retriable error naming the topic."""

from __future__ import annotations

import asyncio
import os
import secrets
import stat
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import GroupAuthorizationFailedError, TopicAuthorizationFailedError
from pydantic import SecretStr

from llmbatch.adapters.errors import AuthenticationFailed, NotAuthorized, TopicMissing
from llmbatch.adapters.kafka import Publisher, follow_events
from llmbatch.adapters.topics import check_topic_sizes, ensure_topics
from llmbatch.dispatcher.domain.dlt import OriginalRecord, build_dead_letter
from llmbatch.dispatcher.errors import KafkaAuthenticationFailed
from llmbatch.dispatcher.kafka.publisher import EventProducer
from llmbatch.dispatcher.ops.dlq_reader import read_dead_letters
from llmbatch.schemas.batch import CancelRequest
from llmbatch.schemas.cloudevents import Envelope
from llmbatch.schemas.events import BatchAccepted
from llmbatch.settings import KafkaSettings, TopicSettings
from llmbatch.stack import kafka_broker
from llmbatch.stack.process import alive, stop_tree
from llmbatch.stack.state import ServiceRecord
from tests.support.dispatcher_kit import MODEL, batch_request

pytestmark = pytest.mark.integration

ROLES = ("producer", "dispatcher", "operator")
REFUSAL_S = 10.0  # a refusal is answered at once; the publish timeout (30 s) would mean a retry loop


@dataclass
class AclKafka:
    record: ServiceRecord
    sasl: kafka_broker.KafkaSasl
    topics: TopicSettings
    group: str
    before_acls: BaseException | None = None
    applied: tuple[str, str] = ("", "")

    def settings(self, user: str, password: str | None = None) -> KafkaSettings:
        return KafkaSettings(
            bootstrap_servers=self.record.address,
            security_protocol="SASL_PLAINTEXT",
            sasl_mechanism="SCRAM-SHA-512",
            sasl_username=user,
            sasl_password=SecretStr(password or self.sasl.passwords[user]),
            request_timeout_ms=10_000,
            topics=self.topics,
        )

    def env(self, user: str, password: str | None = None) -> dict[str, str]:
        """The CLI's settings for ``user`` (the password only in the environment)."""
        return {
            **os.environ,
            "LLMBATCH_KAFKA__BOOTSTRAP_SERVERS": self.record.address,
            "LLMBATCH_KAFKA__SECURITY_PROTOCOL": "SASL_PLAINTEXT",
            "LLMBATCH_KAFKA__SASL_MECHANISM": "SCRAM-SHA-512",
            "LLMBATCH_KAFKA__SASL_USERNAME": user,
            "LLMBATCH_KAFKA__SASL_PASSWORD": password or self.sasl.passwords[user],
            "LLMBATCH_KAFKA__TOPICS__REQUESTS": self.topics.requests,
            "LLMBATCH_KAFKA__TOPICS__RESULTS": self.topics.results,
            "LLMBATCH_KAFKA__TOPICS__DEAD_LETTER": self.topics.dead_letter,
            "LLMBATCH_KAFKA__TOPICS__PARTITIONS": "1",
            "LLMBATCH_DISPATCHER__GROUP_ID": self.group,
        }


async def kafka_acl_cli(env: dict[str, str], *args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "llmbatch",
        "dispatcher",
        "kafka-acl",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode or 0, out.decode()


def request_envelope(batch_id: str) -> Envelope[Any]:
    return Envelope.new(batch_request(batch_id), source="urn:test:acl")


@pytest.fixture(scope="module")
async def acl_kafka(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[AclKafka]:
    tag = uuid.uuid4().hex[:6]
    topics = TopicSettings(
        requests=f"acl{tag}.requests",
        results=f"acl{tag}.results",
        dead_letter=f"acl{tag}.requests.dlt",
        partitions=1,
    )
    users = ("admin", *ROLES, "nobody")
    sasl = kafka_broker.KafkaSasl("admin", {u: secrets.token_urlsafe(18) for u in users})
    rec = await asyncio.to_thread(kafka_broker.start_kafka, tmp_path_factory.mktemp("kafka-acl"), sasl=sasl)
    try:
        kafka = AclKafka(rec, sasl, topics, f"acl{tag}-dispatcher")
        # the topics exist (made by the admin) but no ACL does: the producer is refused even on requests
        await ensure_topics(kafka.settings("admin"))
        before = Publisher(kafka.settings("producer"))
        try:
            await before.publish(topics.requests, request_envelope("b-before"))
        except Exception as exc:
            kafka.before_acls = exc
        finally:
            await before.stop()
        first = await kafka_acl_cli(kafka.env("admin"), "--apply")
        second = await kafka_acl_cli(kafka.env("admin"), "--apply")
        assert first[0] == 0 and second[0] == 0, (first, second)
        kafka.applied = (first[1], second[1])
        yield kafka
    finally:
        if alive(rec.pid):
            stop_tree(rec.pid)


async def test_apply_creates_the_bindings_once_and_before_them_the_producer_is_refused(
    acl_kafka: AclKafka,
) -> None:
    assert isinstance(acl_kafka.before_acls, NotAuthorized), acl_kafka.before_acls
    assert acl_kafka.topics.requests in str(acl_kafka.before_acls)
    first, second = acl_kafka.applied
    created = 4 + 11 + 4  # producer, dispatcher, operator (tests/unit/test_kafka_acl.py lists them)
    assert f"{created} binding(s) created, 0 already present" in first, first
    assert f"0 binding(s) created, {created} already present" in second, second
    assert not [p for p in acl_kafka.sasl.passwords.values() if p in first + second]
    assert "created topic" not in first  # the admin had made them before: left alone
    # a user that is not a super user cannot apply them: the CLI says so, once, and stops
    code, out = await kafka_acl_cli(acl_kafka.env("dispatcher"), "--apply")
    assert code == 1, out
    assert "Kafka does not allow this user to describe the ACLs" in out and "super user" in out, out


async def test_the_producer_publishes_requests_and_is_refused_on_results(acl_kafka: AclKafka) -> None:
    kafka = acl_kafka.settings("producer")
    for idempotent in (False, True):  # an idempotent producer needs no IdempotentWrite (KIP-679)
        publisher = Publisher(kafka, enable_idempotence=idempotent)
        try:
            published = await publisher.publish(kafka.topics.requests, request_envelope(f"b-p{idempotent:d}"))
            assert published.topic == kafka.topics.requests
            for topic in (kafka.topics.results, kafka.topics.dead_letter):
                started = time.monotonic()
                with pytest.raises(NotAuthorized) as refused:
                    await publisher.publish(topic, request_envelope("b-wrong-topic"))
                assert time.monotonic() - started < REFUSAL_S
                assert not refused.value.retriable
                assert f"topic {topic!r}" in str(refused.value) and "user 'producer'" in str(refused.value)
                assert "TopicAuthorizationFailedError" in str(refused.value)
        finally:
            await publisher.stop()
    # it sees the requests topic (Write implies Describe) but cannot read what it wrote
    with pytest.raises(NotAuthorized, match=f"user 'producer' to read topic '{kafka.topics.requests}'"):
        async with aclosing(follow_events(kafka, kafka.topics.requests)) as events:
            await asyncio.wait_for(anext(events), 30)


async def test_the_dispatcher_reads_requests_in_its_group_and_writes_results_and_dead_letters(
    acl_kafka: AclKafka,
) -> None:
    batch_id = f"b-d-{uuid.uuid4().hex[:6]}"
    producer = Publisher(acl_kafka.settings("producer"))
    try:
        await producer.publish(acl_kafka.topics.requests, request_envelope(batch_id))
    finally:
        await producer.stop()
    kafka = acl_kafka.settings("dispatcher")
    # its start: the topics are seen (nothing to create) and their configs are described
    assert await ensure_topics(kafka) == []
    larger = kafka.model_copy(
        update={
            "topics": kafka.topics.model_copy(
                update={"max_message_bytes": kafka.topics.max_message_bytes * 2}
            )
        }
    )
    problems = await check_topic_sizes(larger)
    assert len(problems) == 2 and kafka.topics.requests in problems[0], problems  # DescribeConfigs works

    consumer = AIOKafkaConsumer(
        kafka.topics.requests,
        group_id=acl_kafka.group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        **kafka.client_kwargs(),
    )
    await consumer.start()
    try:
        record = await _first(consumer, batch_id.encode())
        await consumer.commit()
    finally:
        await consumer.stop()
    events = EventProducer(kafka)
    await events.start()
    try:
        now = datetime.now(UTC)
        accepted = BatchAccepted(
            batch_id=batch_id,
            model=MODEL,
            endpoint="/v1/chat/completions",
            accepted_at=now,
            expires_at=now + timedelta(days=1),
        )
        await (await events.send_event(kafka.topics.results, Envelope.new(accepted, source="urn:test:d")))
        letter = build_dead_letter(
            OriginalRecord.from_consumer_record(record),
            dlt_topic=kafka.topics.dead_letter,
            reason="invalid_event",
            group_id=acl_kafka.group,
            fqcn="test.Acl",
            message="by the dispatcher",
        )
        meta = await (await events.send_dead_letter(letter))
        assert meta.topic == kafka.topics.dead_letter
    finally:
        await events.stop()
    # the producer follows the results topic and sees the dispatcher's event
    async with aclosing(
        follow_events(
            acl_kafka.settings("producer"), kafka.topics.results, batch_id=batch_id, stop_at_terminal=False
        )
    ) as seen:
        assert (await asyncio.wait_for(anext(seen), 30)).subject == batch_id

    other = AIOKafkaConsumer(
        kafka.topics.requests,
        group_id=f"{acl_kafka.group}-other",
        enable_auto_commit=False,
        **kafka.client_kwargs(),
    )
    with pytest.raises(GroupAuthorizationFailedError):
        await asyncio.wait_for(other.start(), 30)
    await other.stop()
    wrong = Publisher(kafka)
    try:
        with pytest.raises(NotAuthorized, match=f"write topic '{kafka.topics.requests}'"):
            await wrong.publish(kafka.topics.requests, request_envelope("b-not-mine"))
    finally:
        await wrong.stop()


async def test_the_operator_reads_dead_letters_and_replays_only_to_requests(acl_kafka: AclKafka) -> None:
    dispatcher = EventProducer(acl_kafka.settings("dispatcher"))
    await dispatcher.start()
    try:
        origin = OriginalRecord(acl_kafka.topics.requests, 0, 0, b"b-op", b"{}")
        letter = build_dead_letter(
            origin,
            dlt_topic=acl_kafka.topics.dead_letter,
            reason="invalid_event",
            group_id=acl_kafka.group,
            fqcn="test.Acl",
            message="for the operator",
        )
        await (await dispatcher.send_dead_letter(letter))
    finally:
        await dispatcher.stop()
    kafka = acl_kafka.settings("operator")
    snap = await read_dead_letters(kafka, kafka.topics.dead_letter)
    assert snap.exists and any(v.key == b"b-op" for v in snap.letters), snap
    publisher = Publisher(kafka)
    try:
        replayed = Envelope.new(CancelRequest(batch_id="b-op"), source="urn:o")
        await publisher.publish(kafka.topics.requests, replayed)
        with pytest.raises(NotAuthorized, match=f"topic '{kafka.topics.results}'"):
            await publisher.publish(kafka.topics.results, request_envelope("b-op"))
    finally:
        await publisher.stop()
    with pytest.raises(TopicMissing, match="may not read it"):
        async with aclosing(follow_events(kafka, kafka.topics.results)) as events:
            await anext(events)


async def test_a_user_without_acls_reads_and_writes_nothing(acl_kafka: AclKafka) -> None:
    kafka = acl_kafka.settings("nobody")  # a valid SCRAM login, no binding
    admin = AIOKafkaAdminClient(**kafka.client_kwargs())
    await admin.start()
    try:
        visible = set(await admin.list_topics())
    finally:
        await admin.close()
    assert not visible & {acl_kafka.topics.requests, acl_kafka.topics.results, acl_kafka.topics.dead_letter}
    for topic in (kafka.topics.requests, kafka.topics.results, kafka.topics.dead_letter):
        with pytest.raises(TopicMissing, match="or user 'nobody' may not read it"):
            async with aclosing(follow_events(kafka, topic)) as events:
                await anext(events)
    # even in the dispatcher's group: the topic is refused before the group is asked
    consumer = AIOKafkaConsumer(
        kafka.topics.requests, group_id=acl_kafka.group, enable_auto_commit=False, **kafka.client_kwargs()
    )
    with pytest.raises(TopicAuthorizationFailedError):
        await asyncio.wait_for(consumer.start(), 30)
    await consumer.stop()
    snap = await read_dead_letters(kafka, kafka.topics.dead_letter)
    assert not snap.exists and not snap.letters
    publisher = Publisher(kafka)
    try:
        with pytest.raises(NotAuthorized, match="user 'nobody'"):
            await publisher.publish(kafka.topics.requests, request_envelope("b-nobody"))
    finally:
        await publisher.stop()


async def test_a_wrong_password_is_refused_as_such_and_not_retried(acl_kafka: AclKafka) -> None:
    wrong = "not-" + secrets.token_urlsafe(8)
    started = time.monotonic()
    publisher = Publisher(acl_kafka.settings("producer", wrong))
    with pytest.raises(AuthenticationFailed) as refused:
        await publisher.publish(acl_kafka.topics.requests, request_envelope("b-pw"))
    assert time.monotonic() - started < 2 * REFUSAL_S and not refused.value.retriable
    said = str(refused.value)
    assert "user 'producer'" in said and "LLMBATCH_KAFKA__SASL_PASSWORD" in said
    assert "invalid credentials" in said
    assert wrong not in said
    with pytest.raises(KafkaAuthenticationFailed) as dispatcher_refused:
        await EventProducer(acl_kafka.settings("dispatcher", wrong)).start()
    assert not dispatcher_refused.value.retriable and "user 'dispatcher'" in str(dispatcher_refused.value)
    code, out = await kafka_acl_cli(acl_kafka.env("admin", wrong), "--apply")
    assert code == 1 and "refused the SCRAM-SHA-512 login of user 'admin'" in out and wrong not in out, out


def test_passwords_stay_out_of_the_command_line_and_the_log(acl_kafka: AclKafka) -> None:
    cmdline = Path(f"/proc/{acl_kafka.record.pid}/cmdline").read_bytes().decode(errors="replace")
    log = Path(acl_kafka.record.log).read_text(errors="replace")
    data = Path(acl_kafka.record.data_dir)
    for password in acl_kafka.sasl.passwords.values():
        assert password not in cmdline and password not in log
    assert stat.S_IMODE((data / "server.properties").stat().st_mode) == 0o600
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    assert not (data / "format.args").exists()


async def _first(consumer: AIOKafkaConsumer, key: bytes) -> object:
    deadline = time.monotonic() + 60  # joining the group may take a while on a loaded machine
    while time.monotonic() < deadline:
        for records in (await consumer.getmany(timeout_ms=1000)).values():
            for record in records:
                if record.key == key:
                    return record
    raise AssertionError(f"no record keyed {key!r} in {consumer.subscription()}")
