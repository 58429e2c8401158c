"""The repeat limiter of libraries' log lines (aiokafka during a broker outage)."""

from __future__ import annotations

import io
import logging

import orjson
import pytest

from llmbatch.dispatcher import logs
from llmbatch.dispatcher.log_limits import MAX_KINDS, RepeatLimiter
from tests.support.clock import Clock

pytestmark = pytest.mark.unit


def record(name: str, msg: str, *args: object, level: int = logging.ERROR) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


def test_a_repeated_library_error_passes_once_then_once_per_interval_with_the_count() -> None:
    clock = Clock(1000.0)
    limiter = RepeatLimiter(every_s=30, clock=clock)
    passed = []
    for i in range(600):  # a retry every 0.1 s for 60 s
        rec = record("aiokafka.conn", "Unable connect to node with id %s: %s", i % 3, "refused")
        if limiter.filter(rec):
            passed.append(rec)
        clock.now += 0.1
    assert len(passed) == 2
    assert not hasattr(passed[0], "suppressed")
    assert passed[1].suppressed == 299  # type: ignore[attr-defined]
    assert "[299 more like this in the last 30 s]" in passed[1].getMessage()
    assert "Unable connect to node with id" in passed[1].getMessage()


def test_other_kinds_levels_and_loggers_are_not_limited() -> None:
    limiter = RepeatLimiter(every_s=30, clock=Clock(1000.0))
    assert limiter.filter(record("aiokafka", "Unable to update metadata"))
    assert limiter.filter(record("aiokafka.cluster", "Unable to update metadata"))  # another logger
    assert limiter.filter(record("aiokafka", "Another message"))
    assert not limiter.filter(record("aiokafka", "Unable to update metadata"))
    for _ in range(5):
        assert limiter.filter(record("aiokafka", "Unable to update metadata", level=logging.INFO))
        assert limiter.filter(record("dispatcher.consumer", "kafka unreachable"))
        assert limiter.filter(record("aiokafkax", "not a child of aiokafka"))


def test_the_kinds_it_remembers_are_bounded() -> None:
    limiter = RepeatLimiter(every_s=30, clock=Clock(1000.0))
    for i in range(MAX_KINDS + 10):
        assert limiter.filter(record("kafka", f"kind {i}"))
    assert len(limiter._kinds) == MAX_KINDS
    assert limiter.filter(record("kafka", "kind 0"))  # forgotten: said again


def test_the_service_handler_limits_aiokafka(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    logs.setup("INFO", json_format=True)
    try:
        for _ in range(50):
            logging.getLogger("aiokafka.conn").error("Unable connect to node with id %s", 1)
        logging.getLogger("dispatcher.consumer").warning("kafka unreachable")
    finally:
        root = logging.getLogger()
        for handler in [h for h in root.handlers if getattr(h, "_llmbatch", False)]:
            root.removeHandler(handler)
    lines = [orjson.loads(line) for line in stream.getvalue().splitlines()]
    assert [line["logger"] for line in lines] == ["aiokafka.conn", "dispatcher.consumer"]
