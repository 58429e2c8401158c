"""What the dispatcher keeps grows with nothing an outsider controls: each bound shown at 10^4 items."""

from __future__ import annotations

from typing import Any

import pytest

from llmbatch.dispatcher.domain.dlt import REDUCED_HEADERS_BYTES, OriginalRecord, without_value
from llmbatch.dispatcher.domain.keys import batch_key
from llmbatch.dispatcher.metrics import Metrics
from llmbatch.dispatcher.runs.context import RunContext
from llmbatch.dispatcher.runs.tracker import Tracker
from llmbatch.dispatcher.settings import DispatcherSettings

pytestmark = pytest.mark.unit


def test_the_headers_a_batch_keeps_are_bounded_whatever_the_record_brings() -> None:
    """Before, the batch hash kept a record's headers verbatim (up to the topic's 2 MiB)."""
    headers = tuple((f"h-{i}", b"v" * 200) for i in range(10_000))
    kept = without_value(OriginalRecord("t", 0, 7, b"k", b"value", headers, 0, 0))
    size = sum(len(name) + len(data) for name, data in kept.headers)
    assert kept.value is None and 0 < size <= REDUCED_HEADERS_BYTES
    assert kept.headers == headers[: len(kept.headers)]  # the first ones, in order
    assert len(kept.to_json()) < 2 * REDUCED_HEADERS_BYTES


def test_a_tracker_that_loses_its_leases_forgets_what_it_kept_of_batches() -> None:
    settings = DispatcherSettings(_env_file=None)
    store: Any = type("Store", (), {"keys": None})()
    tracker = Tracker(RunContext(settings, store, None, None, None, Metrics()))  # type: ignore[arg-type]
    tracker.leases._set(True, frozenset(range(settings.dispatcher.tracker_shards)))
    for i in range(10_000):
        key = batch_key(None, f"b-{i}")
        tracker.checks.progress._progress_at[key] = 1.0
        tracker.checks._beats[key] = ((1, "x"), 1.0)
        tracker._failing[("check", key)] = "boom"
    tracker.leases._set(False, frozenset())
    assert not tracker.checks.progress._progress_at and not tracker.checks._beats and not tracker._failing
