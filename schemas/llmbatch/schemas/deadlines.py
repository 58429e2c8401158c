"""Whether a running batch makes its deadline at its rate so far (pure; the dispatcher's metric and
``jobs get``, and the batch runner's calls to the shared engines, judge alike).

A batch that finished ``done`` of its ``total`` requests in ``running_s`` seconds needs
``(total - done) * running_s / done`` more at that rate. It is **at risk** when that is more than the
time left before its deadline. Nothing can be said before its first request finished or while its
total is unknown (a file whose lines are not counted yet): such a batch is not called at risk.

A batch is **urgent** on the shared engines (its requests go before the turns of its priority) when it
is at risk, or when its deadline is less than :data:`URGENT_S` away: a batch sends its first calls
before any answer can say how fast it goes, and a tight deadline can pass within them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEADLINE_EXCEEDED = "deadline_exceeded"
"""The error code of an attempt stopped early because its deadline passed (on its node's clock), and of
a batch that expired."""
URGENT_S = 600.0
"""A batch whose deadline is this close is urgent whatever its rate (see the module docstring)."""


def finish_in(done: int, total: int | None, running_s: float) -> float | None:
    """Seconds the rest of the batch needs at its rate so far; ``None`` when that cannot be said yet."""
    if total is None or total <= 0 or done <= 0 or running_s <= 0:
        return None
    need = max(total - done, 0) * running_s / done
    return need if math.isfinite(need) else None  # a start time read back absurdly far in the past


def at_risk(done: int, total: int | None, running_s: float, left_s: float | None) -> bool:
    """Whether at its rate so far the batch ends after its deadline, ``left_s`` from now (``None``: it
    has none)."""
    if left_s is None:
        return False
    need = finish_in(done, total, running_s)
    return need is not None and need > 0 and need > left_s


def urgent(done: int, total: int | None, running_s: float, left_s: float | None) -> bool:
    """Whether the batch's requests go first on the shared engines: its deadline is less than
    :data:`URGENT_S` away, or it is :func:`at_risk`."""
    if left_s is None:
        return False
    return left_s < URGENT_S or at_risk(done, total, running_s, left_s)


@dataclass(frozen=True)
class Outlook:
    """A running batch's outlook at ``now``: seconds its rest needs at its rate since it first started
    (``None``: not known yet), seconds to its deadline (``None``: none), and whether it is at risk."""

    need_s: float | None
    left_s: float | None
    at_risk: bool


def outlook(
    done: int, total: int | None, started_at: float | None, deadline: float | None, now: float
) -> Outlook:
    """:class:`Outlook` of a batch that answered ``done`` of ``total`` since ``started_at`` (unix seconds;
    ``None``: not started), due at ``deadline``. A time that is not a finite number (state read back
    from storage is not trusted) counts as unknown."""
    started_at = started_at if started_at is not None and math.isfinite(started_at) else None
    deadline = deadline if deadline is not None and math.isfinite(deadline) else None
    running_s = now - started_at if started_at is not None else 0.0
    left_s = deadline - now if deadline is not None else None
    return Outlook(finish_in(done, total, running_s), left_s, at_risk(done, total, running_s, left_s))
