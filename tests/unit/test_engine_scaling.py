"""Deadline demand in the shared engines' autoscaling (ray_job.engines.engine_scaling): more replicas while
requests of batches at risk of their deadline wait, never fewer than Serve's own rule."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from llmbatch.ray_job.engines.engine_scaling import AT_RISK_WAITING, DeadlineAwarePolicy, deadline_replicas

pytestmark = pytest.mark.unit


@example(desired=0.0, current=1, waiting=5e-324, slots=2)  # found by CI: a tiny mean of waiting requests
@example(desired=1.0, current=1, waiting=0.3, slots=256)  # Serve's mean over its window: someone waits
@given(
    desired=st.floats(0, 100),
    current=st.integers(0, 50),
    waiting=st.floats(0, 10_000),
    slots=st.integers(1, 512),
)
def test_never_fewer_than_serves_rule_and_enough_for_what_waits(
    desired: float, current: int, waiting: float, slots: int
) -> None:
    got = deadline_replicas(desired, current, waiting, slots)
    assert got >= desired
    if current > 0 and waiting > 0:
        assert (got - current) * slots >= waiting  # the added replicas run every at-risk request waiting
        assert got == desired or (got - current - 1) * slots < waiting  # and not one replica more
    else:
        assert got == desired


def _context(current: int, ongoing: float, at_risk: dict[str, float]) -> AutoscalingContext:
    config = AutoscalingConfig(min_replicas=1, max_replicas=8, target_ongoing_requests=8, upscale_delay_s=0)
    dep = DeploymentID(name="EngineServer", app_name="llmbatch-engine-m")
    replicas = [ReplicaID(unique_id=f"r{i}", deployment_id=dep) for i in range(current)]
    return AutoscalingContext(
        deployment_id=dep,
        deployment_name=dep.name,
        app_name=dep.app_name,
        current_num_replicas=current,
        target_num_replicas=current,
        running_replicas=replicas,
        total_num_requests=ongoing,
        total_queued_requests=0.0,
        aggregated_metrics={AT_RISK_WAITING: {r: at_risk.get(r.unique_id, 0.0) for r in replicas}},
        raw_metrics={},
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=8,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=1000.0,
        config=config,
    )


def test_the_policy_adds_replicas_for_the_at_risk_requests_waiting_at_serves_replicas() -> None:
    policy = DeadlineAwarePolicy(slots_per_replica=16)
    # 2 replicas, 8 calls in flight: Serve's rule alone says 1 replica (8 per replica is the target)
    calm, _ = policy(_context(2, 8.0, {}))
    assert calm == pytest.approx(1.0)
    # 40 requests of batches at risk wait at the two replicas: 3 replicas more run them at once
    urgent, _ = policy(_context(2, 8.0, {"r0": 30.0, "r1": 10.0}))
    assert urgent == 5
