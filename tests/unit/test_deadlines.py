"""The deadline outlook of a running batch (pure)."""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from llmbatch.schemas.deadlines import URGENT_S, at_risk, finish_in, outlook, urgent


def test_the_rest_takes_as_long_as_the_rate_so_far_says() -> None:
    assert finish_in(25, 100, 10.0) == pytest.approx(30.0)  # 75 left at 2.5/s
    assert finish_in(100, 100, 10.0) == 0.0


@pytest.mark.parametrize(
    ("done", "total", "running_s"), [(0, 100, 5.0), (3, None, 5.0), (3, 0, 5.0), (3, 10, 0.0)]
)
def test_nothing_is_said_before_the_first_answer_or_without_a_total(
    done: int, total: int | None, running_s: float
) -> None:
    assert finish_in(done, total, running_s) is None
    assert not at_risk(done, total, running_s, left_s=0.001)


def test_at_risk_when_the_rest_needs_more_than_is_left() -> None:
    assert at_risk(25, 100, 10.0, left_s=29.0)
    assert not at_risk(25, 100, 10.0, left_s=31.0)
    assert not at_risk(25, 100, 10.0, left_s=None)  # no deadline
    assert not at_risk(100, 100, 10.0, left_s=-5.0)  # done: nothing left to miss


@given(
    done=st.integers(1, 10**6),
    more=st.integers(0, 10**6),
    running_s=st.floats(0.001, 1e6),
    left_s=st.floats(-1e6, 1e7),
)
def test_at_risk_is_exactly_need_over_left(done: int, more: int, running_s: float, left_s: float) -> None:
    need = finish_in(done, done + more, running_s)
    assert need is not None and need >= 0
    assert at_risk(done, done + more, running_s, left_s) == (more > 0 and need > left_s)


def test_urgent_when_near_or_at_risk() -> None:
    assert urgent(0, 100, 0.0, left_s=URGENT_S - 1)  # near: from its first call, before any answer
    assert not urgent(0, 100, 0.0, left_s=URGENT_S + 1)
    assert urgent(25, 100, 1000.0, left_s=URGENT_S + 1)  # far, but 3000 s more at its rate
    assert not urgent(25, 100, 1000.0, left_s=None)


@example(done=1, total=10, started=0.0, deadline=math.inf)
@example(done=1, total=10, started=-math.inf, deadline=-math.inf)  # was at risk, with infinite figures
@example(done=1, total=10, started=math.nan, deadline=math.nan)
@example(done=1, total=438964, started=-4.1e302, deadline=None)  # a finite start, an infinite need
@given(
    done=st.integers(0, 10**6),
    total=st.one_of(st.none(), st.integers(0, 10**6)),
    started=st.one_of(st.none(), st.floats()),
    deadline=st.one_of(st.none(), st.floats()),
)
def test_the_outlook_of_any_stored_times_is_finite_or_unknown(
    done: int, total: int | None, started: float | None, deadline: float | None
) -> None:
    """Times read back from Redis may be anything float() takes (inf, nan): the figures stay finite or
    unknown, and a time that is not finite says nothing."""
    seen = outlook(done, total, started, deadline, now=1_790_000_000.0)
    for figure in (seen.need_s, seen.left_s):
        assert figure is None or math.isfinite(figure)
    if deadline is None or not math.isfinite(deadline):
        assert seen.left_s is None and not seen.at_risk
