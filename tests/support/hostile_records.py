"""Hypothesis strategies for hostile records of the requests topic: arbitrary bytes for the key, the
header values and the value, and, to reach past the first check, valid requests with one part
broken (a trailing newline on an id, a field replaced by any JSON, a header dropped or garbled)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import orjson
from hypothesis import strategies as st

from llmbatch.schemas.batch import CancelRequest
from llmbatch.schemas.cloudevents import H_ID, H_SOURCE, H_SUBJECT, H_TIME, H_TRACEPARENT, H_TYPE
from tests.support.dispatcher_kit import batch_request, request_message

Header = tuple[str, bytes]
Record = tuple[bytes | None, bytes | None, list[Header]]

# what a check with `re.match` and `$` lets through, and other bytes a careless check passes
TRAPS = ["\n", "\r\n", "\r", " ", "\t", "\x00", "\x7f", "\u2028", "é", "/", "..", "%0a"]
HEADER_NAMES = [
    H_ID,
    H_SOURCE,
    H_SUBJECT,
    H_TIME,
    H_TYPE,
    H_TRACEPARENT,
    "ce_specversion",
    "content-type",
    "llmbatch-tenant-sig",
    "llmbatch-replay-id",
    "llmbatch-replay-at",
    "llmbatch-replay-by",
    "llmbatch-replay-sig",
    "kafka_dlt-original-offset",
    "llmbatch-dlt-reason",
]

json_values: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)


def _trapped(text: str) -> st.SearchStrategy[str]:
    """``text`` with a trap character before, after or instead of it, or any text."""
    trap = st.sampled_from(TRAPS)
    return st.one_of(trap.map(lambda t: text + t), trap.map(lambda t: t + text), trap, st.text(max_size=300))


@st.composite
def _valid(draw: st.DrawFn) -> tuple[dict[str, Any], list[Header]]:
    batch_id = f"fz-{uuid.uuid4().hex[:10]}"
    if draw(st.booleans()):
        request: Any = batch_request(batch_id, tenant=draw(st.sampled_from(["default", "acme"])))
    else:
        request = CancelRequest(batch_id=batch_id)
    _, value, headers = request_message(request, traceparent="00-" + "a" * 32 + "-" + "b" * 16 + "-01")
    return orjson.loads(value), headers


@st.composite
def hostile_record(draw: st.DrawFn) -> Record:
    """One record: arbitrary bytes, or a valid request with some of its parts broken."""
    if draw(st.integers(0, 5)) == 0:  # anything at all
        headers = draw(
            st.lists(
                st.tuples(st.sampled_from(HEADER_NAMES) | st.text(max_size=20), st.binary(max_size=200)),
                max_size=8,
            )
        )
        return draw(st.none() | st.binary(max_size=200)), draw(st.none() | st.binary(max_size=2000)), headers
    data, headers = draw(_valid())
    batch_id = data["batch_id"]
    # the same broken id in key, subject and data reaches the checks behind the envelope's
    if draw(st.booleans()):
        batch_id = draw(_trapped(batch_id))
        data["batch_id"] = batch_id
        headers = [
            (n, batch_id.encode("utf-8", "surrogatepass")) if n == H_SUBJECT else (n, v) for n, v in headers
        ]
    for _ in range(draw(st.integers(0, 3))):  # fields replaced by any JSON, or a string with a trap
        name = draw(st.sampled_from([*sorted(data), "tenant", "deadline", "input_uri", "extra"]))
        if isinstance(data.get(name), str) and draw(st.booleans()):
            data[name] = draw(_trapped(data[name]))
        else:
            data[name] = draw(json_values)
    # the standard library writes what orjson refuses (integers past 64 bits, Infinity)
    value = json.dumps(data).encode() if draw(st.integers(0, 9)) else draw(st.binary(max_size=500))
    out: list[Header] = []
    for name, raw in headers:
        action = draw(st.integers(0, 9))
        if action == 0:
            continue  # dropped
        if action == 1:
            raw = draw(st.binary(max_size=100))
        elif action == 2:
            raw = draw(_trapped(raw.decode())).encode("utf-8", "surrogatepass")
        out.append((name, raw))
    out += draw(st.lists(st.tuples(st.sampled_from(HEADER_NAMES), st.binary(max_size=80)), max_size=3))
    key_choice = draw(st.integers(0, 5))
    key: bytes | None = batch_id.encode("utf-8", "surrogatepass")
    if key_choice == 0:
        key = None
    elif key_choice == 1:
        key = draw(st.binary(max_size=200))
    elif key_choice == 2:
        key = draw(_trapped(batch_id)).encode("utf-8", "surrogatepass")
    return key, value, out
