"""Bounded line splitting of JSONL input (schemas.lines): the same lines as a plain split, in linear
time, and never more than max_line_bytes + 1 bytes of a line in memory (fuzzed with hypothesis)."""

from __future__ import annotations

import itertools
import tracemalloc
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmbatch.schemas.lines import count_lines, split_lines

pytestmark = pytest.mark.unit

_bytes = st.binary(max_size=300).map(lambda b: b.replace(b"\r", b"\n"))  # plenty of newlines


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


def plain_lines(data: bytes) -> list[bytes]:
    parts = data.split(b"\n")
    return parts if parts[-1] else parts[:-1]


@given(_bytes, st.lists(st.integers(min_value=0, max_value=400), max_size=20))
def test_the_lines_are_a_plain_split_however_the_stream_is_chunked(data: bytes, cuts: list[int]) -> None:
    chunks = chunked(data, cuts)
    assert list(split_lines(chunks)) == plain_lines(data)
    assert count_lines(chunks) == sum(1 for line in plain_lines(data) if line.strip())


@given(_bytes, st.lists(st.integers(min_value=0, max_value=400), max_size=20), st.integers(0, 40))
def test_a_long_line_is_cut_to_the_limit_plus_one_and_the_rest_skipped(
    data: bytes, cuts: list[int], limit: int
) -> None:
    got = list(split_lines(chunked(data, cuts), limit))
    want = plain_lines(data)
    assert len(got) == len(want)  # line numbers stay right
    for line, full in zip(got, want, strict=True):
        assert line == (full if len(full) <= limit else full[: limit + 1])


def no_newline(total_mib: int) -> Iterator[bytes]:
    block = b"x" * (1 << 20)
    for _ in range(total_mib):
        yield block


def test_memory_stays_flat_on_a_stream_without_newlines() -> None:
    """256 MiB without a newline: the splitter keeps a bounded head, the counter nothing."""
    tracemalloc.start()
    try:
        [line] = list(split_lines(no_newline(256), 64 << 10))
        _, split_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        assert count_lines(no_newline(256)) == 1
        _, count_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(line) == (64 << 10) + 1
    assert split_peak < 8 << 20 and count_peak < 8 << 20, (split_peak, count_peak)
