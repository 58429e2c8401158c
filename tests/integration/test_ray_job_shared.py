"""Batches on the shared engine: the real ray_job pipeline (MinIO, Redis, Ray Data, Ray Serve) with
``spec.engine_app`` set, the fake engine inside the Serve replica. No batch starts an engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
from ray.job_submission import JobStatus

from llmbatch.dispatcher.backends.engines import replica_pids, serve_config, summarize
from llmbatch.dispatcher.backends.serve_api import ServeApi
from llmbatch.ray_job.engines.backends import FAKE_BACKEND
from llmbatch.schemas.common import BatchStatus
from llmbatch.schemas.engines import EngineModel, EngineRegistry, ReplicaResources, Scaling, app_name
from llmbatch.schemas.job import EngineConfig
from llmbatch.settings import RaySettings, RedisSettings, S3Settings
from tests.integration.ray_job_harness import Harness, chat_line

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"  # the harness's model name; the replica runs the fake engine
REGISTRY = EngineRegistry(
    models={
        MODEL: EngineModel(
            path="fake",
            engine=EngineConfig(
                backend=FAKE_BACKEND, backend_options={"delay_s": 0.3, "fail_custom_ids": ["boom"]}
            ),
            resources=ReplicaResources(num_cpus=0.25),
            scaling=Scaling(min_replicas=1, max_replicas=1, idle_s=60),
        )
    }
)
# the job side's engine config: only the prompt stage's tokenizer choice matters with a shared engine
CLIENT = EngineConfig(backend=FAKE_BACKEND, batch_size=4, batches_in_flight=2, num_cpus_per_replica=0.25)


@pytest.fixture(scope="module")
def h(s3_settings: S3Settings, ray_settings: RaySettings, redis_settings: RedisSettings) -> Harness:
    return Harness(s3_settings, ray_settings, redis_settings)


@pytest.fixture(scope="module")
def serve(ray_settings: RaySettings) -> Iterator[ServeApi]:
    api = ServeApi(ray_settings.address, timeout_s=60)
    asyncio.run(api.deploy(serve_config(REGISTRY, http_address=ray_settings.serve_address)))
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        row = summarize(REGISTRY, asyncio.run(api.status()))[0]
        if row.status == "RUNNING" and row.running == 1:
            break
        time.sleep(1)
    else:
        raise AssertionError(f"engine app not running: {row}")
    yield api
    asyncio.run(api.deploy({"applications": []}))


def test_two_batches_at_once_on_one_shared_engine(h: Harness, serve: ServeApi) -> None:
    [replica] = replica_pids(asyncio.run(serve.status()), MODEL)
    specs = []
    for name, n in (("shared-a", 10), ("shared-b", 6)):
        lines: list[dict[str, Any] | bytes] = [chat_line(f"{name}-{i}", f"question {i}") for i in range(n)]
        lines.append(chat_line("boom", "the engine fails this one"))
        specs.append(
            h.spec(
                name,
                input_uri=h.put_input(f"{name}.jsonl", lines),
                engine=CLIENT,
                engine_app=app_name(MODEL),
                engine_wait_s=120,
            )
        )
    sids = [h.submit(spec) for spec in specs]
    for sid in sids:
        assert h.wait(sid) == JobStatus.SUCCEEDED, h.logs_tail(sid)
    for spec, n in zip(specs, (10, 6), strict=True):
        manifest = h.manifest(spec)
        assert manifest.status == BatchStatus.COMPLETED
        assert manifest.request_counts.model_dump() == {"total": n + 1, "completed": n, "failed": 1}
        outputs = h.lines(manifest.output_uris)
        name = spec.batch_id.rsplit("-", 1)[0]
        assert sorted(o["custom_id"] for o in outputs) == sorted(f"{name}-{i}" for i in range(n))
        assert all(o["response"]["body"]["model"] == MODEL for o in outputs)
        [error] = h.lines(manifest.error_uris)
        assert error["custom_id"] == "boom" and error["error"]["code"] == "engine_error"
        # the batch waited for no engine start: the replica was warm
        assert manifest.timings.engine_start_s is not None and manifest.timings.engine_start_s < 60
    # both ran on the replica that was already there; no batch started an engine
    assert replica_pids(asyncio.run(serve.status()), MODEL) == [replica]
    # each job reserved its stages at once: one placement group, every stage actor inside it
    groups = {g["name"]: g for g in h.state("placement_groups")}
    actors = h.state("actors")
    for spec in specs:
        group = groups[f"llmbatch-{spec.submission_id}"]
        assert [b["unit_resources"] for b in group["bundles"]] == [{"CPU": 0.4}]
        stages = [
            a
            for a in actors
            if a["job_id"] == group["creator_job_id"] and str(a["class_name"]).startswith("MapWorker")
        ]
        assert {a["class_name"] for a in stages} >= {"MapWorker(MapBatches(EngineStage))"}, stages
        assert {a["placement_group_id"] for a in stages} == {group["placement_group_id"]}, stages


def test_no_engine_for_the_model_fails_the_attempt_with_engine_unavailable(h: Harness) -> None:
    spec = h.spec(
        "shared-none",
        requests=[chat_line("x", "hello")],
        engine=CLIENT,
        engine_app=app_name("model-nobody-deployed"),
        engine_wait_s=15,
    )
    status, result = h.run(spec, timeout=300)
    assert status == JobStatus.FAILED
    assert result["error"]["code"] == "engine_unavailable", result["error"]
