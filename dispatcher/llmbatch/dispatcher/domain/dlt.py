"""Dead-letter records (pure): the original record plus Spring Kafka ``kafka_dlt-*`` headers.

:class:`OriginalRecord` is what the consumer read; it is also stored (as JSON) with each accepted
batch so a dead letter written much later (``attempts_exhausted``) still carries the original key,
value, headers and coordinates.

A dead letter that would not fit the dead-letter topic (:func:`fit_dead_letter`) is written reduced
(:func:`reduce_dead_letter`): without the value, with its size and SHA-256 instead; the
``kafka_dlt-original-*`` headers point at the original record.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from llmbatch.schemas.dlt import DltReason, DltRecord, truncate_message
from llmbatch.schemas.errors import Reason, SchemaError

_TIMESTAMP_TYPES = {0: "CreateTime", 1: "LogAppendTime"}


@dataclass(frozen=True)
class OriginalRecord:
    """A consumed Kafka record, as much of it as a dead letter needs."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...] = ()
    timestamp_ms: int | None = None
    timestamp_type: int | None = None

    @classmethod
    def from_consumer_record(cls, record: Any) -> OriginalRecord:
        headers = tuple((str(k), bytes(v) if v is not None else b"") for k, v in (record.headers or ()))
        ts = getattr(record, "timestamp", None)
        return cls(
            record.topic,
            int(record.partition),
            int(record.offset),
            record.key,
            record.value,
            headers,
            int(ts) if ts is not None and ts >= 0 else None,
            getattr(record, "timestamp_type", None),
        )

    def to_json(self) -> str:
        """Compact JSON (bytes as base64) for the batch hash."""
        return orjson.dumps(
            {
                "t": self.topic,
                "p": self.partition,
                "o": self.offset,
                "k": _b64(self.key),
                "v": _b64(self.value),
                "h": [[n, _b64(v)] for n, v in self.headers],
                "ts": self.timestamp_ms,
                "tt": self.timestamp_type,
            }
        ).decode()

    @classmethod
    def from_json(cls, text: str) -> OriginalRecord:
        d = orjson.loads(text)
        return cls(
            d["t"],
            int(d["p"]),
            int(d["o"]),
            _unb64(d.get("k")),
            _unb64(d.get("v")),
            tuple((str(n), _unb64(v) or b"") for n, v in d.get("h", [])),
            d.get("ts"),
            d.get("tt"),
        )


def _b64(value: bytes | None) -> str | None:
    return base64.b64encode(value).decode() if value is not None else None


def _unb64(value: str | None) -> bytes | None:
    return base64.b64decode(value) if value is not None else None


@dataclass(frozen=True)
class DeadLetter:
    """A record ready for the producer: ``send(topic, value, key=key, headers=headers)``, with what
    it was built from (``record``: its DLT headers, ``original``: the dead-lettered record)."""

    topic: str
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    reason: str
    record: DltRecord
    original: OriginalRecord

    @property
    def size(self) -> int:
        """Upper bound of the bytes it takes on the topic (see :func:`record_size`)."""
        return record_size(self.key, self.value, self.headers)

    @property
    def reduced(self) -> bool:
        return self.record.reduced


RECORD_OVERHEAD_BYTES = 61 + 21
"""A record batch's header plus the largest framing of one record (aiokafka's upper bound)."""
_VARINT_BYTES = 5
REDUCED_KEY_BYTES = 1024
"""A reduced dead letter keeps the original key up to this size."""
REDUCED_HEADER_BYTES = 1024
"""... and the original headers whose value is at most this size (ce_*, traceparent, ...),"""
REDUCED_HEADERS_BYTES = 16 << 10
"""... up to this many bytes of them in all."""


def record_size(key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]]) -> int:
    """Upper bound of the bytes one record takes in its own record batch: what a topic's
    ``max.message.bytes`` is compared with (the producer sends a record this large alone)."""
    size = RECORD_OVERHEAD_BYTES + 3 * _VARINT_BYTES + len(key or b"") + len(value or b"")
    for name, data in headers:
        size += 2 * _VARINT_BYTES + len(name.encode()) + len(data)
    return size


def bounded_headers(headers: Sequence[tuple[str, bytes]]) -> tuple[list[tuple[str, bytes]], int]:
    """The headers of at most :data:`REDUCED_HEADER_BYTES` each, :data:`REDUCED_HEADERS_BYTES` in all,
    in order; and how many were left out."""
    kept: list[tuple[str, bytes]] = []
    budget, dropped = REDUCED_HEADERS_BYTES, 0
    for name, data in headers:
        cost = len(name.encode()) + len(data)
        if len(data) <= REDUCED_HEADER_BYTES and cost <= budget:
            kept.append((name, data))
            budget -= cost
        else:
            dropped += 1
    return kept, dropped


def reduce_dead_letter(
    letter: DeadLetter, *, value_bytes: int | None = None, value_sha256: str | None = None
) -> DeadLetter:
    """``letter`` small enough for any dead-letter topic llmbatch accepts (at least 64 KiB): no value
    (``llmbatch-dlt-original-value-{bytes,sha256}`` describe it), the key only up to 1 KiB, and only the
    original headers of at most 1 KiB each (16 KiB in all); ``llmbatch-dlt-reduced: true``. The
    ``kafka_dlt-original-{topic,partition,offset}`` headers say where to read the original.
    ``value_bytes``/``value_sha256`` describe a value the letter no longer has in hand."""
    original = letter.original
    kept, dropped = bounded_headers(original.headers)
    value = original.value
    record = letter.record.model_copy(
        update={
            "reduced": True,
            "original_value_bytes": len(value) if value is not None else value_bytes,
            "original_value_sha256": hashlib.sha256(value).hexdigest() if value is not None else value_sha256,
            "original_headers_dropped": dropped,
        }
    )
    key = original.key if original.key is None or len(original.key) <= REDUCED_KEY_BYTES else None
    return DeadLetter(letter.topic, key, None, [*kept, *record.to_headers()], letter.reason, record, original)


def fit_dead_letter(letter: DeadLetter, max_bytes: int) -> DeadLetter:
    """``letter`` as is when it fits a topic whose ``max.message.bytes`` is ``max_bytes``, else reduced."""
    return letter if letter.size <= max_bytes else reduce_dead_letter(letter)


def reason_for_schema_error(error: SchemaError) -> DltReason:
    """Which ``llmbatch-dlt-reason`` an intake validation failure gets."""
    if error.reason == Reason.LIMIT_EXCEEDED:
        return DltReason.LIMIT_EXCEEDED
    if error.reason == Reason.DEADLINE_PASSED:
        return DltReason.DEADLINE_PASSED
    if error.reason == Reason.MODEL_NOT_FOUND:
        return DltReason.MODEL_NOT_FOUND
    if error.reason == Reason.TOKEN_LIMIT_EXCEEDED:
        return DltReason.TOKEN_LIMIT_EXCEEDED
    if error.reason == Reason.STORAGE_QUOTA_EXCEEDED:
        return DltReason.STORAGE_QUOTA_EXCEEDED
    return DltReason.INVALID_EVENT


def exception_fqcn(exc: BaseException | type[BaseException]) -> str:
    cls = exc if isinstance(exc, type) else type(exc)
    return f"{cls.__module__}.{cls.__qualname__}"


def describe_schema_error(error: SchemaError) -> str:
    """``<reason>: <field>: <message>``: the exception message of an invalid event's dead letter."""
    where = f"{error.field}: " if error.field else ""
    return f"{error.reason}: {where}{error.message}"


def build_dead_letter(
    original: OriginalRecord,
    *,
    dlt_topic: str,
    reason: DltReason | str,
    group_id: str,
    fqcn: str,
    message: str,
) -> DeadLetter:
    """The original key/value/headers plus the ``kafka_dlt-*`` and ``llmbatch-dlt-reason`` headers.

    Earlier DLT headers on the original (a replayed record that failed again) are kept before the
    new ones; readers take the last occurrence, as Spring Kafka does.
    """
    record = DltRecord(
        reason=reason,
        original_topic=original.topic,
        original_partition=original.partition,
        original_offset=original.offset,
        original_timestamp_ms=original.timestamp_ms,
        original_timestamp_type=_TIMESTAMP_TYPES.get(original.timestamp_type)
        if original.timestamp_type is not None
        else None,
        consumer_group=group_id,
        exception_fqcn=fqcn,
        exception_message=truncate_message(message),
    )
    headers = [*original.headers, *record.to_headers()]
    return DeadLetter(dlt_topic, original.key, original.value, headers, str(reason), record, original)


def without_value(origin: OriginalRecord) -> OriginalRecord:
    """The record's coordinates and headers without its value: what the batch hash keeps, bounded
    whatever the record's size (the headers a reduced dead letter keeps, :func:`bounded_headers`; the
    whole record stays at its coordinates on the requests topic)."""
    kept, _ = bounded_headers(origin.headers)
    return dataclasses.replace(origin, value=None, headers=tuple(kept))


def original_with_value(record_origin: str, value: str | None) -> OriginalRecord:
    """The stored origin of a batch with its value restored (for a late dead letter)."""
    origin = OriginalRecord.from_json(record_origin)
    return OriginalRecord(
        origin.topic,
        origin.partition,
        origin.offset,
        origin.key,
        value.encode("utf-8") if value is not None else origin.value,
        origin.headers,
        origin.timestamp_ms,
        origin.timestamp_type,
    )
