"""A shared-engine job's reservation (pure parts): the one bundle that holds every slot of its
pipeline, for a job on the shared CPUs and for a pooled tenant's, and how running out of time ends
the attempt. The reservation on a real Ray head: tests/integration/test_ray_job_shared.py."""

from __future__ import annotations

from typing import Any

import pytest

from llmbatch.ray_job.engines.backends import FAKE_BACKEND
from llmbatch.ray_job.errors import ClusterBusyError, ExitCode, JobError
from llmbatch.ray_job.job import pipeline
from llmbatch.ray_job.job.outcome import failure_code
from llmbatch.ray_job.job.reservation import bundle_of
from llmbatch.schemas.job import POOL_SHARE, EngineConfig, JobSpec, tenant_pool_resource

pytestmark = pytest.mark.unit


def _spec(**kw: Any) -> JobSpec:
    data: dict[str, Any] = {
        "batch_id": "b",
        "attempt": 1,
        "endpoint": "/v1/chat/completions",
        "model": "m",
        "input_uri": "s3://inputs/acme/x.jsonl",
        "output_prefix": "s3://results/acme/b/",
        "tenant": "acme",
        "engine_app": "llmbatch-engine-m",
        "engine": EngineConfig(backend=FAKE_BACKEND),
    }
    data.update(kw)
    return JobSpec.model_validate(data)


def test_the_bundle_sums_cpus_and_custom_resources_of_every_slot() -> None:
    assert bundle_of([{"num_cpus": 0.1}, {"num_cpus": 0.25}, {"num_cpus": 0}]) == {"CPU": 0.35}
    pooled = [{"num_cpus": 0, "resources": {"pool": 0.1}}, {"num_cpus": 0, "resources": {"pool": 0.01}}]
    assert bundle_of(pooled) == {"pool": 0.11}
    # float sums do not leave a bundle a hair short of its slots (Ray counts in 1/10000)
    assert bundle_of([{"num_cpus": 0.1}] * 3) == {"CPU": 0.3}
    assert bundle_of([]) == {}


def test_a_shared_engine_job_reserves_its_reader_prompt_actors_repartition_and_client() -> None:
    one = _spec()
    assert bundle_of(pipeline.stage_requests(one)) == {"CPU": 0.4}
    # more prompt actors, more slots (the pool stops at 4)
    three = _spec(engine=EngineConfig(backend=FAKE_BACKEND, replicas=3))
    assert len(pipeline.stage_requests(three)) == 3 + 3
    assert bundle_of(pipeline.stage_requests(three)) == {"CPU": 0.6}
    many = _spec(engine=EngineConfig(backend=FAKE_BACKEND, replicas=9))
    assert len(pipeline.stage_requests(many)) == 3 + 4


def test_a_pooled_tenants_reservation_asks_its_pool_not_the_shared_cpus() -> None:
    spec = _spec(pool_resource=tenant_pool_resource("acme"))
    bundle = bundle_of(pipeline.stage_requests(spec))
    assert set(bundle) == {tenant_pool_resource("acme")}
    assert bundle[tenant_pool_resource("acme")] == pytest.approx(4 * max(0.1, POOL_SHARE))


def test_a_job_the_cluster_cannot_reserve_for_ends_retriable_with_its_own_code() -> None:
    exc = ClusterBusyError("the cluster did not free {'CPU': 0.4} within 1800 s")
    assert isinstance(exc, JobError) and exc.exit_code is ExitCode.RETRIABLE
    assert failure_code(exc) == "cluster_busy"
