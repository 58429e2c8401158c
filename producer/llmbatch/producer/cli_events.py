"""How ``llmbatch watch`` prints an event: one JSON object per line (``--json``) or one line of text."""

from __future__ import annotations

from typing import Any

import orjson

from llmbatch.schemas import BatchProgress, BatchRejected, Envelope, TerminalEventData, format_time


def event_json(envelope: Envelope[Any]) -> bytes:
    return orjson.dumps(
        {
            "id": envelope.id,
            "source": envelope.source,
            "type": envelope.type.value,
            "time": format_time(envelope.time),
            "subject": envelope.subject,
            "data": envelope.data.model_dump(mode="json"),
        }
    )


def describe(envelope: Envelope[Any]) -> str:
    """Time, batch, event kind, counts, and the error, dead letter or outputs where there are."""
    data = envelope.data
    status = getattr(data, "status", None)
    kind = envelope.type.value.removeprefix("llmbatch.batch.")
    text = f"{format_time(envelope.time)} {envelope.subject} {kind}"
    counts = getattr(data, "request_counts", None)
    if counts is not None:
        text += f" {counts.completed}+{counts.failed}/{counts.total}"
    if isinstance(data, BatchRejected):
        text += f" error={data.error.code}: {data.error.message}"
        if data.dead_letter is not None:
            where = data.dead_letter
            text += f" dead_letter={where.topic}/{where.partition}@{where.offset}"
    elif isinstance(data, TerminalEventData):
        if data.error is not None:
            text += f" error={data.error.code}: {data.error.message}"
        if data.output_uris:
            text += f" outputs={len(data.output_uris)}"
    elif status is not None and not isinstance(data, BatchProgress):
        text += f" {status}"
    return text
