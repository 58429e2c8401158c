"""Dead-letter topic contract: header names, reasons, and their (Spring Kafka compatible) encodings.

A dead letter is the original record (key, value, headers unchanged) plus the headers below. One that
would not fit the dead-letter topic is *reduced*: no value, only the original headers that fit, and
``llmbatch-dlt-reduced`` with the value's size and SHA-256; the ``kafka_dlt-original-*`` headers point
at the original record.
The ``kafka_dlt-*`` names and binary encodings are Spring Kafka's ``DeadLetterPublishingRecoverer``
ones (partition: 4-byte big-endian int; offset and timestamp: 8-byte big-endian longs; the rest
UTF-8), so existing Kafka tools read them. ``llmbatch-*`` headers are UTF-8 text.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import struct
from collections.abc import Iterable
from typing import Annotated

import orjson
from pydantic import BaseModel, ConfigDict, Field

from llmbatch.schemas.common import UtcDatetime, format_time
from llmbatch.schemas.compat import StrEnum, parse_iso_time

ORIGINAL_TOPIC = "kafka_dlt-original-topic"
ORIGINAL_PARTITION = "kafka_dlt-original-partition"
ORIGINAL_OFFSET = "kafka_dlt-original-offset"
ORIGINAL_CONSUMER_GROUP = "kafka_dlt-original-consumer-group"
ORIGINAL_TIMESTAMP = "kafka_dlt-original-timestamp"
ORIGINAL_TIMESTAMP_TYPE = "kafka_dlt-original-timestamp-type"
EXCEPTION_FQCN = "kafka_dlt-exception-fqcn"
EXCEPTION_MESSAGE = "kafka_dlt-exception-message"
EXCEPTION_STACKTRACE = "kafka_dlt-exception-stacktrace"
REASON = "llmbatch-dlt-reason"
REDUCED = "llmbatch-dlt-reduced"
ORIGINAL_VALUE_BYTES = "llmbatch-dlt-original-value-bytes"
ORIGINAL_VALUE_SHA256 = "llmbatch-dlt-original-value-sha256"
ORIGINAL_HEADERS_DROPPED = "llmbatch-dlt-original-headers-dropped"
REPLAY_ID = "llmbatch-replay-id"
REPLAY_AT = "llmbatch-replay-at"
REPLAY_BY = "llmbatch-replay-by"
REPLAY_SIG = "llmbatch-replay-sig"

DLT_HEADERS = frozenset(
    {
        ORIGINAL_TOPIC,
        ORIGINAL_PARTITION,
        ORIGINAL_OFFSET,
        ORIGINAL_CONSUMER_GROUP,
        ORIGINAL_TIMESTAMP,
        ORIGINAL_TIMESTAMP_TYPE,
        EXCEPTION_FQCN,
        EXCEPTION_MESSAGE,
        EXCEPTION_STACKTRACE,
        REASON,
        REDUCED,
        ORIGINAL_VALUE_BYTES,
        ORIGINAL_VALUE_SHA256,
        ORIGINAL_HEADERS_DROPPED,
    }
)
"""Headers added when dead-lettering (stripped again on replay)."""
REPLAY_HEADERS = frozenset({REPLAY_ID, REPLAY_AT, REPLAY_BY, REPLAY_SIG})
"""Headers added when replaying a dead letter to its original topic."""

MAX_EXCEPTION_MESSAGE_BYTES = 4096
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class DltReason(StrEnum):
    """Machine-readable ``llmbatch-dlt-reason`` values."""

    INVALID_EVENT = "invalid_event"
    """Envelope or data violates the contract (see the exception message for reason/field)."""
    INPUT_NOT_FOUND = "input_not_found"
    """``input_uri`` names no readable object."""
    INPUT_INVALID = "input_invalid"
    """The input has no valid line (or is otherwise unusable as a whole)."""
    LIMIT_EXCEEDED = "limit_exceeded"
    """Inline requests over the limits, or a bucket that is not allowed."""
    TOKEN_LIMIT_EXCEEDED = "token_limit_exceeded"  # noqa: S105 (an error code, not a secret)
    """The tenant's enqueued tokens would pass its limit (``LLMBATCH_TENANTS__MAX_ENQUEUED_TOKENS``);
    replay it once earlier batches ended."""
    STORAGE_QUOTA_EXCEEDED = "storage_quota_exceeded"
    """What the tenant keeps is over its limit (``LLMBATCH_TENANTS__MAX_STORED_BYTES``); replay it once
    files were deleted or expired."""
    DEADLINE_PASSED = "deadline_passed"
    """The deadline was already past when the request was first seen."""
    MODEL_NOT_FOUND = "model_not_found"
    """The batch names a model the dispatcher does not serve (``LLMBATCH_ENGINES__MODELS``), at intake
    or, when the model was removed from the registry after acceptance, at launch."""
    ATTEMPTS_EXHAUSTED = "attempts_exhausted"
    """The Ray job failed or was lost on every allowed attempt."""
    SUBMIT_REJECTED = "submit_rejected"
    """Ray refused the job for a non-transient reason."""
    REQUEST_GONE = "request_gone"
    """The batch's request was too large to keep in Redis and the requests topic no longer has it at
    launch (its retention is shorter than the batch waited): send the batch again."""
    INTERNAL_ERROR = "internal_error"
    """A bug or an unexpected error while handling the event."""
    PROCESSING_FAILED = "processing_failed"
    """Processing the record failed on every allowed attempt (``LLMBATCH_DISPATCHER__RECORD_MAX_ATTEMPTS``)
    with an error retrying did not clear (e.g. Redis out of memory) or an unexpected one, so the
    consumer moved past it. Replay it once the cause (see the exception headers) is fixed."""


class DltRecord(BaseModel):
    """What a dead letter says about its origin, decoded from / encoded to ``kafka_dlt-*`` headers."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    reason: DltReason | str = Field(description="A DltReason value (unknown values are kept).")
    original_topic: str
    original_partition: int = Field(ge=0)
    original_offset: int = Field(ge=0)
    original_timestamp_ms: int | None = None
    original_timestamp_type: str | None = Field(default=None, examples=["CreateTime"])
    consumer_group: str | None = None
    exception_fqcn: str | None = Field(default=None, examples=["llmbatch.schemas.errors.SchemaError"])
    exception_message: Annotated[str, Field(max_length=MAX_EXCEPTION_MESSAGE_BYTES)] | None = None
    reduced: bool = Field(
        default=False,
        description="The dead letter would not fit the dead-letter topic, so it carries no value (and "
        "only the original headers that fit): read the original record at original_topic, "
        "original_partition, original_offset.",
    )
    original_value_bytes: int | None = Field(default=None, ge=0, description="Size of the left-out value.")
    original_value_sha256: str | None = Field(
        default=None, pattern=r"^[0-9a-f]{64}$", description="SHA-256 (hex) of the left-out value."
    )
    original_headers_dropped: int | None = Field(
        default=None, ge=0, description="How many of the original headers were left out."
    )

    def to_headers(self) -> list[tuple[str, bytes]]:
        """The headers to append to the original record's headers."""
        headers = [
            (ORIGINAL_TOPIC, self.original_topic.encode()),
            (ORIGINAL_PARTITION, struct.pack(">i", self.original_partition)),
            (ORIGINAL_OFFSET, struct.pack(">q", self.original_offset)),
        ]
        if self.original_timestamp_ms is not None:
            headers.append((ORIGINAL_TIMESTAMP, struct.pack(">q", self.original_timestamp_ms)))
        if self.original_timestamp_type is not None:
            headers.append((ORIGINAL_TIMESTAMP_TYPE, self.original_timestamp_type.encode()))
        if self.consumer_group is not None:
            headers.append((ORIGINAL_CONSUMER_GROUP, self.consumer_group.encode()))
        if self.exception_fqcn is not None:
            headers.append((EXCEPTION_FQCN, self.exception_fqcn.encode()))
        if self.exception_message is not None:
            headers.append((EXCEPTION_MESSAGE, self.exception_message.encode()))
        headers.append((REASON, str(self.reason).encode()))
        if self.reduced:
            headers.append((REDUCED, b"true"))
            if self.original_value_bytes is not None:
                headers.append((ORIGINAL_VALUE_BYTES, str(self.original_value_bytes).encode()))
            if self.original_value_sha256 is not None:
                headers.append((ORIGINAL_VALUE_SHA256, self.original_value_sha256.encode()))
            if self.original_headers_dropped:
                headers.append((ORIGINAL_HEADERS_DROPPED, str(self.original_headers_dropped).encode()))
        return headers

    @classmethod
    def from_headers(cls, headers: Iterable[tuple[str, bytes | None]]) -> DltRecord | None:
        """Decode the DLT headers of a record; ``None`` when it carries none (not a dead letter).

        Malformed values decode leniently (``None``/``-1``/replacement characters): a dead letter
        must stay inspectable even if another tool wrote it.
        """
        found: dict[str, bytes] = {}
        for name, value in headers:
            if name in DLT_HEADERS and value is not None:
                found[name] = value  # the last one wins, as in Spring Kafka
        if ORIGINAL_TOPIC not in found and REASON not in found:
            return None

        def text(name: str) -> str | None:
            raw = found.get(name)
            return raw.decode("utf-8", "replace") if raw is not None else None

        def number(name: str, size: int) -> int | None:
            raw = found.get(name)
            if raw is None:
                return None
            if len(raw) == size:
                return int(struct.unpack(">i" if size == 4 else ">q", raw)[0])
            try:  # some tools write decimal text
                return int(raw.decode("ascii"))
            except (UnicodeDecodeError, ValueError):
                return None

        def count(name: str) -> int | None:
            raw = text(name)
            return int(raw) if raw is not None and raw.isdigit() else None

        message = text(EXCEPTION_MESSAGE)
        if message is not None and len(message) > MAX_EXCEPTION_MESSAGE_BYTES:
            message = message[:MAX_EXCEPTION_MESSAGE_BYTES]
        reason = text(REASON) or DltReason.INTERNAL_ERROR
        digest = text(ORIGINAL_VALUE_SHA256)
        return cls(
            reason=DltReason(reason) if reason in DltReason._value2member_map_ else reason,
            original_topic=text(ORIGINAL_TOPIC) or "",
            original_partition=max(number(ORIGINAL_PARTITION, 4) or 0, 0),
            original_offset=max(number(ORIGINAL_OFFSET, 8) or 0, 0),
            original_timestamp_ms=number(ORIGINAL_TIMESTAMP, 8),
            original_timestamp_type=text(ORIGINAL_TIMESTAMP_TYPE),
            consumer_group=text(ORIGINAL_CONSUMER_GROUP),
            exception_fqcn=text(EXCEPTION_FQCN),
            exception_message=message,
            reduced=text(REDUCED) == "true",
            original_value_bytes=count(ORIGINAL_VALUE_BYTES),
            original_value_sha256=digest if digest is not None and _SHA256.fullmatch(digest) else None,
            original_headers_dropped=count(ORIGINAL_HEADERS_DROPPED),
        )


class ReplayInfo(BaseModel):
    """``llmbatch-replay-{id,at,by}``: added when an operator replays a dead letter, and
    ``llmbatch-replay-sig`` when the operator holds the replay key (:meth:`signed`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    replay_id: Annotated[str, Field(min_length=1, max_length=128)]
    replayed_at: UtcDatetime
    replayed_by: Annotated[str, Field(min_length=1, max_length=256)]
    signature: Annotated[str | None, Field(default=None, pattern=r"^[0-9a-f]{64}$")] = None

    def _digest(self, key: bytes, source: str, event_id: str) -> str:
        # the provenance and the event it travels with, length-safe (a JSON list)
        message = orjson.dumps(
            [
                "llmbatch-replay-v1",
                self.replay_id,
                format_time(self.replayed_at),
                self.replayed_by,
                source,
                event_id,
            ]
        )
        return hmac.new(key, message, hashlib.sha256).hexdigest()

    def signed(self, key: bytes, *, source: str, event_id: str) -> ReplayInfo:
        """This replay with its HMAC-SHA256 under ``key``, bound to the event's ``ce_source`` and
        ``ce_id`` (a signature copied onto another event does not verify)."""
        return self.model_copy(update={"signature": self._digest(key, source, event_id)})

    def verify(self, key: bytes, *, source: str, event_id: str) -> bool:
        """Whether the replay was signed with ``key`` for this event."""
        return self.signature is not None and hmac.compare_digest(
            self.signature, self._digest(key, source, event_id)
        )

    def to_headers(self) -> list[tuple[str, bytes]]:
        """The replay headers."""
        headers = [
            (REPLAY_ID, self.replay_id.encode()),
            (REPLAY_AT, format_time(self.replayed_at).encode()),
            (REPLAY_BY, self.replayed_by.encode()),
        ]
        return headers if self.signature is None else [*headers, (REPLAY_SIG, self.signature.encode())]

    @classmethod
    def from_headers(cls, headers: Iterable[tuple[str, bytes | None]]) -> ReplayInfo | None:
        """Decode replay headers; ``None`` when absent or unreadable (an unreadable signature is
        kept as no signature)."""
        found = {name: value for name, value in headers if name in REPLAY_HEADERS and value is not None}
        signature = found.get(REPLAY_SIG, b"").decode("ascii", "replace")
        try:
            return cls(
                replay_id=found[REPLAY_ID].decode(),
                replayed_at=parse_iso_time(found[REPLAY_AT].decode()),
                replayed_by=found[REPLAY_BY].decode(),
                signature=signature if _SHA256.fullmatch(signature) else None,
            )
        except (KeyError, ValueError):  # pydantic's ValidationError is a ValueError
            return None


def strip_dlt_headers(headers: Iterable[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    """The original headers of a dead letter: DLT and earlier replay headers removed (for replay)."""
    return [(n, v) for n, v in headers if n not in DLT_HEADERS and n not in REPLAY_HEADERS]


def truncate_message(message: str, limit: int = MAX_EXCEPTION_MESSAGE_BYTES) -> str:
    """Cut an exception message to what ``kafka_dlt-exception-message`` carries."""
    return message if len(message) <= limit else message[: limit - 3] + "..."
