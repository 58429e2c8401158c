"""Dead-letter records (pure): the original record plus Spring Kafka ``kafka_dlt-*`` headers.

:class:`OriginalRecord` is what the consumer read; it is also stored (as JSON) with each accepted
batch so a dead letter written much later (``attempts_exhausted``) still carries the original key,
value, headers and coordinates.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import orjson

from schemas.dlt import DltReason, DltRecord, truncate_message
from schemas.errors import Reason, SchemaError

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
    """A record ready for the producer: ``send(topic, value, key=key, headers=headers)``."""

    topic: str
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    reason: str


def reason_for_schema_error(error: SchemaError) -> DltReason:
    """Which ``llmbatch-dlt-reason`` an intake validation failure gets."""
    if error.reason == Reason.LIMIT_EXCEEDED:
        return DltReason.LIMIT_EXCEEDED
    if error.reason == Reason.DEADLINE_PASSED:
        return DltReason.DEADLINE_PASSED
    if error.reason == Reason.MODEL_NOT_FOUND:
        return DltReason.MODEL_NOT_FOUND
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
    return DeadLetter(dlt_topic, original.key, original.value, headers, str(reason))
