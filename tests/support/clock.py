"""A clock a test sets by hand (``clock.now = ...``), for code that takes ``clock: Callable[[], float]``."""

from __future__ import annotations


class Clock:
    """Returns :attr:`now` when called."""

    def __init__(self, now: float = 1_790_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
