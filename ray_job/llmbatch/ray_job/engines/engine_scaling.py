"""The shared engines' autoscaling: Serve's own rule, and deadline demand on top of it.

Serve scales a model's replicas towards ``target_ongoing_requests`` calls each. That counts calls, not
deadlines: an urgent batch (near its deadline, or behind it at its rate so far) sends its calls with
``due`` (:func:`llmbatch.schemas.deadlines.urgent`), and while such requests wait for a slot at a
replica, more replicas would serve them sooner. Each replica reports its waiting at-risk requests
(:data:`AT_RISK_WAITING`, its ``record_autoscaling_stats``) and :class:`DeadlineAwarePolicy` asks for
enough replicas more to run them at once (:func:`deadline_replicas`), never fewer than Serve's own rule
says. Serve then applies the model's bounds and delays as for its own rule.
"""

from __future__ import annotations

import math
from typing import Any

AT_RISK_WAITING = "llmbatch_at_risk_waiting"
"""The custom autoscaling metric: requests of batches at risk of their deadline waiting for a slot."""

POLICY_PATH = "llmbatch.ray_job.engines.engine_scaling:DeadlineAwarePolicy"


def deadline_replicas(desired: float, current: int, at_risk_waiting: float, slots_per_replica: int) -> float:
    """Replicas for Serve's ``desired`` and the at-risk requests waiting: ``current`` plus enough to run
    those at once (``slots_per_replica`` each), when that is more."""
    if at_risk_waiting <= 0 or current <= 0:
        return desired  # nothing at risk waits; at zero replicas Serve's cold start decides
    # at least one: Serve's figure is a mean over its look-back window (0.3 waiting is someone waiting)
    more = max(1, math.ceil(at_risk_waiting / max(1, slots_per_replica)))
    return max(desired, current + more)


class DeadlineAwarePolicy:
    """A Serve autoscaling policy (``autoscaling_config.policy``): :func:`deadline_replicas` over
    Serve's own queue-length rule. ``slots_per_replica``: the model's ``max_active_requests``."""

    def __init__(self, slots_per_replica: int = 1) -> None:
        self.slots_per_replica = max(1, int(slots_per_replica))

    def __call__(self, ctx: Any) -> tuple[float, dict[str, Any]]:
        from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy

        desired, state = replica_queue_length_autoscaling_policy(ctx)
        reported = (ctx.aggregated_metrics or {}).get(AT_RISK_WAITING) or {}
        waiting = sum(float(v) for v in reported.values())
        return deadline_replicas(desired, ctx.current_num_replicas, waiting, self.slots_per_replica), state
