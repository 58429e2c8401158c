"""A record never stops the consumer (pure parts): bounded retries of non-transient failures, the
dead letter of a record given up on, reduced dead letters for records too large for the dead-letter
topic, topic sizes from the settings. The real-server halves are in
tests/integration/test_dispatcher_consumer.py and test_dispatcher_publisher.py."""

from __future__ import annotations

import asyncio
import hashlib
import struct
from typing import Any

import pytest
from aiokafka.errors import MessageSizeTooLargeError
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from pydantic import ValidationError

from llmbatch.adapters.topics import topic_configs
from llmbatch.dispatcher.domain.dlt import (
    REDUCED_HEADERS_BYTES,
    DeadLetter,
    build_dead_letter,
    fit_dead_letter,
    record_size,
    reduce_dead_letter,
)
from llmbatch.dispatcher.domain.retry import Backoff
from llmbatch.dispatcher.errors import PermanentError, RecordTooLarge, StateStoreUnavailable, classify
from llmbatch.dispatcher.intake.record_retry import Abandoned, GaveUp, RecordRetry, failure_letter
from llmbatch.dispatcher.metrics import Metrics
from llmbatch.dispatcher.ops.dlq_reader import DeadLetterView
from llmbatch.dispatcher.ops.replay import Decision, plan
from llmbatch.dispatcher.settings import DispatcherOptions
from llmbatch.schemas import dlt as dlt_headers
from llmbatch.schemas.batch import InlineLimits
from llmbatch.schemas.dlt import DltReason, DltRecord, strip_dlt_headers
from llmbatch.settings import MIN_MESSAGE_BYTES, KafkaSettings, TopicSettings
from tests.support.dispatcher_kit import batch_request, inline_lines, origin, request_message

pytestmark = pytest.mark.unit

DLT = "llm.batch.requests.v1.dlt"


def letter_of(
    value: bytes,
    *,
    key: bytes | None = b"batch-1",
    extra: list[tuple[str, bytes]] | None = None,
    reason: str = DltReason.INVALID_EVENT,
) -> DeadLetter:
    headers = [("ce_id", b"e-1"), ("ce_source", b"urn:test"), *(extra or [])]
    return build_dead_letter(
        origin(key, value, headers, partition=2, offset=41),
        dlt_topic=DLT,
        reason=reason,
        group_id="g1",
        fqcn="llmbatch.schemas.errors.SchemaError",
        message="invalid_json: " + "x" * 5000,
    )


# --- record sizes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 100, 70_000, 3 << 20])
def test_record_size_is_an_upper_bound_of_aiokafkas_estimate(size: int) -> None:
    letter = letter_of(b"v" * size, extra=[("big", b"h" * 300)])
    headers: list[tuple[str, bytes | None]] = list(letter.headers)
    assert letter.size >= DefaultRecordBatchBuilder.estimate_size_in_bytes(letter.key, letter.value, headers)
    assert letter.size - size < 6000  # headers and framing, not a multiple of the value
    assert record_size(None, None, []) < 200


def test_a_letter_that_fits_is_sent_as_is() -> None:
    letter = letter_of(b"{not json" * 10)
    assert fit_dead_letter(letter, MIN_MESSAGE_BYTES) is letter
    assert not letter.reduced and letter.record.reduced is False


def test_a_letter_too_large_is_reduced_to_a_pointer_with_size_and_hash() -> None:
    value = b"{" + b"x" * 200_000
    big_header = ("blob", b"b" * 5000)
    letter = letter_of(value, extra=[big_header])
    fitted = fit_dead_letter(letter, MIN_MESSAGE_BYTES)
    assert fitted.reduced and fitted.value is None and fitted.key == b"batch-1"
    assert fitted.size <= MIN_MESSAGE_BYTES
    assert fitted.reason == DltReason.INVALID_EVENT and fitted.topic == DLT
    headers = dict(fitted.headers)
    assert headers["ce_id"] == b"e-1" and "blob" not in headers  # small original headers kept
    assert headers[dlt_headers.REDUCED] == b"true"
    assert headers[dlt_headers.ORIGINAL_VALUE_BYTES] == str(len(value)).encode()
    assert headers[dlt_headers.ORIGINAL_VALUE_SHA256] == hashlib.sha256(value).hexdigest().encode()
    assert headers[dlt_headers.ORIGINAL_HEADERS_DROPPED] == b"1"
    assert struct.unpack(">q", headers[dlt_headers.ORIGINAL_OFFSET])[0] == 41
    assert struct.unpack(">i", headers[dlt_headers.ORIGINAL_PARTITION])[0] == 2
    # readers decode the pointer; a replay strips every DLT header again
    record = DltRecord.from_headers(fitted.headers)
    assert record is not None and record.reduced and record.original_value_bytes == len(value)
    assert record.original_value_sha256 == hashlib.sha256(value).hexdigest()
    assert record.original_headers_dropped == 1 and record.original_offset == 41
    assert strip_dlt_headers(fitted.headers) == [("ce_id", b"e-1"), ("ce_source", b"urn:test")]


def test_reduced_letters_fit_the_smallest_topic_whatever_the_record() -> None:
    many = [(f"h{i}", b"v" * 1000) for i in range(100)]  # 100 KB of small headers
    letter = letter_of(b"x" * 10, key=b"k" * 5000, extra=many)
    reduced = reduce_dead_letter(letter)
    assert reduced.key is None  # a key over 1 KiB is left out too
    kept = [h for h in reduced.headers if h[0].startswith("h")]
    assert sum(len(n) + len(v) for n, v in kept) <= REDUCED_HEADERS_BYTES
    assert reduced.record.original_headers_dropped == 100 - len(kept)
    assert reduced.size <= MIN_MESSAGE_BYTES


def test_an_unreduced_letter_decodes_as_before() -> None:
    record = DltRecord.from_headers(letter_of(b"x").headers)
    assert record is not None and not record.reduced
    assert record.original_value_bytes is None and record.original_value_sha256 is None
    lenient = DltRecord.from_headers(
        [
            (dlt_headers.REASON, b"invalid_event"),
            (dlt_headers.REDUCED, b"true"),
            (dlt_headers.ORIGINAL_VALUE_SHA256, b"not-a-hash"),
            (dlt_headers.ORIGINAL_VALUE_BYTES, b"-3"),
        ]
    )
    assert lenient is not None and lenient.reduced
    assert lenient.original_value_sha256 is None and lenient.original_value_bytes is None


def test_replay_refuses_a_reduced_dead_letter_even_forced() -> None:
    reduced = reduce_dead_letter(letter_of(b"x" * 100_000))
    view = DeadLetterView(
        DLT,
        0,
        5,
        None,
        reduced.key,
        reduced.value,
        tuple(reduced.headers),
        DltRecord.from_headers(reduced.headers),
    )
    [item] = plan([view], ledger={}, states={}, default_topic="llm.batch.requests.v1", force=True)
    assert item.decision is Decision.REFUSED
    assert "reduced dead letter" in item.why and "partition 2 offset 41" in item.why


def test_too_large_records_are_their_own_error() -> None:
    assert isinstance(classify(MessageSizeTooLargeError()), RecordTooLarge)
    assert not classify(MessageSizeTooLargeError()).retriable


# --- topic sizes ------------------------------------------------------------------------------------


def test_topics_are_created_with_the_settings_sizes() -> None:
    topics = TopicSettings(max_message_bytes=3 << 20, dead_letter_max_message_bytes=1 << 20)
    kafka = KafkaSettings(topics=topics)
    configs = topic_configs(kafka)
    assert configs["requests"]["max.message.bytes"] == str(3 << 20)
    assert configs["results"]["max.message.bytes"] == str(3 << 20)
    assert configs["dead_letter"]["max.message.bytes"] == str(1 << 20)
    assert configs["dead_letter"]["retention.ms"] == str(30 * 24 * 3600 * 1000)


def test_default_sizes_take_an_inline_batch_at_the_limits_and_its_dead_letter() -> None:
    topics, limits = TopicSettings(), InlineLimits()
    lines = inline_lines(1)
    line_bytes = len(str(lines[0]).encode())
    request = batch_request(
        "b" * 64,
        requests=inline_lines(limits.max_bytes // line_bytes),
        metadata={f"k{i:02d}": "v" * 512 for i in range(16)},
    )
    key, value, headers = request_message(request)
    assert record_size(key, value, headers) <= topics.max_message_bytes
    letter = letter_of(b"x" * topics.max_message_bytes)  # the largest record the requests topic takes
    assert fit_dead_letter(letter, topics.dead_letter_max_message_bytes) is letter


@pytest.mark.parametrize("field", ["max_message_bytes", "dead_letter_max_message_bytes"])
@pytest.mark.parametrize("value", [1024, 200 << 20])
def test_topic_sizes_are_bounded(field: str, value: int) -> None:
    with pytest.raises(ValidationError, match=field):
        TopicSettings(**{field: value})


@pytest.mark.parametrize("value", [0, 21])
def test_record_max_attempts_is_bounded(value: int) -> None:
    with pytest.raises(ValidationError, match="record_max_attempts"):
        DispatcherOptions(record_max_attempts=value)


# --- bounded retries ------------------------------------------------------------------------------------


def retry(epoch: list[int] | None = None) -> RecordRetry:
    current = epoch if epoch is not None else [0]
    return RecordRetry(Backoff(0.001, 0.002, jitter=0), Metrics(), asyncio.Event(), lambda: current[0])


class Flaky:
    """Fails with each of ``errors`` in turn, then returns 'done'."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "done"


async def test_outages_are_retried_without_limit() -> None:
    fn = Flaky(*[StateStoreUnavailable("down")] * 10)
    r = retry()
    assert await r.run("intake", fn, 0, max_attempts=2) == "done"
    assert fn.calls == 11
    assert r.metrics.transient_errors.labels(component="redis")._value.get() == 10


async def test_permanent_errors_and_bugs_give_up_after_max_attempts() -> None:
    fn = Flaky(
        PermanentError("OutOfMemoryError: command not allowed"),
        StateStoreUnavailable("blip"),
        KeyError("bug"),
        PermanentError("again"),
    )
    with pytest.raises(GaveUp) as caught:
        await retry().run("intake", fn, 0, max_attempts=3)
    assert caught.value.attempts == 3 and fn.calls == 4  # the outage did not count
    assert isinstance(caught.value.error, PermanentError) and "failed 3 times" in str(caught.value)
    fn = Flaky(KeyError("bug"))
    with pytest.raises(GaveUp) as once:
        await retry().run("cancel", fn, 0, max_attempts=1)
    assert isinstance(once.value.error, KeyError) and "KeyError" in str(once.value)
    fn = Flaky(KeyError("bug"))
    assert await retry().run("intake", fn, 0, max_attempts=2) == "done"


async def test_a_revoked_partition_abandons_the_retries() -> None:
    epoch = [0]
    r = retry(epoch)

    async def fail() -> Any:
        epoch[0] = 1  # a rebalance happened meanwhile
        raise StateStoreUnavailable("down")

    with pytest.raises(Abandoned):
        await r.run("intake", fail, 0, max_attempts=3)


def test_the_dead_letter_of_a_record_given_up_on_names_the_cause() -> None:
    rec = origin(b"batch-9", b'{"batch_id": "batch-9"}', [("ce_id", b"e-9")], offset=7)
    try:
        try:
            raise ValueError("OOM command not allowed when used memory > 'maxmemory'")
        except ValueError as inner:
            raise PermanentError(f"OutOfMemoryError: {inner}") from inner
    except PermanentError as exc:
        failed = GaveUp("intake", exc, 3)
    letter = failure_letter(rec, failed, dlt_topic=DLT, group_id="g1")
    headers = dict(letter.headers)
    assert (letter.key, letter.value) == (rec.key, rec.value)
    assert headers[dlt_headers.REASON] == b"processing_failed"
    assert headers[dlt_headers.EXCEPTION_FQCN] == b"builtins.ValueError"  # the library's error
    message = headers[dlt_headers.EXCEPTION_MESSAGE].decode()
    assert message.startswith("intake failed 3 times: OutOfMemoryError") and "maxmemory" in message


async def test_an_outage_is_logged_once_per_change_of_state_not_per_try(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    beats: list[float] = []
    retry = RecordRetry(
        Backoff(0.0001, 0.0001),
        Metrics(),
        asyncio.Event(),
        lambda: 0,
        beat=lambda: beats.append(now[0]),
        clock=lambda: now[0],
    )
    failures = iter(range(200))

    async def flaky() -> str:
        if next(failures) < 199:
            now[0] += 0.5  # 199 tries over ~100 s of Redis outage
            raise StateStoreUnavailable("redis down")
        return "ok"

    with caplog.at_level("INFO", logger="llmbatch.dispatcher.intake.record_retry"):
        assert await retry.run("intake", flaky, 0, max_attempts=3) == "ok"
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("dependency unavailable")
    assert lines.count("dependency still unavailable") == 3  # every 30 s of ~100 s, not 199 times
    assert lines[-1] == "dependency back" and len(lines) == 5
    assert len(beats) == 200  # every try says the consumer is alive (/livez)


class RefusingDlt:
    """A producer whose dead-letter topic refuses each letter ``refusals`` times for good (a permanent
    error), then takes it; records what it was sent."""

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.sent: list[Any] = []
        self.after: tuple[int, Any] | None = None  # (n, fn): fn() once n letters were sent

    async def dead_letter(self, letter: Any) -> Any:
        self.sent.append(letter)
        if self.after is not None and len(self.sent) == self.after[0]:
            self.after[1]()
        if self.refusals > 0:
            self.refusals -= 1
            raise RecordTooLarge("the topic refuses it")
        return type("Meta", (), {"partition": 0, "offset": 41})()


async def test_a_refused_dead_letter_pauses_intake_until_it_is_taken_never_skips_the_record() -> None:
    """Before: the record was skipped (committed with no dead letter, no answer) once its dead letter
    failed max_attempts times."""
    rec = origin(b"k", b"junk", [("ce_id", b"e-1")], offset=9)
    failed = GaveUp("intake", KeyError("bug"), 3)
    r = retry()
    dlt = RefusingDlt(refusals=2 + 2 + 3)  # the full letter twice, the reduced one 2 + 3 times
    written = await r.give_up(dlt, rec, failed, 0, dlt_topic="t.dlt", group_id="g", max_attempts=2)  # type: ignore[arg-type]
    assert written is not None and (written.topic, written.offset) == ("t.dlt", 41)
    assert len(dlt.sent) == 8 and dlt.sent[-1] is dlt.sent[2]  # the reduced form, until it was taken
    assert r.metrics.intake_paused.labels(cause="dead_letter_refused")._value.get() == 0  # resumed
    assert r.paused is None


async def test_a_dead_letter_refused_for_good_holds_the_record_until_the_consumer_stops() -> None:
    rec = origin(b"k", b"junk", [("ce_id", b"e-1")], offset=9)
    r = retry()
    dlt = RefusingDlt(refusals=10**9)
    dlt.after = (8, r.stopping.set)  # the consumer stops while intake is paused on the record
    with pytest.raises(Abandoned):
        await r.give_up(
            dlt,  # type: ignore[arg-type]
            rec,
            GaveUp("intake", KeyError("bug"), 3),
            0,
            dlt_topic="t.dlt",
            group_id="g",
            max_attempts=2,
        )
    assert r.paused == "dead_letter_refused"
    assert r.metrics.intake_paused.labels(cause="dead_letter_refused")._value.get() == 1
