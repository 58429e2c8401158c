"""How many lines a batch sends per call to a shared engine (schemas.engines.call_rows); the window
the dispatcher's admission counts for it is tested in test_dispatcher_admission.py."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from llmbatch.schemas.engines import FILL_ROUNDS, call_rows


def test_a_lone_batch_fills_the_engine_whatever_its_batch_size() -> None:
    # the local stack's entry: batch_size 4, 4 calls, one replica running 256 at once: 256 running and
    # 256 waiting their turn (FILL_ROUNDS)
    assert call_rows(batch_size=4, batches_in_flight=4, engine_slots=256) == 128
    # two live replicas: twice as much
    assert call_rows(batch_size=4, batches_in_flight=4, engine_slots=512) == 256


def test_a_small_batch_spreads_its_lines_and_keeps_at_least_batch_size() -> None:
    assert call_rows(batch_size=4, batches_in_flight=4, engine_slots=256, lines=8) == 4
    assert call_rows(batch_size=4, batches_in_flight=4, engine_slots=256, lines=128) == 32
    assert call_rows(batch_size=4, batches_in_flight=4, engine_slots=256, lines=512) == 128  # all at once
    assert call_rows(batch_size=4, batches_in_flight=4, engine_slots=256, lines=10_000) == 128


def test_an_engine_that_does_not_say_leaves_batch_size() -> None:
    assert call_rows(batch_size=64, batches_in_flight=4, engine_slots=0) == 64
    assert call_rows(batch_size=4, batches_in_flight=4, engine_slots=0, lines=1_000) == 4


@given(
    batch_size=st.integers(1, 1024),
    in_flight=st.integers(1, 64),
    slots=st.integers(0, 100_000),
    lines=st.none() | st.integers(0, 1_000_000),
)
def test_calls_together_cover_the_slots_and_never_much_more(
    batch_size: int, in_flight: int, slots: int, lines: int | None
) -> None:
    rows = call_rows(batch_size=batch_size, batches_in_flight=in_flight, engine_slots=slots, lines=lines)
    want = FILL_ROUNDS * slots if lines is None else min(FILL_ROUNDS * slots, lines)
    assert rows >= batch_size
    assert rows * in_flight >= want  # the batch's calls together cover what it can use
    assert rows == batch_size or rows == math.ceil(want / in_flight)  # and not a line more
