"""Dispatcher domain rules (pure): lifecycle, retry policy, scheduling order, backpressure."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmbatch.dispatcher.domain import states
from llmbatch.dispatcher.domain.retry import AttemptPolicy, Backoff
from llmbatch.dispatcher.domain.scheduler import Backpressure, launch_slots, ready_score
from llmbatch.dispatcher.domain.states import State

pytestmark = pytest.mark.unit


# --- lifecycle ---------------------------------------------------------------------------------------


def test_happy_path_is_allowed_in_order() -> None:
    path = [State.QUEUED, State.SUBMITTED, State.RUNNING, State.FINALIZING, State.COMPLETED]
    assert states.can_transition(None, State.QUEUED)
    for src, dst in itertools.pairwise(path):
        assert states.can_transition(src, dst), f"{src} -> {dst}"


@pytest.mark.parametrize("terminal", sorted(states.TERMINAL))
def test_terminal_states_only_leave_by_replay(terminal: State) -> None:
    allowed = states.ALLOWED[terminal]
    if terminal in states.REPLAYABLE:
        assert allowed == {State.ACCEPTED}
    else:
        assert allowed == frozenset()
    for dst in State:
        if dst is not State.ACCEPTED:
            assert not states.can_transition(terminal, dst)


def test_every_non_terminal_state_can_fail_except_by_skipping_launch() -> None:
    for src in states.NON_TERMINAL:
        for ending in (State.FAILED, State.EXPIRED, State.CANCELLED):
            assert states.can_transition(src, ending), f"{src} -> {ending}"


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (State.QUEUED, State.RUNNING),  # must be submitted first
        (State.QUEUED, State.COMPLETED),  # never completes without a job
        (State.SUBMITTED, State.COMPLETED),  # completion goes through finalizing
        (State.RUNNING, State.SUBMITTED),
        (None, State.RUNNING),
        (None, State.COMPLETED),
    ],
)
def test_forbidden_transitions(src: State | None, dst: State) -> None:
    assert not states.can_transition(src, dst)
    with pytest.raises(states.TransitionError):
        states.check_transition(src, dst)


def test_retry_goes_back_to_queued_from_every_in_flight_state() -> None:
    assert states.sources_of(State.QUEUED) >= states.IN_FLIGHT


def test_dead_lettered_reports_failed() -> None:
    assert states.terminal_event_state(State.DEAD_LETTERED) is State.FAILED
    assert states.terminal_event_state(State.EXPIRED) is State.EXPIRED
    with pytest.raises(states.TransitionError):
        states.terminal_event_state(State.RUNNING)


# --- retry policy ------------------------------------------------------------------------------------


def test_backoff_doubles_and_caps_without_jitter() -> None:
    b = Backoff(base_s=1.0, maximum_s=10.0, jitter=0.0)
    assert [b.delay(n) for n in range(1, 7)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert b.delay(0) == 0.0
    assert b.delay(10_000) == 10.0  # no overflow


def test_backoff_jitter_stays_within_bounds() -> None:
    b = Backoff(base_s=2.0, maximum_s=100.0, jitter=0.25)
    assert b.delay(3, rand=lambda: 0.0) == 8.0
    assert b.delay(3, rand=lambda: 0.999999) == pytest.approx(6.0, rel=1e-4)


@pytest.mark.parametrize("bad", [dict(base_s=0), dict(base_s=5, maximum_s=1), dict(jitter=1.0)])
def test_backoff_rejects_nonsense(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=r"backoff|jitter"):
        Backoff(**bad)


def test_attempt_policy_retries_until_max_then_exhausts() -> None:
    policy = AttemptPolicy(max_attempts=3, backoff=Backoff(1.0, 60.0, jitter=0.0))
    first, second, third = (policy.after_failure(n, retriable=True) for n in (1, 2, 3))
    assert (first.retry, first.delay_s) == (True, 1.0)
    assert (second.retry, second.delay_s) == (True, 2.0)
    assert (third.retry, third.reason) == (False, "attempts_exhausted")


def test_attempt_policy_never_retries_non_retriable() -> None:
    decision = AttemptPolicy(max_attempts=5).after_failure(1, retriable=False)
    assert not decision.retry and decision.reason == "non_retriable"


# --- scheduling ---------------------------------------------------------------------------------------


def test_ready_score_orders_by_priority_then_deadline() -> None:
    # the second argument is the batch's deadline: the nearest goes first within a priority (EDF)
    batches = {
        "low-old": ready_score(1, 1_000.0),
        "high-new": ready_score(9, 5_000.0),
        "high-old": ready_score(9, 2_000.0),
        "mid": ready_score(5, 1_500.0),
        "low-new": ready_score(1, 9_000.0),
    }
    order = sorted(batches, key=batches.__getitem__)
    assert order == ["high-old", "high-new", "mid", "low-old", "low-new"]


def test_ready_score_is_exact_for_real_timestamps() -> None:
    # one millisecond apart at a 2026 timestamp must still sort apart inside a double
    a, b = ready_score(0, 1_790_000_000.000), ready_score(0, 1_790_000_000.001)
    assert a < b
    assert ready_score(9, 4_000_000_000.0) < ready_score(8, 1.0)


@given(
    a=st.tuples(st.integers(0, 9), st.floats(-1e12, 1e13, allow_nan=False)),
    b=st.tuples(st.integers(0, 9), st.floats(-1e12, 1e13, allow_nan=False)),
)
def test_ready_score_is_priority_first_then_earliest_deadline(
    a: tuple[int, float], b: tuple[int, float]
) -> None:
    """EDF within a priority, whatever the deadline (past, far future): never across priorities."""
    (pa, da), (pb, db) = a, b
    sa, sb = ready_score(pa, da), ready_score(pb, db)
    if pa != pb:
        assert (sa < sb) == (pa > pb)
        return
    if da <= db:
        assert sa <= sb  # monotone in the deadline (clamped at both ends of the band)
    if da >= 0 and db < 1e10 and round(da * 1000) < round(db * 1000):
        assert sa < sb  # and strict to the millisecond for real deadlines


def test_ready_score_rejects_out_of_range_priority() -> None:
    with pytest.raises(ValueError, match="priority"):
        ready_score(10, 0.0)


def test_launch_slots() -> None:
    assert launch_slots(0, 4) == 4
    assert launch_slots(3, 4) == 1
    assert launch_slots(9, 4) == 0


def test_backpressure_hysteresis() -> None:
    bp = Backpressure(max_queued=100, resume_ratio=0.5)
    assert bp.update(99) is False
    assert bp.update(100) is True  # full: pause
    assert bp.update(80) is True  # still above the resume mark
    assert bp.update(50) is True
    assert bp.update(49) is False  # drained: resume
    assert bp.update(99) is False
