"""DoneKeys (what earlier attempts finished): exact like two sets, bounded once spilled, never pickled."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmbatch.ray_job.lines.parse import DoneKeys

pytestmark = pytest.mark.unit


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.text(max_size=3), max_size=40),
    st.lists(st.integers(0, 60), max_size=40),
    st.integers(1, 10),
    st.lists(st.text(max_size=3), max_size=10),
    st.lists(st.integers(0, 60), max_size=10),
)
def test_done_keys_answer_like_two_sets_before_and_after_the_spill(
    custom_ids: list[str], lines: list[int], limit: int, other_ids: list[str], other_lines: list[int]
) -> None:
    done = DoneKeys(custom_ids, lines, memory_limit=limit)
    try:
        for custom_id in custom_ids + other_ids:
            assert done.has_custom_id(custom_id) == (custom_id in custom_ids)
        for line_no in lines + other_lines:
            assert done.has_line(line_no) == (line_no in lines)
        # a custom_id that spells a line number is not that line (one index, two key spaces)
        for line_no in lines:
            assert done.has_custom_id(str(line_no)) == (str(line_no) in custom_ids)
        assert len(done) == len(set(custom_ids)) + len(set(lines))
        assert done.spilled == (len(done) >= limit)
    finally:
        done.close()


def test_memory_stays_flat_past_the_limit() -> None:
    import tracemalloc

    done = DoneKeys(memory_limit=20_000)
    tracemalloc.start()
    try:
        for i in range(60_000):
            done.add_custom_id(f"request-{i:09d}")
        at_60k = tracemalloc.get_traced_memory()[0]
        for i in range(60_000, 200_000):
            done.add_custom_id(f"request-{i:09d}")
            done.add_line(i)
        at_200k = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert done.has_custom_id("request-000000007") and done.has_line(199_999) and not done.has_line(7)
    done.close()
    # two sets of the 280,000 more keys would hold ~25 MB more
    assert at_200k - at_60k < 1 << 20, (at_60k, at_200k)


def test_done_keys_are_not_pickled_to_a_task() -> None:
    done = DoneKeys(["a"], [1])
    with pytest.raises(TypeError, match="done_shards"):
        pickle.dumps(done)
    done.close()
    assert len(done) == 0 and not done.has_custom_id("a")
