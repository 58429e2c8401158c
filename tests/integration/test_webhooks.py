"""Webhooks on real Kafka and Redis: the feed reads real result events from a results topic, the
deliverer posts them over HTTP to receivers that verify each with the official ``openai`` SDK.

A receiver that is down (its port closed) gets every event once it is back, each once by id; events it
did not subscribe to, another tenant's, and a record that does not decode are not sent (and stop
nothing); a restart of the whole webhooks part sends nothing twice; an endpoint that never answers
ends dead after its retries, and one whose address is not allowed is never connected to."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaProducer
from typer.testing import CliRunner

from llmbatch.adapters.topics import ensure_topics
from llmbatch.dispatcher.domain.keys import Keys
from llmbatch.dispatcher.metrics import Metrics
from llmbatch.dispatcher.ops import webhooks_cli
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.dispatcher.webhooks.runner import Webhooks
from llmbatch.dispatcher.webhooks.store import WebhookStore
from llmbatch.schemas import Envelope, encode
from llmbatch.schemas.events import (
    BatchAccepted,
    BatchCancelled,
    BatchCompleted,
    BatchExpired,
    BatchFailed,
    BatchProgress,
)
from llmbatch.schemas.webhooks import WebhookEndpoint, endpoint_secret
from llmbatch.settings import KafkaSettings, LLMBatchSettings, RedisSettings, TopicSettings
from llmbatch.settings.webhooks import WebhookSettings
from tests.support.dispatcher_kit import wait_for
from tests.support.webhook_receiver import Receiver

pytestmark = pytest.mark.integration
KEY = "s" * 40
MODEL = "m"


@dataclass
class World:
    kafka: KafkaSettings
    store: WebhookStore
    settings: WebhookSettings
    producer: AIOKafkaProducer
    metrics: Metrics
    running: list[tuple[Webhooks, list[asyncio.Task[None]]]]
    redis: RedisSettings

    async def start(self, group: str = "g") -> Webhooks:
        """The dispatcher's webhooks part, as it starts it (own consumer group on the results topic)."""
        hooks = Webhooks(
            self.settings,
            self.kafka,
            redis=self.store.client,
            keys=self.store.keys,
            group_id=f"{group}-{self.store.keys.prefix}",
            metrics=self.metrics,
        )
        await hooks.start()
        self.running.append((hooks, hooks.tasks()))
        return hooks

    async def stop_all(self) -> None:
        for hooks, tasks in self.running:
            for task in tasks:
                # a long-lived loop that ended on its own is a failure, whatever the test saw
                assert not task.done(), f"{task.get_name()} died: {task.exception()!r}"
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await hooks.stop()
        self.running.clear()

    async def endpoint(self, tenant: str, receiver: Receiver, events: tuple[Any, ...] | None = None) -> str:
        """An endpoint (as the API makes one), created a minute ago; its secret goes to the receiver."""
        extra = {} if events is None else {"events": events}
        ep = WebhookEndpoint(
            id=f"whep_{uuid.uuid4().hex[:24]}",
            tenant=tenant,
            url=receiver.url,
            created_at=int(datetime.now(UTC).timestamp()) - 60,
            **extra,
        )
        await self.store.put_endpoint(ep)
        receiver.secret = endpoint_secret(KEY.encode(), ep.id, 1)
        return ep.id

    async def publish(self, data: Any) -> str:
        envelope = Envelope.new(data, source="urn:test:dispatcher")
        key, value, headers = encode(envelope)
        await self.producer.send_and_wait(self.kafka.topics.results, value, key=key, headers=headers)
        return envelope.id

    async def publish_raw(self, value: bytes) -> None:
        await self.producer.send_and_wait(
            self.kafka.topics.results, value, key=b"x", headers=[("ce_type", b"?")]
        )


@pytest.fixture
async def world(kafka_settings: KafkaSettings, redis_settings: RedisSettings) -> AsyncIterator[World]:
    tag = uuid.uuid4().hex[:8]
    topics = TopicSettings(requests=f"req-{tag}", results=f"res-{tag}", dead_letter=f"req-{tag}.dlt")
    kafka = kafka_settings.model_copy(update={"topics": topics})
    await ensure_topics(kafka)
    store = StateStore.from_url(redis_settings.url, keys=Keys(f"w{tag}"))
    settings = WebhookSettings(
        signing_key=KEY, allow_networks=["127.0.0.1/32"], allow_http=True, retry_s=[0.3] * 40, timeout_s=5
    )
    producer = AIOKafkaProducer(**kafka.client_kwargs(), acks="all")
    await producer.start()
    w = World(
        kafka, WebhookStore(store.client, store.keys), settings, producer, Metrics(), [], redis_settings
    )
    try:
        yield w
    finally:
        try:
            await w.stop_all()
        finally:
            await producer.stop()
            keys = [k async for k in store.client.scan_iter(match=f"{store.keys.prefix}:*")]
            if keys:
                await store.client.delete(*keys)
            await store.close()


def _now() -> datetime:
    return datetime.now(UTC)


def _terminal(cls: Any, batch_id: str, tenant: str, **extra: Any) -> Any:
    return cls(batch_id=batch_id, tenant=tenant, model=MODEL, accepted_at=_now(), finished_at=_now(), **extra)


def _counted(metrics: Metrics, name: str, outcome: str) -> float:
    value = metrics.registry.get_sample_value(name, {"outcome": outcome})
    return value or 0.0


async def test_a_receiver_that_was_down_gets_every_event_once_verified_by_both_libraries(
    world: World,
) -> None:
    acme, globex = Receiver(), Receiver()
    other_library = Receiver(library="standardwebhooks")  # the same tenant's second endpoint
    await world.endpoint("acme", acme)  # down: its port refuses connections
    await world.endpoint("acme", other_library)
    other_library.up()
    await world.endpoint("globex", globex, events=("batch.completed",))
    globex.up()
    await world.start()
    expected = {
        await world.publish(_terminal(BatchCompleted, "b-done", "acme")): ("batch.completed", "b-done"),
        await world.publish(
            _terminal(BatchFailed, "b-failed", "acme", error={"code": "x", "message": "boom"})
        ): ("batch.failed", "b-failed"),
        await world.publish(_terminal(BatchCancelled, "b-cancelled", "acme")): (
            "batch.cancelled",
            "b-cancelled",
        ),
        await world.publish(_terminal(BatchExpired, "b-expired", "acme")): ("batch.expired", "b-expired"),
    }
    await world.publish_raw(b"\x00not an event")  # hostile: skipped, counted
    newline_id = Envelope.new(_terminal(BatchCompleted, "b-crlf", "acme"), source="urn:t", id="evt\r\nx: y")
    key, value, headers = encode(newline_id)  # an id no header can carry (webhook-id): skipped, counted
    await world.producer.send_and_wait(world.kafka.topics.results, value, key=key, headers=headers)
    await world.publish(BatchProgress(batch_id="b-done", tenant="acme", updated_at=_now()))  # not a webhook
    await world.publish(  # acme's endpoint did not ask for accepted events
        BatchAccepted(
            batch_id="b-new",
            tenant="acme",
            model=MODEL,
            endpoint="/v1/chat/completions",
            accepted_at=_now(),
            expires_at=_now(),
        )
    )
    globex_done = await world.publish(_terminal(BatchCompleted, "g-done", "globex"))
    await world.publish(_terminal(BatchFailed, "g-failed", "globex", error={"code": "x", "message": "no"}))

    await wait_for(lambda: globex.ids() == [globex_done], 60, what="globex's one delivery")
    # acme's receiver is down: its deliveries fail and wait for their next attempt
    await wait_for(
        lambda: _counted(world.metrics, "llmbatch_webhook_deliveries_total", "retried") >= 8,
        60,
        what="failed attempts to acme's closed port",
    )
    assert acme.accepted == []
    acme.up()
    await wait_for(lambda: len(acme.accepted) >= 4, 60, what="acme's four events")
    got = {r.webhook_id: (r.type, r.batch_id) for r in acme.accepted}
    assert got == expected and sorted(acme.ids()) == sorted(expected)  # each once, by id
    assert all(r.event_id == r.webhook_id for r in acme.accepted)  # the Kafka event's id, both ways
    assert acme.refused == [] and globex.refused == []
    # a receiver written with the standardwebhooks library verified the same events, each once
    assert {(r.webhook_id, (r.type, r.batch_id)) for r in other_library.accepted} == set(got.items())
    assert len(other_library.accepted) == 4 and other_library.refused == []
    assert _counted(world.metrics, "llmbatch_webhook_events_total", "invalid") == 2

    async def settled() -> bool:  # the last answer's settle may follow its receipt by a moment
        return await world.store.depth() == 0

    await wait_for(settled, 30, what="every delivery settled")

    # every part restarted, with its consumer group's offsets lost (a crash after queueing, before the
    # commit): the whole topic is read again, and nothing is sent twice; a new event is sent
    await world.stop_all()
    await world.start(group="again")
    await wait_for(
        lambda: _counted(world.metrics, "llmbatch_webhook_events_total", "invalid") == 4,
        60,
        what="the topic read again",
    )
    later = await world.publish(_terminal(BatchCompleted, "b-later", "acme"))
    await wait_for(lambda: later in acme.ids(), 60, what="the event after the restart")
    assert sorted(acme.ids()) == sorted([*expected, later]) and globex.ids() == [globex_done]
    await wait_for(lambda: later in other_library.ids(), 60, what="the event after the restart, too")
    assert sorted(other_library.ids()) == sorted([*expected, later])
    for receiver in (acme, globex, other_library):
        receiver.down()


async def test_an_endpoint_that_never_answers_ends_dead_after_its_retries(world: World) -> None:
    world.settings = world.settings.model_copy(update={"retry_s": [0.2, 0.2]})
    never = Receiver()  # never up
    await world.endpoint("acme", never)
    await world.start()
    event = await world.publish(_terminal(BatchCompleted, "b-1", "acme"))
    dead = await wait_for(world.store.dead, 60, what="the dead delivery")
    assert [(d["event_id"], d["attempts"], d["batch_id"]) for d in dead] == [(event, "3", "b-1")]
    assert "Connection refused" in dead[0]["last_error"] or "ConnectionRefused" in dead[0]["last_error"]
    assert _counted(world.metrics, "llmbatch_webhook_deliveries_total", "dead") == 1
    assert await world.store.depth() == 0
    # what an operator sees (`llmbatch webhooks dead --json`, `pending`)
    settings = LLMBatchSettings(redis=world.redis.model_copy(update={"key_prefix": world.store.keys.prefix}))
    shown = await asyncio.to_thread(CliRunner().invoke, webhooks_cli.app, ["dead", "--json"], obj=settings)
    assert shown.exit_code == 0, shown.output
    (row,) = orjson.loads(shown.stdout)
    assert (row["event_id"], row["tenant"], row["attempts"]) == (event, "acme", "3")
    waiting = await asyncio.to_thread(
        CliRunner().invoke, webhooks_cli.app, ["pending", "--json"], obj=settings
    )
    assert orjson.loads(waiting.stdout) == {"pending": 0}


async def test_an_address_the_operator_does_not_allow_is_never_connected_to(world: World) -> None:
    """An endpoint stored while 127.0.0.1 was allowed, delivered after the allow-list lost it."""
    world.settings = world.settings.model_copy(update={"allow_networks": [], "retry_s": [0.2]})
    receiver = Receiver()
    receiver.up()
    await world.endpoint("acme", receiver)
    await world.start()
    await world.publish(_terminal(BatchCompleted, "b-1", "acme"))
    dead = await wait_for(world.store.dead, 60, what="the refused delivery's end")
    assert "LLMBATCH_WEBHOOKS__ALLOW_NETWORKS" in dead[0]["last_error"]
    assert receiver.accepted == [] and receiver.refused == []
    receiver.down()


async def test_a_deleted_endpoints_deliveries_are_dropped(world: World) -> None:
    receiver = Receiver()  # down
    endpoint = await world.endpoint("acme", receiver)
    await world.start()
    await world.publish(_terminal(BatchCompleted, "b-1", "acme"))
    await wait_for(
        lambda: _counted(world.metrics, "llmbatch_webhook_deliveries_total", "retried") >= 1,
        60,
        what="a retry",
    )
    await world.store.delete_endpoint("acme", endpoint)
    await wait_for(
        lambda: _counted(world.metrics, "llmbatch_webhook_deliveries_total", "dropped") == 1,
        60,
        what="the drop",
    )
    assert await world.store.depth() == 0 and await world.store.dead() == []
