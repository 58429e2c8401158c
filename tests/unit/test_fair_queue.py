"""The shared engine's request order (ray_job.fair_queue): priority, turns, prefixes, give-backs."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmbatch.ray_job.fair_queue import FairQueue

pytestmark = pytest.mark.unit


def drain(q: FairQueue[str]) -> list[str]:
    out = []
    while (taken := q.pop()) is not None:
        out.append(taken[2])
    return out


def test_higher_priority_first_then_batches_take_turns() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(5):
        q.push("big", 5, f"big{i}", [i])
    q.push("small", 5, "small0", [0])
    q.push("small", 5, "small1", [1])
    q.push("urgent", 9, "urgent0", [0])
    assert q.top_priority() == 9 and len(q) == 8
    assert drain(q) == ["urgent0", "big0", "small0", "big1", "small1", "big2", "big3", "big4"]
    assert q.top_priority() is None and len(q) == 0 and q.pop() is None


def test_requests_with_a_shared_prefix_are_taken_together() -> None:
    q: FairQueue[str] = FairQueue()
    system_a, system_b = [7, 7, 7], [3, 3, 3]
    for i, system in enumerate([system_a, system_b, system_a, system_b]):
        q.push("b", 5, f"r{i}", [*system, 100 + i])
    assert drain(q) == ["r1", "r3", "r0", "r2"]


def test_a_request_given_back_is_its_batch_next() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(3):
        q.push("low", 0, f"low{i}", [i])
    first = q.pop()
    assert first == ("low", 0, "low0")
    q.push_front("low", 0, "low0")
    assert drain(q) == ["low0", "low1", "low2"]


def test_drain_empties_everything() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("a", 1, "x")
    q.push_front("b", 2, "y")
    assert sorted(q.drain()) == ["x", "y"]
    assert len(q) == 0 and q.pop() is None and q.top_priority() is None


@given(
    st.lists(
        st.tuples(st.sampled_from("abcd"), st.integers(0, 9), st.lists(st.integers(0, 3), max_size=4)),
        max_size=60,
    )
)
def test_every_item_comes_out_once_in_priority_order(items: list[tuple[str, int, list[int]]]) -> None:
    q: FairQueue[int] = FairQueue()
    priority_of: dict[str, int] = {}
    for n, (group, priority, prompt) in enumerate(items):
        priority_of.setdefault(group, priority)  # a batch keeps its first priority while it waits
        q.push(group, priority, n, prompt)
    taken = []
    while (t := q.pop()) is not None:
        taken.append(t)
    assert sorted(item for _, _, item in taken) == list(range(len(items)))
    priorities = [p for _, p, _ in taken]
    assert priorities == sorted(priorities, reverse=True)
    assert all(priority_of[g] == p for g, p, _ in taken)
    # fairness: within one priority, no batch is served twice while another of it still waits
    for priority in set(priorities):
        groups = [g for g, p, _ in taken if p == priority]
        left = Counter(groups)
        for i in range(len(groups) - 1):
            left[groups[i]] -= 1
            if groups[i] == groups[i + 1]:
                assert all(left[g] == 0 for g in left if g != groups[i]), groups
