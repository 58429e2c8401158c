"""The shared engine's request order (ray_job.engines.fair_queue): priority, turns, prefixes, give-backs."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmbatch.ray_job.engines.fair_queue import FairQueue

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


def test_remove_takes_out_what_it_selects_and_the_rest_keep_their_turns() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(3):
        q.push("t/gone", 5, f"gone{i}", [i])
        q.push("t/kept", 5, f"kept{i}", [i])
    q.push("solo", 2, "solo0")
    q.push_front("t/gone", 5, "gone-back")
    removed = q.remove(lambda item: item.startswith("gone"))
    assert sorted(removed) == ["gone-back", "gone0", "gone1", "gone2"]
    assert len(q) == 4
    assert drain(q) == ["kept0", "kept1", "kept2", "solo0"]
    assert q.remove(lambda item: True) == [] and len(q) == 0 and q.top_priority() is None


def test_removing_a_whole_priority_lets_the_next_one_be_taken() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("urgent", 9, "u0", due=1.0)
    q.push("low", 1, "l0")
    assert q.remove(lambda item: item == "u0") == ["u0"]
    assert q.top_priority() == 1 and q.at_risk_waiting() == 0
    assert drain(q) == ["l0"]


@given(
    st.lists(
        st.tuples(st.sampled_from("abcd"), st.integers(0, 9), st.lists(st.integers(0, 3), max_size=4)),
        max_size=60,
    ),
    st.sets(st.integers(0, 59)),
)
def test_remove_then_every_other_item_comes_out_once(
    items: list[tuple[str, int, list[int]]], gone: set[int]
) -> None:
    q: FairQueue[int] = FairQueue()
    for n, (group, priority, prompt) in enumerate(items):
        q.push(group, priority, n, prompt)
    assert sorted(q.remove(lambda n: n in gone)) == sorted(gone & set(range(len(items))))
    assert len(q) == len(items) - len(gone & set(range(len(items))))
    taken = []
    while (t := q.pop()) is not None:
        taken.append(t[2])
    assert sorted(taken) == [n for n in range(len(items)) if n not in gone]
    assert len(q) == 0 and q.top_priority() is None


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


def test_a_batch_at_risk_of_its_deadline_goes_before_its_prioritys_turns() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(3):
        q.push("big", 5, f"big{i}", [i])
        q.push("small", 5, f"small{i}", [i])
    q.push("late", 5, "late0", [0], due=200.0)
    q.push("later", 5, "later0", [0], due=300.0)
    q.push("later", 5, "later1", [1], due=300.0)
    q.push("low", 4, "low0", [0], due=1.0)  # at risk, but priority stays strict
    assert drain(q) == [
        "late0",  # the earliest due first
        "later0",
        "later1",
        "big0",  # then the others, in turns as before
        "small0",
        "big1",
        "small1",
        "big2",
        "small2",
        "low0",
    ]


def test_a_call_without_due_puts_its_batch_back_in_turn() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("a", 5, "a0", [0])
    q.push("a", 5, "a1", [1])
    q.push("b", 5, "b0", [0], due=10.0)
    q.push("b", 5, "b1", [1])  # its next call: no longer at risk
    q.push("b", 5, "b2", [2])
    assert drain(q) == ["a0", "b0", "a1", "b1", "b2"]


@given(
    st.lists(
        st.tuples(
            st.sampled_from("abcd"),
            st.integers(0, 2),
            st.one_of(st.none(), st.floats(0, 100, allow_nan=False)),
        ),
        max_size=60,
    )
)
def test_at_risk_batches_are_served_earliest_due_first_within_a_priority(
    items: list[tuple[str, int, float | None]],
) -> None:
    q: FairQueue[int] = FairQueue()
    priority_of: dict[str, int] = {}
    due_of: dict[str, float | None] = {}
    for n, (group, priority, due) in enumerate(items):
        priority_of.setdefault(group, priority)
        due_of[group] = due  # the latest call says whether the batch is at risk
        q.push(group, priority, n, [], due=due)
    taken = []
    while (t := q.pop()) is not None:
        taken.append(t)
    assert sorted(item for _, _, item in taken) == list(range(len(items)))
    for priority in {p for _, p, _ in taken}:
        groups = [g for g, p, _ in taken if p == priority]
        # every request of a batch at risk comes before any of a batch not at risk, earliest due first
        dues = [due_of[g] for g in groups]
        risky = [d for d in dues if d is not None]
        assert dues[: len(risky)] == risky
        assert risky == sorted(risky)


def test_tenants_take_turns_before_their_batches_do() -> None:
    """One tenant's five batches take one tenant's share: the other tenant's lone batch is served every
    other turn, not every sixth."""
    q: FairQueue[str] = FairQueue()
    for b in range(5):
        for i in range(2):
            q.push(f"big/b{b}", 5, f"big-b{b}-{i}", [i])
    for i in range(4):
        q.push("lone/x", 5, f"lone-{i}", [i])
    taken = drain(q)
    assert taken[:8] == [
        "big-b0-0",
        "lone-0",
        "big-b1-0",
        "lone-1",
        "big-b2-0",
        "lone-2",
        "big-b3-0",
        "lone-3",
    ]
    assert sorted(taken[8:]) == sorted(
        f"big-b{b}-{i}" for b in range(5) for i in range(2) if (b, i) not in {(0, 0), (1, 0), (2, 0), (3, 0)}
    )


def test_tenants_share_by_weight() -> None:
    q: FairQueue[str] = FairQueue(weights={"gold": 2.0})
    for i in range(12):
        q.push(f"gold/g{i % 2}", 5, f"gold{i}", [i])
        q.push("bronze/b", 5, f"bronze{i}", [i])
    taken = [t.rstrip("0123456789") for t in drain(q)]
    for end in (3, 6, 9, 12, 15, 18):  # two of gold's for one of bronze's, at every point
        assert Counter(taken[:end]) == {"gold": end * 2 // 3, "bronze": end // 3}, taken[:end]


def test_a_tenant_that_starts_waiting_gets_no_credit_for_the_time_it_was_away() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(20):
        q.push("a/1", 5, f"a{i}", [i])
    for _ in range(10):  # a alone for ten turns
        q.pop()
    for i in range(5):
        q.push("b/1", 5, f"b{i}", [i])
    assert [t.rstrip("0123456789") for t in drain(q)] == ["a", "b"] * 5 + ["a"] * 5


@given(
    st.lists(
        st.tuples(st.sampled_from(["t1", "t2", "t3"]), st.integers(0, 4), st.integers(0, 1)),
        max_size=80,
    )
)
def test_no_tenant_is_served_twice_while_another_of_its_priority_still_waits(
    items: list[tuple[str, int, int]],
) -> None:
    q: FairQueue[int] = FairQueue()
    priority_of: dict[str, int] = {}
    for n, (tenant, batch, priority) in enumerate(items):
        group = f"{tenant}/b{batch}"
        priority_of.setdefault(group, priority)
        q.push(group, priority, n)
    taken = []
    while (t := q.pop()) is not None:
        taken.append(t)
    assert sorted(item for _, _, item in taken) == list(range(len(items)))
    for priority in {p for _, p, _ in taken}:
        tenants = [g.partition("/")[0] for g, p, _ in taken if p == priority]
        left = Counter(tenants)
        for i in range(len(tenants) - 1):
            left[tenants[i]] -= 1
            if tenants[i] == tenants[i + 1]:
                assert all(left[t] == 0 for t in left if t != tenants[i]), tenants
