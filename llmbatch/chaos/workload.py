"""The chaos suite's workload: unique batch ids, duplicates, cancels, deadlines that cannot be met and
malformed records of many kinds, each with what the verdict must see (:class:`~llmbatch.chaos.verdict.Sent`).
Pure and seeded: the same seed gives the same records."""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import orjson

from llmbatch.chaos.verdict import Kind, Sent
from llmbatch.schemas.batch import BatchRequest, CancelRequest
from llmbatch.schemas.cloudevents import H_ID, H_SOURCE, H_TYPE, Envelope, encode

Header = tuple[str, bytes]
CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class Record:
    """One record for the requests topic, and what the verdict expects of it. ``upload`` is an input
    file (object key under the tenant's input prefix, content) to put before sending a file batch."""

    key: bytes | None
    value: bytes | None
    headers: tuple[Header, ...]
    sent: Sent
    upload: tuple[str, bytes] | None = None


def _line(custom_id: str, n: int, bad: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": f"Say {n} in one word."}],
        "max_tokens": 4,
    }
    if bad:  # its custom_id is readable: it is answered by an error line of its own
        body["messages"] = "not a list"
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}


def _record(
    data: BatchRequest | CancelRequest,
    sent: Sent,
    source: str,
    now: datetime,
    upload: tuple[str, bytes] | None = None,
) -> Record:
    key, value, headers = encode(Envelope.new(data, source=source, id=sent.event_id, time=now))
    return Record(key, value, tuple(headers), sent, upload)


def workload(
    *,
    batches: int,
    malformed: int,
    model: str,
    now: datetime,
    run: str,
    seed: int = 0,
    input_bucket: str = "llmbatch-input",
    source: str = "urn:llmbatch:chaos",
) -> list[Record]:
    """``batches`` valid batches (inline and file, 1-50 lines, some file lines invalid), a duplicate
    (new event id) of a third of them, a cancel of a tenth, a deadline that cannot be met on a tenth,
    and ``malformed`` malformed records cycling through :data:`MALFORMED_KINDS`. Record order is
    shuffled the way independent producers would interleave, a cancel always after its batch."""
    rng = random.Random(seed)
    out: list[Record] = []
    followers: list[Record] = []
    for n in range(batches):
        batch_id = f"{run}-b{n:04d}"
        event_id = f"{run}-e{n:04d}"
        lines = [_line(f"c{n}-{i}", i) for i in range(rng.randint(1, 50))]
        expect = frozenset({"completed"})
        extra: dict[str, Any] = {"metadata": {"chaos": run}}
        deadline = None
        if n % 10 == 3:  # a deadline it cannot meet: it may still finish first, or arrive past it
            deadline = now + timedelta(seconds=2)
            extra["deadline"] = deadline.isoformat()
            expect = frozenset({"expired", "completed", "rejected"})
        upload = None
        if n % 2:
            if n % 4 == 1:
                bad = rng.randrange(len(lines))
                lines[bad] = _line(lines[bad]["custom_id"], bad, bad=True)
            key = f"default/inputs/{batch_id}.jsonl"
            upload = (key, b"".join(orjson.dumps(line) + b"\n" for line in lines))
            extra["input_uri"] = f"s3://{input_bucket}/{key}"
        else:
            extra["requests"] = lines
        request = BatchRequest.model_validate(
            {"batch_id": batch_id, "model": model, "endpoint": CHAT, **extra}
        )
        if n % 10 == 7:
            expect = frozenset({"cancelled", "completed"})
            cancel = CancelRequest(batch_id=batch_id, reason="chaos")
            followers.append(_record(cancel, Sent(Kind.CANCEL, batch_id, f"{run}-x{n:04d}"), source, now))
        custom_ids = tuple(line["custom_id"] for line in lines)
        sent = Sent(
            Kind.BATCH,
            batch_id,
            event_id,
            expect,
            custom_ids,
            deadline=deadline.timestamp() if deadline is not None else None,
        )
        out.append(_record(request, sent, source, now, upload))
        if n % 3 == 0:  # the same request again under a new event id: answered, never run twice
            duplicate = Sent(Kind.DUPLICATE, batch_id, f"{run}-d{n:04d}")
            followers.append(_record(request, duplicate, source, now))
    for m in range(malformed):
        kind = MALFORMED_KINDS[m % len(MALFORMED_KINDS)]
        out.append(malformed_record(kind, f"{run}-m{m:04d}", model, now, source))
    rng.shuffle(out)
    rng.shuffle(followers)
    return out + followers


MALFORMED_KINDS = (
    "not_json",
    "empty_value",
    "no_key",
    "no_source",
    "wrong_type",
    "key_mismatch",
    "bad_field_type",
    "unknown_model",
    "deadline_passed",
    "huge_field",
    "disallowed_bucket",
    "unknown_field",
)


def malformed_record(kind: str, mark: str, model: str, now: datetime, source: str) -> Record:
    """One malformed record of ``kind``; its ``ce_id`` (``mark``) identifies it on the dead-letter topic."""
    data: dict[str, Any] = {"batch_id": mark, "model": model, "endpoint": CHAT, "requests": [_line("c", 0)]}
    headers: list[Header] = [
        ("ce_specversion", b"1.0"),
        (H_ID, mark.encode()),
        (H_SOURCE, source.encode()),
        (H_TYPE, b"llmbatch.batch.requested.v1"),
        ("ce_time", now.isoformat().encode()),
        ("ce_subject", mark.encode()),
        ("content-type", b"application/json"),
    ]
    key: bytes | None = mark.encode()
    if kind == "unknown_model":
        data["model"] = "no-such-model"
    elif kind == "deadline_passed":
        data["deadline"] = (now - timedelta(hours=1)).isoformat()
    elif kind == "huge_field":
        data["metadata"] = {"blob": "x" * 200_000}
    elif kind == "disallowed_bucket":
        data.pop("requests")
        data["input_uri"] = f"s3://someone-elses-bucket/{mark}.jsonl"
    elif kind == "unknown_field":
        data["priorty"] = 3
    elif kind == "bad_field_type":
        data["priority"] = "high"
    value: bytes | None = orjson.dumps(data)
    if kind == "not_json":
        value = b"{this is not json"
    elif kind == "empty_value":
        value = None
    elif kind == "no_key":
        key = None
    elif kind == "no_source":
        headers = [h for h in headers if h[0] != H_SOURCE]
    elif kind == "wrong_type":
        headers = [(n, b"llmbatch.batch.nonsense.v1" if n == H_TYPE else v) for n, v in headers]
    elif kind == "key_mismatch":
        key = b"some-other-batch"
    return Record(key, value, tuple(headers), Sent(Kind.MALFORMED, None, mark, mark=mark))
