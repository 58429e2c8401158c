"""Scheduling rules (pure): launch order, launch slots, and partition backpressure.

Queued batches wait in the Redis ``ready`` zset ordered by :func:`ready_score`: higher priority
first, then older first. At most ``max_in_flight`` batches hold a Ray job at once. The consumer
pauses its partitions while the queue holds ``max_queued`` batches or more and resumes once it has
drained below ``max_queued * resume_ratio`` (hysteresis, so it does not flap).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_PRIORITY = 9
_PRIORITY_STEP = 1e13  # > any unix time in ms until year 2286; 9 * 1e13 + ms stays exact in a double


def ready_score(priority: int, accepted_at: float) -> float:
    """Sort key of a queued batch: ascending score = launch order (priority desc, then age)."""
    if not 0 <= priority <= MAX_PRIORITY:
        raise ValueError(f"priority {priority} outside 0..{MAX_PRIORITY}")
    return (MAX_PRIORITY - priority) * _PRIORITY_STEP + round(accepted_at * 1000)


def launch_slots(in_flight: int, max_in_flight: int) -> int:
    """How many more batches may be launched now."""
    return max(0, max_in_flight - in_flight)


@dataclass
class Backpressure:
    """Hysteresis between pausing and resuming the consumer's partitions."""

    max_queued: int
    resume_ratio: float = 0.8
    paused: bool = False

    @property
    def resume_below(self) -> int:
        return max(0, int(self.max_queued * self.resume_ratio))

    def update(self, queued: int) -> bool:
        """Feed the current queue length; returns whether partitions should be paused now."""
        if self.paused:
            if queued < self.resume_below or queued == 0:
                self.paused = False
        elif queued >= self.max_queued:
            self.paused = True
        return self.paused
