"""Read the dead-letter topic: a consistent snapshot of its records as :class:`DeadLetterView`\\ s.

The reader joins no consumer group and commits nothing (operators' reads never move the dispatcher's
offsets). It takes the end offsets when it starts and reads every partition up to them, so records
dead-lettered meanwhile are left for the next run. ``since`` seeks with ``offsets_for_times``
instead of reading the whole topic.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson

from llmbatch.dispatcher.domain.keys import BatchKey, batch_key
from llmbatch.dispatcher.intake.intake_checks import claimed_tenant
from llmbatch.dispatcher.ops.common import CONNECT_TIMEOUT_S, OpsError
from llmbatch.schemas import dlt
from llmbatch.schemas.cloudevents import H_ID, H_SOURCE, H_TYPE, decode
from llmbatch.schemas.dlt import DltRecord, ReplayInfo
from llmbatch.schemas.errors import SchemaError
from llmbatch.schemas.events import REQUEST_EVENT_TYPES
from llmbatch.settings import KafkaSettings

STALL_TIMEOUT_S = 20.0
_INT_HEADERS = {dlt.ORIGINAL_PARTITION: 4, dlt.ORIGINAL_OFFSET: 8, dlt.ORIGINAL_TIMESTAMP: 8}


@dataclass(frozen=True)
class DeadLetterView:
    """One record of the dead-letter topic with its ``kafka_dlt-*`` headers decoded."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int | None
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]
    record: DltRecord | None = field(compare=False)

    @classmethod
    def from_consumer_record(cls, rec: Any) -> DeadLetterView:
        headers = tuple((str(k), bytes(v) if v is not None else b"") for k, v in (rec.headers or ()))
        ts = getattr(rec, "timestamp", None)
        return cls(
            rec.topic,
            int(rec.partition),
            int(rec.offset),
            int(ts) if ts is not None and ts >= 0 else None,
            rec.key,
            rec.value,
            headers,
            DltRecord.from_headers(headers),
        )

    # -- identity ---------------------------------------------------------------------------------
    @property
    def coordinate(self) -> str:
        """``<partition>:<offset>`` in the dead-letter topic (what ``dlq inspect`` and the ledger use)."""
        return f"{self.partition}:{self.offset}"

    @property
    def time(self) -> datetime | None:
        return _ms_time(self.timestamp_ms)

    @property
    def key_text(self) -> str | None:
        return self.key.decode("utf-8", "replace") if self.key is not None else None

    @property
    def batch_key(self) -> BatchKey | None:
        """The batch the dead letter's request names (record key: the batch id; its tenant: the one
        the value claims, else the default), or ``None`` without a key."""
        text = self.key_text
        return batch_key(claimed_tenant(self.value), text) if text is not None else None

    def header(self, name: str) -> bytes | None:
        """The last header named ``name`` (Spring Kafka semantics), or ``None``."""
        for key, value in reversed(self.headers):
            if key == name:
                return value
        return None

    def header_text(self, name: str) -> str | None:
        value = self.header(name)
        return value.decode("utf-8", "replace") if value is not None else None

    # -- what it says ---------------------------------------------------------------------------------
    @property
    def reason(self) -> str:
        return str(self.record.reason) if self.record is not None else "unknown"

    @property
    def event_type(self) -> str | None:
        return self.header_text(H_TYPE)

    @property
    def event_id(self) -> str | None:
        return self.header_text(H_ID)

    @property
    def event_source(self) -> str | None:
        return self.header_text(H_SOURCE)

    @property
    def original_headers(self) -> list[tuple[str, bytes]]:
        """The record's headers without DLT and earlier replay headers (what a replay re-publishes)."""
        return dlt.strip_dlt_headers(self.headers)

    @property
    def previous_replay(self) -> ReplayInfo | None:
        """Set when this dead letter is a replayed event that failed again."""
        return ReplayInfo.from_headers(self.headers)

    def validation_now(self) -> str | None:
        """``None`` if the original event passes the contract today, else the error (reason: message).

        Only the envelope and data are checked (not inline limits, deadlines or buckets, which the
        dispatcher checks with its own settings)."""
        try:
            decode(self.key, self.value, self.original_headers, expect=REQUEST_EVENT_TYPES)
        except SchemaError as exc:
            return str(exc)
        return None

    # -- output ---------------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        rec = self.record
        return {
            "coordinate": self.coordinate,
            "partition": self.partition,
            "offset": self.offset,
            "time": self.time,
            "key": self.key_text,
            "reason": self.reason,
            "event_type": self.event_type,
            "event_id": self.event_id,
            "original_topic": rec.original_topic if rec else None,
            "original_partition": rec.original_partition if rec else None,
            "original_offset": rec.original_offset if rec else None,
            "consumer_group": rec.consumer_group if rec else None,
            "exception_fqcn": rec.exception_fqcn if rec else None,
            "exception_message": rec.exception_message if rec else None,
        }

    def full(self) -> dict[str, Any]:
        """Everything, for ``dlq inspect``: decoded headers and the payload."""
        previous = self.previous_replay
        return {
            **self.summary(),
            "topic": self.topic,
            "original_timestamp": _ms_time(self.record.original_timestamp_ms) if self.record else None,
            "headers": [describe_header(name, value) for name, value in self.headers],
            "payload": decode_payload(self.value),
            "payload_bytes": len(self.value) if self.value is not None else None,
            "valid_now": self.validation_now() is None,
            "validation_error_now": self.validation_now(),
            "previous_replay": previous.model_dump(mode="json") if previous else None,
        }


def _ms_time(ms: int | None) -> datetime | None:
    return datetime.fromtimestamp(ms / 1000, UTC) if ms is not None else None


def describe_header(name: str, value: bytes) -> dict[str, Any]:
    """A header as ``{name, value, encoding}``: Spring's binary numbers decoded, text as text,
    anything else base64."""
    size = _INT_HEADERS.get(name)
    if size is not None and len(value) == size:
        number = struct.unpack(">i" if size == 4 else ">q", value)[0]
        return {"name": name, "value": int(number), "encoding": f"int{size * 8}-be"}
    try:
        return {"name": name, "value": value.decode("utf-8"), "encoding": "utf-8"}
    except UnicodeDecodeError:
        return {"name": name, "value": base64.b64encode(value).decode(), "encoding": "base64"}


def decode_payload(value: bytes | None) -> Any:
    """The value as JSON when it is JSON, else as text (or base64 for binary)."""
    if value is None:
        return None
    try:
        return orjson.loads(value)
    except orjson.JSONDecodeError:
        pass
    try:
        return {"not_json": value.decode("utf-8")}
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(value).decode()}


# --- reading -----------------------------------------------------------------------------------------


@dataclass
class Snapshot:
    """What one read of the dead-letter topic found."""

    topic: str
    exists: bool
    partitions: int = 0
    letters: list[DeadLetterView] = field(default_factory=list)


def _unreachable(kafka: KafkaSettings, exc: BaseException) -> OpsError:
    return OpsError(
        f"Kafka at {kafka.bootstrap_servers} did not answer ({type(exc).__name__}); "
        "check LLMBATCH_KAFKA__BOOTSTRAP_SERVERS"
    )


async def read_dead_letters(
    kafka: KafkaSettings,
    topic: str,
    *,
    since: datetime | None = None,
    at: Sequence[tuple[int | None, int]] = (),
    timeout_s: float = CONNECT_TIMEOUT_S,
) -> Snapshot:
    """Read ``topic`` up to its current end.

    ``since`` starts each partition at the first record at/after that time. ``at`` instead reads only
    the given ``(partition, offset)`` records (``partition=None``: that offset in every partition).
    """
    from aiokafka import AIOKafkaConsumer, TopicPartition
    from aiokafka.errors import KafkaError

    consumer = AIOKafkaConsumer(
        group_id=None, enable_auto_commit=False, auto_offset_reset="earliest", **kafka.client_kwargs()
    )
    try:
        try:
            await asyncio.wait_for(consumer.start(), timeout_s)
            cluster = await asyncio.wait_for(consumer._client.fetch_all_metadata(), timeout_s)
        except (TimeoutError, KafkaError, OSError) as exc:
            raise _unreachable(kafka, exc) from None
        numbers = sorted(cluster.partitions_for_topic(topic) or ())
        if not numbers:
            return Snapshot(topic, exists=False)
        tps = [TopicPartition(topic, p) for p in numbers]
        try:
            begin = await asyncio.wait_for(consumer.beginning_offsets(tps), timeout_s)
            end = await asyncio.wait_for(consumer.end_offsets(tps), timeout_s)
            bounds = await _bounds(consumer, tps, begin, end, since, at, timeout_s)
        except (TimeoutError, KafkaError, OSError) as exc:
            raise _unreachable(kafka, exc) from None
        records = await _scan(consumer, bounds, kafka)
        letters = [DeadLetterView.from_consumer_record(r) for r in records]
        letters.sort(key=lambda v: (v.timestamp_ms or 0, v.partition, v.offset))
        return Snapshot(topic, exists=True, partitions=len(numbers), letters=letters)
    finally:
        with contextlib.suppress(Exception):  # closing; the read's own outcome is what matters
            await consumer.stop()


async def _bounds(
    consumer: Any,
    tps: list[Any],
    begin: dict[Any, int],
    end: dict[Any, int],
    since: datetime | None,
    at: Sequence[tuple[int | None, int]],
    timeout_s: float,
) -> dict[Any, tuple[int, int]]:
    """``{tp: (first offset to read, stop before)}`` for partitions with something to read."""
    out: dict[Any, tuple[int, int]] = {}
    if at:
        for tp in tps:
            wanted = [o for p, o in at if p is None or p == tp.partition]
            wanted = [o for o in wanted if begin[tp] <= o < end[tp]]
            if wanted:
                out[tp] = (min(wanted), max(wanted) + 1)
        return out
    starts = dict(begin)
    if since is not None:
        found = await asyncio.wait_for(
            consumer.offsets_for_times({tp: int(since.timestamp() * 1000) for tp in tps}), timeout_s
        )
        for tp in tps:
            hit = found.get(tp)
            starts[tp] = hit.offset if hit is not None else end[tp]
    for tp in tps:
        if starts[tp] < end[tp]:
            out[tp] = (starts[tp], end[tp])
    return out


async def _scan(consumer: Any, bounds: dict[Any, tuple[int, int]], kafka: KafkaSettings) -> list[Any]:
    """Read each partition from its start to its stop offset."""
    from aiokafka.errors import KafkaError

    if not bounds:
        return []
    consumer.assign(list(bounds))
    for tp, (start, _) in bounds.items():
        consumer.seek(tp, start)
    remaining = set(bounds)
    found: list[Any] = []
    loop = asyncio.get_running_loop()
    last_progress = loop.time()
    while remaining:
        try:
            batch = await consumer.getmany(*remaining, timeout_ms=500, max_records=2000)
        except KafkaError as exc:
            raise _unreachable(kafka, exc) from None
        for tp, records in batch.items():
            stop = bounds[tp][1]
            found.extend(r for r in records if r.offset < stop)
            last_progress = loop.time()
        for tp in list(remaining):
            if await consumer.position(tp) >= bounds[tp][1]:
                remaining.discard(tp)
        if remaining and loop.time() - last_progress > STALL_TIMEOUT_S:
            raise OpsError(
                f"reading {next(iter(remaining)).topic} stalled for {STALL_TIMEOUT_S:.0f}s "
                f"(partitions {sorted(tp.partition for tp in remaining)}); try again"
            )
    return found


def parse_locator(value: str) -> tuple[int | None, int] | None:
    """``P:O`` or ``O`` -> ``(partition or None, offset)``; anything else -> ``None`` (a key)."""
    text = value.strip()
    if ":" in text:
        left, _, right = text.partition(":")
        if left.isdigit() and right.isdigit():
            return int(left), int(right)
        return None
    if text.isdigit():
        return None, int(text)
    return None


def by_keys(letters: Iterable[DeadLetterView], keys: set[str]) -> list[DeadLetterView]:
    return [v for v in letters if v.key_text in keys]


async def existing_topics(kafka: KafkaSettings, timeout_s: float = CONNECT_TIMEOUT_S) -> set[str]:
    """Names of the topics the cluster has (the brokers may not auto-create topics)."""
    from aiokafka import AIOKafkaConsumer
    from aiokafka.errors import KafkaError

    consumer = AIOKafkaConsumer(group_id=None, enable_auto_commit=False, **kafka.client_kwargs())
    try:
        await asyncio.wait_for(consumer.start(), timeout_s)
        cluster = await asyncio.wait_for(consumer._client.fetch_all_metadata(), timeout_s)
        return set(cluster.topics())
    except (TimeoutError, KafkaError, OSError) as exc:
        raise _unreachable(kafka, exc) from None
    finally:
        with contextlib.suppress(Exception):
            await consumer.stop()
