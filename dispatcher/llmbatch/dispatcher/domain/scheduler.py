"""Scheduling rules (pure): launch order, launch slots, engine admission and partition backpressure.

Queued batches wait in the Redis ``ready`` zset ordered by :func:`ready_score`: higher priority
first, then the nearest deadline first (EDF; every batch has one: its ``deadline`` or the end of its
completion window, 24 h by default, so batches of one window keep their arrival order). At most
``max_in_flight`` batches are launched at once. With shared engines a batch is launched only when its
model's replicas have room for it, and one that would run as a Ray job only while fewer than
``max_jobs_in_flight`` jobs run (:class:`Admission`).
The consumer pauses its partitions while the queue holds ``max_queued`` batches or more and resumes
once it has drained below ``max_queued * resume_ratio`` (hysteresis, so it does not flap).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

MAX_PRIORITY = 9
_PRIORITY_STEP = 1e13  # > any unix time in ms until year 2286; 9 * 1e13 + ms stays exact in a double


def ready_score(priority: int, deadline: float) -> float:
    """Sort key of a queued batch: ascending score = launch order (priority desc, then the earliest
    ``deadline``, unix seconds). A deadline past year 2286 sorts as that year: never into the next
    priority."""
    if not 0 <= priority <= MAX_PRIORITY:
        raise ValueError(f"priority {priority} outside 0..{MAX_PRIORITY}")
    due_ms = min(max(round(deadline * 1000), 0), int(_PRIORITY_STEP) - 1)
    return (MAX_PRIORITY - priority) * _PRIORITY_STEP + due_ms


def launch_slots(in_flight: int, max_in_flight: int) -> int:
    """How many more batches may be launched now."""
    return max(0, max_in_flight - in_flight)


def window_requests(total: int | None, done: int, window: int) -> int:
    """Requests a launched batch can have at its model's replicas at once: its window
    (:attr:`~llmbatch.schemas.engines.EngineModel.batch_window`), or what it has left when that is
    less. ``total`` is ``None`` for a file batch whose job has not counted its lines yet (it counts as
    a full window)."""
    if total is None or total <= 0:
        return window
    return max(0, min(window, total - done))


def short_path_fits(
    *, pooled: bool, lines: int | None, input_size: int | None, max_lines: int, max_bytes: int
) -> bool:
    """Whether a shared-engine batch runs on the batch runner (the short path) rather than as a Ray job:
    at most ``max_lines`` inline ``lines``, or an input file of at most ``max_bytes`` (``input_size``
    ``None``: unknown, a job). Never a pooled tenant's batch; never when ``max_lines`` is 0 (off)."""
    if max_lines <= 0 or pooled:
        return False
    if lines is not None:
        return lines <= max_lines
    return input_size is not None and input_size <= max_bytes


def engine_capacity(
    requests_per_replica: int, *, live_replicas: int | None, min_replicas: int, max_replicas: int
) -> int:
    """Requests a model's replicas take: ``requests_per_replica`` for each replica that runs (at
    least one, so a model scaled to zero is started by its first batch; at most ``max_replicas``)."""
    replicas = max(1, min_replicas, live_replicas or 0)
    return requests_per_replica * min(replicas, max(1, max_replicas))


@dataclass(frozen=True)
class EngineLoad:
    """One launched batch's requests at its model's replicas."""

    model: str
    priority: int
    requests: int
    tenant: str = "default"


@dataclass
class Admission:
    """Which queued batches the shared engines can take now, asked in launch order.

    A batch of priority ``p`` competes only with launched work of priority ``>= p`` (the replicas
    run higher priorities first and take lower-priority requests back), so it is admitted when that
    work plus its own window fits the model's capacity, or when nothing of its rank runs (a batch
    bigger than the capacity still runs, alone), or when nothing of its tenant and rank runs there (a
    tenant that comes while another fills the engines gets its batch in at once: the replicas share
    between tenants, :mod:`llmbatch.ray_job.engines.fair_queue`). The first batch of a model that does not fit
    holds back the model's later ones (no overtaking within a model: a big batch is not starved by small
    ones) but a tenant's first; other models go on.
    """

    capacity: Mapping[str, int]
    load: list[EngineLoad] = field(default_factory=list)
    blocked: set[str] = field(default_factory=set)
    job_slots: int | None = None
    """Batches that may still start as Ray jobs (``None``: no limit). A job-path batch without a slot
    waits without holding back its model's other batches (a small batch still takes the short path)."""

    @classmethod
    def of(
        cls, capacity: Mapping[str, int], load: Iterable[EngineLoad], job_slots: int | None = None
    ) -> Admission:
        return cls(dict(capacity), list(load), job_slots=job_slots)

    def ahead(self, model: str, priority: int) -> int:
        """Requests of launched batches of ``model`` that run before or beside a ``priority`` batch."""
        return sum(x.requests for x in self.load if x.model == model and x.priority >= priority)

    def admit(
        self, model: str, priority: int, requests: int, *, job: bool = False, tenant: str = "default"
    ) -> bool:
        """Whether to launch ``tenant``'s batch now (``job``: it would run as a Ray job); an admitted
        batch joins the load and takes a job slot."""
        ahead = self.ahead(model, priority)
        # the tenant's first of its rank beside other tenants' work (alone, a tenant is as any batch)
        first = ahead > 0 and not any(
            x.model == model and x.priority >= priority and x.tenant == tenant for x in self.load
        )
        if model in self.blocked and not first:
            return False
        if ahead and ahead + requests > self.capacity.get(model, 0) and not first:
            self.blocked.add(model)
            return False
        if job and self.job_slots is not None:
            if self.job_slots <= 0:
                return False
            self.job_slots -= 1
        self.load.append(EngineLoad(model, priority, requests, tenant))
        return True

    def requests(self, model: str) -> int:
        """Requests of every launched batch of ``model`` (a gauge)."""
        return self.ahead(model, 0)


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
