"""A two-node Ray cluster on this machine: the engines go where the ``llmbatch_engine`` resource is.

A private head (``--resources '{}'``: no ``llmbatch_engine``) and, joined with ``ray start
--address``, a worker node carrying ``{"llmbatch_engine": 2}``, each with its own ports and temp
dir, both stopped by PID. The registry's model asks for ``{"llmbatch_engine": 1}`` per replica
(two replicas) and is deployed the way the dispatcher deploys it (the Serve REST config of
:func:`llmbatch.dispatcher.backends.engines.cluster_serve_config`: the model's engine app plus the batch
runner).

- Before the worker joins, nothing can hold an engine: the runner is RUNNING on the head but the
  engine replicas wait for a node (their actors PENDING_CREATION, asking for ``llmbatch_engine``)
  and a batch fails with ``engine_unavailable``. This is the check that fails when the resource
  does not steer placement (a replica would start on the head) or the test harness is broken.
- Once the worker joins, both replicas start on it (node id from the state API, and their PIDs in
  the worker's process tree), while the runner stays on the head: two batches run on the runner,
  cross-node into the engines, and complete with every ``custom_id`` answered exactly once.

The replicas run the fake engine, to keep the test short (about 1.5-2.5 min on 2 busy cores, most
of it starting Ray and Serve): placement and the batch path do not depend on the backend, and real
vLLM is covered by the slow tests (test_vllm_engine.py, test_ray_job_vllm.py, e2e test_demo.py).
Both nodes run on this machine, so this shows Ray's placement by resource and the cross-node calls,
not networking between machines.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from llmbatch.dispatcher.backends.backend import JobInfo, JobState
from llmbatch.dispatcher.backends.engines import cluster_serve_config, summarize
from llmbatch.dispatcher.backends.runner_backend import RunnerClient
from llmbatch.dispatcher.backends.s3_sessions import SessionMinter
from llmbatch.dispatcher.backends.serve_api import ServeApi
from llmbatch.dispatcher.settings import DispatcherOptions, DispatcherSettings
from llmbatch.ray_job.batch_runner.runner_http import APP_NAME as RUNNER_APP
from llmbatch.ray_job.engines.backends import FAKE_BACKEND
from llmbatch.ray_job.errors import ExitCode
from llmbatch.schemas.common import BatchStatus
from llmbatch.schemas.engines import (
    DEPLOYMENT_NAME,
    EngineModel,
    EngineRegistry,
    ReplicaResources,
    Scaling,
    app_name,
)
from llmbatch.schemas.job import EngineConfig, JobSpec
from llmbatch.settings import RedisSettings, S3Settings
from tests.integration.ray_job_harness import Harness, chat_line
from tests.support.private_ray import PrivateRay, PrivateRayWorker

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"  # the harness's model name; the replicas run the fake engine
ENGINE_RESOURCE = "llmbatch_engine"
REPLICAS = 2
REGISTRY = EngineRegistry(
    models={
        MODEL: EngineModel(
            path="fake",
            engine=EngineConfig(backend=FAKE_BACKEND, backend_options={"delay_s": 0.05}),
            resources=ReplicaResources(num_cpus=0.5, resources={ENGINE_RESOURCE: 1}),
            scaling=Scaling(min_replicas=REPLICAS, max_replicas=REPLICAS, idle_s=60),
        )
    }
)
CLIENT = EngineConfig(backend=FAKE_BACKEND, batch_size=4, batches_in_flight=2)


@dataclass
class Cluster:
    head: PrivateRay
    api: ServeApi
    runner: RunnerClient
    h: Harness
    run_dir: Path

    def details(self) -> dict[str, Any]:
        return asyncio.run(self.api.status())

    def replicas(self, app: str, deployment: str) -> list[dict[str, Any]]:
        apps = self.details().get("applications") or {}
        deployments = (apps.get(app) or {}).get("deployments") or {}
        found: list[dict[str, Any]] = (deployments.get(deployment) or {}).get("replicas") or []
        return found

    def pending_engine_actors(self) -> list[dict[str, Any]]:
        """Actors the scheduler has not placed yet that ask for the engine resource."""
        query = urllib.parse.urlencode(
            {
                "detail": "true",
                "limit": "200",
                "filter_keys": "state",
                "filter_predicates": "=",
                "filter_values": "PENDING_CREATION",
            }
        )
        with urllib.request.urlopen(f"{self.head.address}/api/v0/actors?{query}", timeout=10) as resp:
            actors: list[dict[str, Any]] = json.loads(resp.read())["data"]["result"]["result"]
        return [a for a in actors if ENGINE_RESOURCE in (a.get("required_resources") or {})]


def _wait(what: str, check: Any, timeout: float, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"{what} not within {timeout:.0f} s (last: {last!r})")


@pytest.fixture(scope="module")
def cluster(
    s3_settings: S3Settings, redis_settings: RedisSettings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """The head alone, with the registry and the runner deployed; the runner RUNNING on it."""
    run_dir = tmp_path_factory.mktemp("two-nodes")  # the nodes' `ray start` logs
    head = PrivateRay(run_dir, num_cpus=2, resources={}, s3=s3_settings)  # explicitly no llmbatch_engine
    try:
        started = time.monotonic()
        head.start()
        head_s = time.monotonic() - started
        ray = head.settings()
        h = Harness(s3_settings, ray, redis_settings)
        settings = DispatcherSettings(
            _env_file=None,
            engines=REGISTRY,
            # the runner takes a batch's results only under its identity's prefix in this bucket
            s3=s3_settings.model_copy(update={"results_bucket": h.results_bucket}),
            ray=ray,
            redis=redis_settings,
            dispatcher=DispatcherOptions(shared_engines=True),
        )
        api = ServeApi(head.address, timeout_s=60)
        asyncio.run(api.deploy(cluster_serve_config(settings)))
        client = RunnerClient.of(ray, timeout_s=30, sessions=SessionMinter(s3_settings))
        c = Cluster(head, api, client, h, run_dir)
        _wait(
            "the batch runner RUNNING",
            lambda: (
                ((c.details().get("applications") or {}).get(RUNNER_APP) or {}).get("status") == "RUNNING"
            ),
            180,
        )
        print(
            f"head up in {head_s:.1f} s, Serve config deployed and runner RUNNING "
            f"{time.monotonic() - started - head_s:.1f} s later"
        )
        yield c
    finally:
        stopping = time.monotonic()
        head.stop(timeout=5)  # a throwaway cluster
        head.remove_temp()
        print(f"head stopped in {time.monotonic() - stopping:.1f} s")


@pytest.fixture(scope="module")
def worker(cluster: Cluster) -> Iterator[PrivateRayWorker]:
    """The engine node joins: 1 CPU and ``{"llmbatch_engine": 2}`` (room for both replicas)."""
    node = PrivateRayWorker(
        cluster.head, cluster.run_dir, num_cpus=1, resources={ENGINE_RESOURCE: REPLICAS}, name="engine-node"
    )
    try:
        started = time.monotonic()
        node.start()
        print(f"worker node joined in {time.monotonic() - started:.1f} s")
        yield node
    finally:
        stopping = time.monotonic()
        node.stop()  # before the head (the module's fixtures are torn down in reverse order)
        print(f"worker node stopped in {time.monotonic() - stopping:.1f} s")


def _spec(c: Cluster, name: str, n: int, *, inline: bool, wait_s: float) -> JobSpec:
    lines: list[dict[str, Any] | bytes] = [chat_line(f"{name}-{i}", f"question {i}") for i in range(n)]
    source: dict[str, Any] = (
        {"requests": lines} if inline else {"input_uri": c.h.put_input(f"{name}.jsonl", lines)}
    )
    return c.h.spec(
        name,
        engine=CLIENT,
        engine_app=app_name(MODEL),
        engine_wait_s=wait_s,
        redis_url=c.h.redis.url,
        **source,
    )


def _finish(c: Cluster, spec: JobSpec, timeout: float = 90) -> JobInfo:
    def done() -> JobInfo | None:
        info = asyncio.run(c.runner.status(spec.submission_id))
        assert info is not None, f"the runner forgot {spec.submission_id}"
        return info if info.state.is_terminal else None

    found: JobInfo = _wait(f"{spec.submission_id} finished", done, timeout, interval=0.2)
    return found


def _node_of(c: Cluster, app: str, deployment: str) -> set[str]:
    return {str(r.get("node_id")) for r in c.replicas(app, deployment) if r.get("state") == "RUNNING"}


def test_without_an_engine_node_the_replicas_wait_and_a_batch_fails_unavailable(cluster: Cluster) -> None:
    c = cluster
    alive = [n for n in c.head.nodes() if n["state"] == "ALIVE"]
    assert [n["is_head_node"] for n in alive] == [True], "needs the head alone: run before the worker joins"
    assert ENGINE_RESOURCE not in alive[0]["resources_total"], alive[0]
    # the runner (0.2 CPU) was placed long ago; the engine replicas (0.5 CPU + llmbatch_engine) were
    # deployed at the same time and still have no node, though the head has the CPUs for them
    [row] = summarize(REGISTRY, c.details())
    assert row.status != "RUNNING" and row.running == 0, row
    unplaced = c.replicas(row.app, DEPLOYMENT_NAME)
    assert not any(r.get("pid") or r.get("node_id") for r in unplaced), unplaced
    pending = _wait(
        f"{REPLICAS} engine actors pending",
        lambda: found if len(found := c.pending_engine_actors()) == REPLICAS else None,
        30,
    )
    assert all(a["required_resources"][ENGINE_RESOURCE] == 1 for a in pending), pending
    # a batch on that model cannot complete: it waits engine_wait_s, then fails engine_unavailable
    spec = _spec(c, "twonode-noengine", 3, inline=True, wait_s=3)
    assert not asyncio.run(c.runner.submit(spec)).already_existed
    info = _finish(c, spec, timeout=60)
    assert info.state is JobState.FAILED and info.exit_code == ExitCode.ENGINE_UNAVAILABLE, info
    assert "engine_unavailable" in (info.message or ""), info
    assert summarize(REGISTRY, c.details())[0].running == 0


def test_replicas_run_on_the_engine_node_and_batches_complete(
    cluster: Cluster, worker: PrivateRayWorker
) -> None:
    c = cluster
    [head_node] = [n["node_id"] for n in c.head.nodes() if n["is_head_node"] and n["state"] == "ALIVE"]
    [engine_node] = [n for n in c.head.nodes() if n["node_id"] == worker.node_id]
    assert engine_node["resources_total"][ENGINE_RESOURCE] == REPLICAS, engine_node
    started = time.monotonic()
    row = _wait(
        f"{REPLICAS} engine replicas RUNNING",
        lambda: (
            r
            if (r := summarize(REGISTRY, c.details())[0]).status == "RUNNING" and r.running == REPLICAS
            else None
        ),
        120,
    )
    placed_s = time.monotonic() - started
    replicas = [r for r in c.replicas(row.app, DEPLOYMENT_NAME) if r.get("state") == "RUNNING"]
    # every replica on the worker node: by the cluster's node id and by the processes we started
    assert {r["node_id"] for r in replicas} == {worker.node_id}, replicas
    assert worker.pid is not None
    worker_tree = {p.pid for p in psutil.Process(worker.pid).children(recursive=True)}
    assert {int(r["pid"]) for r in replicas} <= worker_tree, (replicas, worker.pid)
    # the runner stayed on the head: the batches' engine calls cross nodes
    assert _node_of(c, RUNNER_APP, "BatchRunner") == {head_node}
    assert head_node != worker.node_id

    specs = [
        _spec(c, "twonode-file", 12, inline=False, wait_s=60),
        _spec(c, "twonode-inline", 7, inline=True, wait_s=60),
    ]
    ran = time.monotonic()
    for spec in specs:
        assert not asyncio.run(c.runner.submit(spec)).already_existed
    for spec in specs:
        info = _finish(c, spec)
        assert info.state is JobState.SUCCEEDED and info.exit_code == 0, info
    ran_s = time.monotonic() - ran
    for spec, n in zip(specs, (12, 7), strict=True):
        manifest = c.h.manifest(spec)
        assert manifest.status == BatchStatus.COMPLETED, manifest
        assert manifest.request_counts.model_dump() == {"total": n, "completed": n, "failed": 0}
        outputs = c.h.lines(manifest.output_uris)
        name = spec.batch_id.rsplit("-", 1)[0]
        # every custom_id exactly once (a sorted list, not a set: a duplicate would show)
        assert sorted(o["custom_id"] for o in outputs) == sorted(f"{name}-{i}" for i in range(n))
        assert all(o["response"]["body"]["model"] == MODEL for o in outputs)
        assert c.h.lines(manifest.error_uris) == []
    # the same replicas, still on the worker, served both batches
    after = [r for r in c.replicas(row.app, DEPLOYMENT_NAME) if r.get("state") == "RUNNING"]
    assert sorted(int(r["pid"]) for r in after) == sorted(int(r["pid"]) for r in replicas)
    assert {r["node_id"] for r in after} == {worker.node_id}
    print(f"replicas placed {placed_s:.1f} s after the worker joined; two batches in {ran_s:.2f} s")
