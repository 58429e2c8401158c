"""Where a batch's request body is: in Redis when small, else read back from the requests topic.

Redis keeps what the state machine needs. A request record larger than
``llmbatch.dispatcher.request_in_redis_max_bytes`` (an inline batch of many prompts) is not copied into the
batch hash: the hash keeps its coordinates (``origin``), size and SHA-256 (``request_bytes``,
``request_sha256``), and the tracker reads the record back from the requests topic when it builds a
job spec (every launch and resubmit), and the publisher when it writes a late dead letter. A record
the topic no longer has (retention shorter than the batch waited) or that changed
(:class:`~llmbatch.dispatcher.errors.RequestUnavailable`) fails the batch with ``request_gone``.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from llmbatch.dispatcher.domain.batch_record import BatchRecord
from llmbatch.dispatcher.domain.dlt import OriginalRecord
from llmbatch.dispatcher.errors import RequestUnavailable
from llmbatch.schemas.events import RecordRef

if TYPE_CHECKING:  # the reader is Kafka's; parsing a body (intake) needs none of it
    from llmbatch.dispatcher.kafka.record_reader import RecordReader


def body_fields(value: bytes, max_bytes: int) -> dict[str, str]:
    """The batch-hash fields that hold the request body ``value``: the body itself when it fits
    ``max_bytes``, else its size and digest (the record is read back by its coordinates). Pure."""
    if len(value) <= max_bytes:
        return {"request": value.decode("utf-8")}
    return {"request_bytes": str(len(value)), "request_sha256": hashlib.sha256(value).hexdigest()}


class RequestBodies:
    """The request body of a batch record, from Redis or from the requests topic."""

    def __init__(self, reader: RecordReader) -> None:
        self.reader = reader

    async def text(self, record: BatchRecord) -> str:
        """The body as the producer sent it. Raises :class:`RequestUnavailable` when it is gone and
        :class:`~llmbatch.dispatcher.errors.KafkaUnavailable` when Kafka does not answer (retry later)."""
        body = record.get("request")
        if body is not None:
            return body
        digest = record.get("request_sha256")
        origin_json = record.get("origin")
        if record.flag("request_gone"):
            gone = OriginalRecord.from_json(origin_json) if origin_json else None
            place = f"{gone.topic}[{gone.partition}]@{gone.offset}" if gone else "its record"
            raise RequestUnavailable(
                f"the batch's state was lost and its request ({place}) had left the topic when the reconcile "
                "pass found it: send the batch again"
            )
        if not digest or not origin_json:
            raise RequestUnavailable("the batch record keeps neither the request nor where it is")
        origin = OriginalRecord.from_json(origin_json)
        where = f"{origin.topic}[{origin.partition}]@{origin.offset}"
        found = await self.reader.read(
            RecordRef(topic=origin.topic, partition=origin.partition, offset=origin.offset)
        )
        if found is None or found.value is None:
            raise RequestUnavailable(
                f"the request record {where} is no longer on the topic (its retention is shorter than the "
                "batch waited): send the batch again, or raise the requests topic's retention.ms"
            )
        if hashlib.sha256(found.value).hexdigest() != digest:
            raise RequestUnavailable(f"the record at {where} is not this batch's request (digest differs)")
        return found.value.decode("utf-8")

    async def value(self, record: BatchRecord) -> str | None:
        """The body for a dead letter, or ``None`` when it is gone (the letter is then reduced: its
        headers still point at the original record). Transient Kafka errors raise."""
        try:
            return await self.text(record)
        except RequestUnavailable:
            return None
