"""Kafka plumbing of the SDK: a publisher of CloudEvents and a follower of the results topic.

Both wrap aiokafka with short, explicit timeouts and turn its errors into
:mod:`llmbatch.adapters.errors` types that name the setting to check.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import AsyncGenerator, Collection
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from llmbatch.adapters.errors import (
    AuthenticationFailed,
    BrokerUnavailable,
    NotAuthorized,
    ProducerError,
    PublishFailed,
    TopicMissing,
)
from llmbatch.schemas import Envelope, EventType, SchemaError, decode, encode
from llmbatch.schemas.compat import TIMEOUT_ERRORS
from llmbatch.schemas.tenant_auth import TenantSigner
from llmbatch.settings import KafkaSettings

log = logging.getLogger(__name__)
_DEDUPE_WINDOW = 10_000


def _unreachable(kafka: KafkaSettings, exc: BaseException | None = None) -> BrokerUnavailable:
    why = ""
    if exc is not None:
        text = str(exc).removeprefix(f"{type(exc).__name__}: ")
        why = f" ({type(exc).__name__}: {text})" if text else f" ({type(exc).__name__})"
    return BrokerUnavailable(
        f"Kafka at {kafka.bootstrap_servers} is unreachable{why}; check LLMBATCH_KAFKA__BOOTSTRAP_SERVERS "
        "and that the broker is running"
    )


async def authentication_failure(kafka: KafkaSettings, timeout_s: float = 10.0) -> str | None:
    """Why the broker refuses ``kafka``'s SASL login (one line naming the user and the settings, never
    the password), or None: the login works, the settings use no SASL, or the broker does not answer.

    aiokafka's bootstrap logs the broker's refusal and raises only "Unable to bootstrap", which reads
    as an outage; one direct connection to the first bootstrap server gets the refusal back."""
    if not kafka.security_protocol.startswith("SASL"):
        return None
    from aiokafka.conn import create_conn
    from aiokafka.errors import (
        AuthenticationFailedError,
        SaslAuthenticationFailed,
        UnsupportedSaslMechanismError,
    )

    host, _, port = kafka.bootstrap_servers.split(",")[0].rpartition(":")
    options = {k: v for k, v in kafka.client_kwargs().items() if k != "bootstrap_servers"}
    try:
        conn = await asyncio.wait_for(create_conn(host, int(port), **options), timeout_s)
    except (SaslAuthenticationFailed, AuthenticationFailedError, UnsupportedSaslMechanismError) as exc:
        said = str(exc).removeprefix(f"[Error {getattr(exc, 'errno', '')}] ").strip() or type(exc).__name__
        return (
            f"Kafka at {kafka.bootstrap_servers} refused the {kafka.sasl_mechanism} login of user "
            f"{kafka.sasl_username!r} ({said}); check LLMBATCH_KAFKA__SASL_USERNAME and "
            "LLMBATCH_KAFKA__SASL_PASSWORD"
        )
    except Exception:  # unreachable, timed out: not an authentication problem
        return None
    conn.close()
    return None


async def _start_failure(kafka: KafkaSettings, exc: BaseException) -> ProducerError:
    """The error for a client that did not start: refused credentials, else unreachable."""
    why = await authentication_failure(kafka)
    return AuthenticationFailed(why) if why is not None else _unreachable(kafka, exc)


def _refused(kafka: KafkaSettings, topic: str, exc: BaseException, action: str) -> NotAuthorized:
    user = f"user {kafka.sasl_username!r}" if kafka.sasl_username else "this client"
    return NotAuthorized(
        f"Kafka does not allow {user} to {action} topic {topic!r} ({type(exc).__name__}); ask the Kafka "
        "admin for the ACL (`llmbatch dispatcher kafka-acl` lists what each role gets)"
    )


_NOT_AUTHORIZED = frozenset(
    {"TopicAuthorizationFailedError", "ClusterAuthorizationFailedError", "TransactionalIdAuthorizationFailed"}
)


@dataclass(frozen=True, slots=True)
class Published:
    """Where a record landed."""

    topic: str
    partition: int
    offset: int


class Publisher:
    """Publishes :class:`~llmbatch.schemas.Envelope`\\ s with ``acks=all``, key = batch_id; with a ``signer``,
    requests and cancels of the tenants it has keys for carry ``llmbatch-tenant-sig``."""

    def __init__(
        self,
        kafka: KafkaSettings,
        *,
        connect_timeout_s: float = 10.0,
        publish_timeout_s: float = 30.0,
        enable_idempotence: bool = False,
        linger_ms: int = 0,
        compression_type: str | None = None,
        signer: TenantSigner | None = None,
    ) -> None:
        self._kafka = kafka
        self._signer = signer
        self._connect_timeout_s = connect_timeout_s
        self._publish_timeout_s = publish_timeout_s
        self._options: dict[str, Any] = {
            "acks": "all",
            "enable_idempotence": enable_idempotence,
            "linger_ms": linger_ms,
            "compression_type": compression_type,
            # the requests topic is created with this max.message.bytes (producer.topics)
            "max_request_size": kafka.topics.max_message_bytes,
        }
        self._producer: Any = None
        self._starting = asyncio.Lock()  # concurrent first publishes (the HTTP API) share one producer

    async def start(self) -> None:
        """Connect to the cluster (fails fast with :class:`BrokerUnavailable`)."""
        if self._producer is not None:
            return
        async with self._starting:
            if self._producer is not None:
                return
            from aiokafka import AIOKafkaProducer
            from aiokafka.errors import KafkaError

            producer = AIOKafkaProducer(**self._kafka.client_kwargs(), **self._options)
            try:
                await asyncio.wait_for(producer.start(), self._connect_timeout_s)
            except (*TIMEOUT_ERRORS, KafkaError, OSError) as exc:
                await _quietly(producer.stop())
                raise await _start_failure(self._kafka, exc) from exc
            self._producer = producer

    async def stop(self) -> None:
        """Flush and disconnect."""
        producer, self._producer = self._producer, None
        if producer is not None:
            await _quietly(producer.stop())

    async def publish(self, topic: str, envelope: Envelope[Any]) -> Published:
        """Publish one event and wait until all in-sync replicas have it."""
        (result,) = await self.publish_many(topic, [envelope])
        return result

    async def publish_many(self, topic: str, envelopes: Collection[Envelope[Any]]) -> list[Published]:
        """Publish several events, pipelined, and wait for every acknowledgement."""
        from aiokafka.errors import (
            KafkaConnectionError,
            KafkaError,
            KafkaTimeoutError,
            NotEnoughReplicasError,
            RequestTimedOutError,
        )

        await self.start()
        try:

            async def send_all() -> list[Any]:
                futures = []
                for envelope in envelopes:
                    key, value, headers = encode(envelope)
                    signature = self._signer.sign(envelope, value) if self._signer else None
                    if signature is not None:
                        headers.append(signature)
                    futures.append(await self._producer.send(topic, value=value, key=key, headers=headers))
                return list(await asyncio.gather(*futures))

            metas = await asyncio.wait_for(send_all(), self._publish_timeout_s)
        except TIMEOUT_ERRORS as exc:
            raise BrokerUnavailable(
                f"Kafka at {self._kafka.bootstrap_servers} did not acknowledge within "
                f"{self._publish_timeout_s:g}s (is topic {topic!r} created? see `ensure_topics`)"
            ) from exc
        except (KafkaConnectionError, KafkaTimeoutError, RequestTimedOutError, NotEnoughReplicasError) as exc:
            raise _unreachable(self._kafka, exc) from exc
        except KafkaError as exc:
            if type(exc).__name__ in _NOT_AUTHORIZED:
                raise _refused(self._kafka, topic, exc, "write") from exc
            raise PublishFailed(
                f"Kafka rejected the event for topic {topic!r}: {type(exc).__name__}: {exc}"
            ) from exc
        return [Published(m.topic, m.partition, m.offset) for m in metas]


async def _quietly(awaitable: Any) -> None:
    try:
        await awaitable
    except Exception:  # closing a half-started client must not hide the real error
        log.debug("ignored error while closing a Kafka client", exc_info=True)


async def follow_events(
    kafka: KafkaSettings,
    topic: str,
    *,
    batch_id: str | None = None,
    tenant: str | None = None,
    since: datetime | None = None,
    from_end: bool = False,
    stop_at_terminal: bool = True,
    expect: Collection[EventType] | None = None,
    connect_timeout_s: float = 10.0,
    poll_timeout_s: float = 0.5,
) -> AsyncGenerator[Envelope[Any], None]:
    """Yield events of ``topic`` (optionally only those keyed by ``batch_id``, and only those of
    ``tenant``: batch ids are scoped by tenant) as they arrive.

    Starting point per partition: the first offset at or after ``since`` (``offsets_for_times``,
    so the topic is not re-read from the start), or the end when ``from_end`` is set, or the
    beginning when neither is given. Records that are not valid events are logged and skipped.
    Duplicates (same ``ce_source`` + ``ce_id``) are dropped. With ``stop_at_terminal`` and a
    ``batch_id``, the generator ends after that batch's terminal event. Use it with
    ``contextlib.aclosing`` so the consumer is closed when you stop early.
    """
    from aiokafka import AIOKafkaConsumer, TopicPartition
    from aiokafka.errors import KafkaError

    consumer = AIOKafkaConsumer(
        **kafka.client_kwargs(), group_id=None, enable_auto_commit=False, auto_offset_reset="earliest"
    )
    try:
        try:
            await asyncio.wait_for(consumer.start(), connect_timeout_s)
        except (*TIMEOUT_ERRORS, KafkaError, OSError) as exc:
            raise await _start_failure(kafka, exc) from exc
        try:
            partitions = await asyncio.wait_for(_partitions(consumer, topic), connect_timeout_s)
        except (*TIMEOUT_ERRORS, KafkaError, OSError) as exc:
            raise _unreachable(kafka, exc) from exc
        if not partitions:
            # Kafka lists only the topics a user may Describe: missing and forbidden look alike
            hidden = f", or user {kafka.sasl_username!r} may not read it" if kafka.sasl_username else ""
            raise TopicMissing(f"topic {topic!r} does not exist on {kafka.bootstrap_servers}{hidden}")
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        try:
            starts = await asyncio.wait_for(_start_offsets(consumer, tps, since, from_end), connect_timeout_s)
        except (*TIMEOUT_ERRORS, KafkaError, OSError) as exc:
            if type(exc).__name__ in _NOT_AUTHORIZED:
                raise _refused(kafka, topic, exc, "read") from exc
            raise _unreachable(kafka, exc) from exc
        # assign and seek with no await in between, so the fetcher never starts from a default position
        consumer.assign(tps)
        for tp, offset in starts.items():
            consumer.seek(tp, offset)
        key = batch_id.encode() if batch_id is not None else None
        seen: OrderedDict[tuple[str, str], None] = OrderedDict()
        while True:
            try:
                batches = await consumer.getmany(timeout_ms=int(poll_timeout_s * 1000), max_records=500)
            except KafkaError as exc:
                if type(exc).__name__ in _NOT_AUTHORIZED:  # Describe (e.g. implied by Write) but not Read
                    raise _refused(kafka, topic, exc, "read") from exc
                raise _unreachable(kafka, exc) from exc
            for records in batches.values():
                for record in records:
                    if key is not None and record.key != key:
                        continue
                    try:
                        envelope = decode(record.key, record.value, list(record.headers or ()), expect=expect)
                    except SchemaError as exc:
                        log.warning(
                            "skipping invalid event at %s[%d]@%d: %s",
                            record.topic,
                            record.partition,
                            record.offset,
                            exc,
                        )
                        continue
                    if tenant is not None and envelope.tenant != tenant:
                        continue
                    ident = (envelope.source, envelope.id)
                    if ident in seen:
                        continue
                    seen[ident] = None
                    if len(seen) > _DEDUPE_WINDOW:
                        seen.popitem(last=False)
                    yield envelope
                    if stop_at_terminal and key is not None and envelope.is_terminal:
                        return
    finally:
        await _quietly(consumer.stop())


async def _partitions(consumer: Any, topic: str) -> set[int]:
    # consumer.topics() fetches fresh metadata but returns only names, and partitions_for_topic()
    # reads a cache that does not track unsubscribed topics: ask the client for the whole cluster.
    cluster = await consumer._client.fetch_all_metadata()
    return set(cluster.partitions_for_topic(topic) or ())


async def _start_offsets(
    consumer: Any, tps: list[Any], since: datetime | None, from_end: bool
) -> dict[Any, int]:
    """First offset to read per partition: at/after ``since``, or the end, or the beginning."""
    if from_end:
        return dict(await consumer.end_offsets(tps))
    if since is None:
        return dict(await consumer.beginning_offsets(tps))
    found = await consumer.offsets_for_times({tp: int(since.timestamp() * 1000) for tp in tps})
    starts = {tp: hit.offset for tp, hit in found.items() if hit is not None}
    missing = [tp for tp in tps if tp not in starts]
    if missing:  # nothing at or after `since` yet: wait at the end
        starts.update(await consumer.end_offsets(missing))
    return starts
