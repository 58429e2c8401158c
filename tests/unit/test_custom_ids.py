"""The custom_id index: exact first lines, in a dict and after it moved to SQLite."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmbatch.schemas.custom_ids import CustomIdIndex

pytestmark = pytest.mark.unit


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=4), max_size=60), st.integers(1, 8))
def test_first_lines_match_a_plain_dict_before_and_after_the_spill(ids: list[str], limit: int) -> None:
    expected: dict[str, int] = {}
    with CustomIdIndex(memory_limit=limit) as index:
        for line_no, custom_id in enumerate(ids, start=1):
            assert (custom_id in index) == (custom_id in expected)  # a lookup records nothing
            assert index.first_line(custom_id, line_no) == expected.get(custom_id)
            expected.setdefault(custom_id, line_no)
            assert custom_id in index
        assert len(index) == len(expected)
        assert index.spilled == (len(expected) >= limit)


def test_the_index_moves_to_sqlite_at_its_limit_and_keeps_answering() -> None:
    with CustomIdIndex(memory_limit=1000) as index:
        for i in range(999):
            assert index.first_line(f"id-{i}", i + 1) is None
        assert not index.spilled
        assert index.first_line("id-999", 1000) is None
        assert index.spilled
        for i in range(1000, 25_000):  # past a commit batch
            assert index.first_line(f"id-{i}", i + 1) is None
        assert index.first_line("id-5", 30_000) == 6
        assert index.first_line("id-24999", 30_001) == 25_000
        assert index.first_line("ünïcode-ïd", 30_002) is None
        assert index.first_line("ünïcode-ïd", 30_003) == 30_002
        assert len(index) == 25_001


def test_a_closed_index_is_empty_and_the_limit_is_checked() -> None:
    index = CustomIdIndex(memory_limit=2)
    index.first_line("a", 1)
    index.first_line("b", 2)
    index.close()
    assert not index.spilled and len(index) == 0 and "a" not in index
    with pytest.raises(ValueError, match="memory_limit"):
        CustomIdIndex(memory_limit=0)


def test_memory_stays_flat_once_spilled() -> None:
    import tracemalloc

    with CustomIdIndex(memory_limit=20_000) as index:
        tracemalloc.start()
        try:
            for i in range(60_000):
                index.first_line(f"request-{i:09d}", i + 1)
            at_60k = tracemalloc.get_traced_memory()[0]
            for i in range(60_000, 200_000):
                index.first_line(f"request-{i:09d}", i + 1)
            at_200k = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
    # a dict of the 140,000 more ids would hold ~15 MB more (ids, line numbers, slots)
    assert at_200k - at_60k < 1 << 20, (at_60k, at_200k)
