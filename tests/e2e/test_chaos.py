"""The short chaos run (``make chaos`` is the full one): batches and malformed records on a private
local stack while the faults of the run are each injected once (kill -9, then the service is brought
back); then every promise of llmbatch.chaos.verdict is checked. Once per engine path:

* the shared engines (the default): 20 batches, 80 malformed records on a three-broker Kafka; one
  dispatcher replica, the batch runner's replica, Redis, MinIO, the Ray head and the broker leading a
  partition are killed; the tracker's leader and the runner's replicas frozen for 10 s; Redis cut off
  and MinIO resetting every connection for 10 s; Redis brought back from a copy 10 s old; the batch
  runner's clock two minutes ahead;
* a Ray job per batch: 8 batches, 20 malformed records; one dispatcher replica, one running job's
  driver and the Ray head are killed; the jobs' clock two minutes ahead. Redis, Kafka and MinIO
  outages meet the same intake, tracker and publisher on both paths and are left to the shared run:
  each batch here costs a Ray job start
  (40-50 s on 2 cores), and the 20-batch run with every fault took 535 s of the suite's 90 minutes.
  ``make chaos`` runs all of them on 200 batches.
"""

from __future__ import annotations

import dataclasses

import pytest

from llmbatch.chaos.__main__ import SHORT
from llmbatch.chaos.faults import default_faults
from llmbatch.chaos.runner import ChaosConfig, run

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

SHARED_ENGINES = dataclasses.replace(SHORT, shared_engines=True)
RAY_JOB_PER_BATCH = dataclasses.replace(
    SHORT,
    shared_engines=False,
    batches=8,
    malformed=20,
    faults=("dispatcher", "driver", "ray"),
)


@pytest.mark.parametrize(
    "config", [RAY_JOB_PER_BATCH, SHARED_ENGINES], ids=["ray-job-per-batch", "shared-engines"]
)
async def test_short_chaos_run_keeps_every_promise(config: ChaosConfig) -> None:
    result = await run(dataclasses.replace(config))
    print(result.table())
    print("\n".join(result.fault_log))
    assert result.ok, result.table()
    # every fault happened (a driver fault needs a running job, a runner fault its replica: the
    # batches are sent over 30 s and each runs for longer, so there always is one)
    expected = config.faults or default_faults(config.shared_engines, kafka_brokers=config.kafka_brokers)
    assert set(result.faults) == set(expected), result.fault_log
    # the jobs (or the runner) ran with the skewed clock: their manifests' finish times lie ahead of
    # the dispatcher's terminal events by the offset, less the dispatcher's lag
    assert result.job_clock_ahead_s is not None
    assert result.job_clock_ahead_s > config.job_clock_offset_s / 2, result.table()
    # at most the two batches whose deadline is 3 s after their send may be refused as passed
    assert result.verdict.figures["accepted"] >= config.batches - 2
