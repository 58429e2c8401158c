"""The job's reservation: one placement group that holds what every stage of its pipeline asks for,
taken before the pipeline starts (gang scheduling, Ray's own facility for it).

Without it, jobs that share a cluster each start their reader, prompt and client stages one by one:
eight jobs started together on a 2-CPU head held every free CPU with parts of their pipelines, none
had all of its stages, and none made progress (measured: 0 of 320 lines done after 4 minutes).
With it, a job either has all of its stages' resources or waits in its driver holding none; on an
autoscaling cluster the waiting reservation asks the autoscaler for a node.

Only jobs on a shared engine reserve: their stages are all light (a tenth of a CPU each). A job
with an engine of its own keeps its engine actors outside (they need whole CPUs or GPUs, possibly
on several nodes), and the dispatcher admits few of those at a time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from llmbatch.ray_job.errors import ClusterBusyError
from llmbatch.schemas.job import JobSpec

log = logging.getLogger(__name__)

WAIT_SLICE_S = 5.0
"""Longest blocking call while the driver waits (its signal handlers run between calls)."""


def bundle_of(requests: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """One placement-group bundle holding every task and actor slot in ``requests`` (each the Ray
    resources of one slot, as :meth:`llmbatch.schemas.job.JobSpec.stage_resources` gives them)."""
    bundle: dict[str, float] = {}
    for request in requests:
        cpus = float(request.get("num_cpus") or 0)
        if cpus:
            bundle["CPU"] = bundle.get("CPU", 0.0) + cpus
        for name, amount in (request.get("resources") or {}).items():
            bundle[name] = bundle.get(name, 0.0) + float(amount)
    # Ray rounds resources to 1/10000: keep the sum exact enough that each slot still fits
    return {name: round(amount, 4) for name, amount in bundle.items() if amount > 0}


class Reservation:
    """A placement group for one attempt's stages (see the module docstring)."""

    def __init__(self, spec: JobSpec, bundle: Mapping[str, float]) -> None:
        from ray.util import placement_group

        self.bundle = dict(bundle)
        self.group = placement_group([self.bundle], strategy="PACK", name=f"llmbatch-{spec.submission_id}")

    def wait(self, timeout_s: float) -> float:
        """Block until the cluster holds the reservation; returns the seconds waited. Waits in slices,
        so the driver's stop signals (cancel, deadline) take effect meanwhile. Raises
        :class:`ClusterBusyError` after ``timeout_s`` (the attempt is retried later)."""
        started = time.monotonic()
        said = False
        while not self.group.wait(timeout_seconds=min(WAIT_SLICE_S, timeout_s)):
            waited = time.monotonic() - started
            if waited >= timeout_s:
                self.release()
                raise ClusterBusyError(
                    f"the cluster did not free {self.bundle} for this job's stages within {timeout_s:.0f} s"
                )
            if not said:
                log.info("waiting for the cluster to free %s for this job's stages", self.bundle)
                said = True
        return time.monotonic() - started

    def remote_args(self) -> dict[str, Any]:
        """What each stage adds to its Ray remote args to run inside the reservation."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.group, placement_group_capture_child_tasks=True
            )
        }

    def release(self) -> None:
        """Give the resources back (the driver's exit does too: the group belongs to its job)."""
        from ray.util import remove_placement_group

        try:
            remove_placement_group(self.group)
        except Exception as exc:  # the head is gone: the group went with it
            log.debug("could not remove the placement group: %s", exc)
