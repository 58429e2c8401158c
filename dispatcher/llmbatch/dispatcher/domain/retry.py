"""Retry/backoff policies (pure). One for Ray job attempts, one for transient I/O errors."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff ``base * 2**(n-1)`` capped at ``maximum``, with proportional jitter.

    ``jitter=0.2`` spreads each delay uniformly over ``[d*(1-0.2), d]`` so replicas retrying the same
    outage do not stampede; ``jitter=0`` is deterministic.
    """

    base_s: float = 1.0
    maximum_s: float = 60.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.base_s <= 0 or self.maximum_s < self.base_s:
            raise ValueError("backoff needs 0 < base_s <= maximum_s")
        if not 0.0 <= self.jitter < 1.0:
            raise ValueError("jitter must be in [0, 1)")

    def delay(self, failures: int, rand: Callable[[], float] = random.random) -> float:
        """Delay before the next try after ``failures`` consecutive failures (>= 1)."""
        if failures < 1:
            return 0.0
        raw = min(self.maximum_s, self.base_s * 2.0 ** min(failures - 1, 62))
        return raw * (1.0 - self.jitter * rand())


@dataclass(frozen=True)
class AttemptDecision:
    retry: bool
    delay_s: float
    reason: str


@dataclass(frozen=True)
class AttemptPolicy:
    """How many Ray job attempts a batch gets and how long to wait between them."""

    max_attempts: int = 3
    backoff: Backoff = Backoff(base_s=5.0, maximum_s=300.0)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")

    def after_failure(
        self, attempt: int, *, retriable: bool, rand: Callable[[], float] = random.random
    ) -> AttemptDecision:
        """Decide what follows the failure of attempt number ``attempt`` (1-based)."""
        if not retriable:
            return AttemptDecision(False, 0.0, "non_retriable")
        if attempt >= self.max_attempts:
            return AttemptDecision(False, 0.0, "attempts_exhausted")
        return AttemptDecision(True, self.backoff.delay(attempt, rand), "retry")
