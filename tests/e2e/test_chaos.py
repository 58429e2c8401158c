"""The short chaos run (``make chaos`` is the full one): 20 batches and 80 malformed records on a
private local stack while one dispatcher replica, one running job's driver (or, on the shared engines,
the batch runner's replica), Redis, Kafka, MinIO and the Ray head are each killed once (kill -9) and
brought back; then every promise of llmbatch.chaos.verdict is checked. Once per engine path: a Ray job
per batch, and the shared engines (the default)."""

from __future__ import annotations

import dataclasses

import pytest

from llmbatch.chaos.__main__ import SHORT
from llmbatch.chaos.faults import default_faults
from llmbatch.chaos.runner import run

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]


@pytest.mark.parametrize("shared_engines", [False, True], ids=["ray-job-per-batch", "shared-engines"])
async def test_short_chaos_run_keeps_every_promise(shared_engines: bool) -> None:
    result = await run(dataclasses.replace(SHORT, shared_engines=shared_engines))
    print(result.table())
    print("\n".join(result.fault_log))
    assert result.ok, result.table()
    # every fault happened (a driver fault needs a running job, a runner fault its replica: with 20
    # batches there always is one)
    assert set(result.faults) == set(default_faults(shared_engines)), result.fault_log
    # at most the two batches whose deadline is 3 s after their send may be refused as passed
    assert result.verdict.figures["accepted"] >= SHORT.batches - 2
