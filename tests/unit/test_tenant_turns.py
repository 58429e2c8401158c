"""The launcher's order of ready batches (dispatcher.domain.tenant_turns): priority, then tenants in
turns by their batches in flight and weight, then the queue's order."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmbatch.dispatcher.domain.tenant_turns import launch_order

pytestmark = pytest.mark.unit


def test_a_tenants_lone_batch_goes_before_the_many_another_queued_first() -> None:
    candidates = [("many", 5)] * 50 + [("lone", 5)]
    order = launch_order(candidates, {"many": 3}, {})
    assert order[0] == 50  # lone has none in flight, many three
    assert order[1:] == list(range(50))  # many's keep the queue's order


def test_priority_stays_strict_and_weights_share_turns() -> None:
    candidates = [("a", 5), ("a", 5), ("a", 5), ("a", 5), ("b", 5), ("b", 5), ("c", 9)]
    assert launch_order(candidates, {}, {})[0] == 6
    order = launch_order(candidates, {}, {"a": 2.0})
    tenants = [candidates[i][0] for i in order[1:]]
    assert tenants == ["a", "b", "a", "a", "b", "a"]


@given(
    st.lists(st.tuples(st.sampled_from("xyz"), st.integers(0, 2)), max_size=40),
    st.dictionaries(st.sampled_from("xyz"), st.integers(0, 5)),
)
def test_every_candidate_once_priorities_first_and_a_tenants_own_in_queue_order(
    candidates: list[tuple[str, int]], in_flight: dict[str, int]
) -> None:
    order = launch_order(candidates, in_flight, {})
    assert sorted(order) == list(range(len(candidates)))
    priorities = [candidates[i][1] for i in order]
    assert priorities == sorted(priorities, reverse=True)
    for tenant in set(t for t, _ in candidates):
        for priority in set(p for _, p in candidates):
            mine = [i for i in order if candidates[i] == (tenant, priority)]
            assert mine == sorted(mine)
    # within a priority, the tenants' counts (in flight + taken so far) never differ by more than one
    # while each still has candidates of that priority
    for priority in set(p for _, p in candidates):
        taken = Counter({t: n for t, n in in_flight.items()})
        left = Counter(t for t, p in candidates if p == priority)
        for i in order:
            tenant, p = candidates[i]
            if p != priority:
                continue
            waiting = [t for t in left if left[t] > 0]
            assert taken[tenant] <= min(taken[t] for t in waiting), (taken, tenant)
            taken[tenant] += 1
            left[tenant] -= 1
