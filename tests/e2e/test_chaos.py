"""The short chaos run (``make chaos`` is the full one): 20 batches and 80 malformed records on a
private local stack while one dispatcher replica, one running job's driver, Redis, Kafka, MinIO and
the Ray head are each killed once (kill -9) and brought back; then every promise of
llmbatch.chaos.verdict is checked."""

from __future__ import annotations

import dataclasses

import pytest

from llmbatch.chaos.__main__ import SHORT
from llmbatch.chaos.faults import FAULT_KINDS
from llmbatch.chaos.runner import run

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]


async def test_short_chaos_run_keeps_every_promise() -> None:
    result = await run(dataclasses.replace(SHORT))
    print(result.table())
    print("\n".join(result.fault_log))
    assert result.ok, result.table()
    # every fault happened (a driver fault needs a running job: with 20 batches one always is)
    assert set(result.faults) == set(FAULT_KINDS), result.fault_log
    # at most the two batches whose deadline is 3 s after their send may be refused as passed
    assert result.verdict.figures["accepted"] >= SHORT.batches - 2
