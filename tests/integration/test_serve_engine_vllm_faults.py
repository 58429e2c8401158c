"""A shared REAL vLLM engine (CPU build, SmolLM2-135M-Instruct) losing its replica mid-batch.

The model's engine is deployed as the dispatcher deploys it (Serve REST config of
:mod:`llmbatch.ray_job.engines.serve_engine`), a batch runs on it as a real batch does (a Ray job of
:mod:`llmbatch.ray_job.job.main` with ``engine_app``, outputs in MinIO), and the replica's process is
SIGKILLed while the batch's calls are on its engine. The calls in flight are sent again and
answered by the replacement replica: the batch completes with every custom_id exactly once.

vLLM runs its EngineCore (and on CPU a VLLM::Worker under it) in child processes of the replica (on
a GPU, or on CPU with ``VLLM_ENABLE_V1_MULTIPROCESSING=1``, which this test sets: the project's CPU
engines run inside the replica's process); a SIGKILL gives the replica no chance to stop them, so
the test also checks that the victim's engine processes do not outlive it, and that removing the
application leaves none behind either. What
ends them is Ray's per-worker process-group cleanup (``RAY_process_group_cleanup_enabled``, on by
default in Ray 2.60: the raylet signals a crashed worker's process group); with it off, they
keep running and this test fails.

Two engine starts (the replica and its replacement), 50-130 s each on these 2 cores.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psutil
import pytest
from ray.job_submission import JobStatus

from llmbatch.dispatcher.backends.engines import replica_pids, serve_config
from llmbatch.dispatcher.backends.serve_api import ServeApi
from llmbatch.schemas.common import BatchStatus
from llmbatch.schemas.engines import EngineModel, EngineRegistry, ReplicaResources, Scaling, app_name
from llmbatch.schemas.job import EngineConfig
from llmbatch.settings import RaySettings, RedisSettings, S3Settings
from llmbatch.stack.model import ensure_model
from tests.integration.ray_job_harness import Harness, chat_line, engine_vars

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(2400)]

MODEL = "SmolLM2-135M-Instruct"
ENGINE: dict[str, Any] = {
    "backend": "vllm",
    "enforce_eager": True,
    "dtype": "auto",
    "max_model_len": 1024,
    "num_cpus_per_replica": 1.0,
    # 4 calls of 4 requests on the engine at once: the kill always finds calls in flight
    "batch_size": 4,
    "batches_in_flight": 4,
}
# the kill waits for the first output shard (4 lines); at 36 lines the batch's last calls could end
# before the kill on a fast run (seen once: every call answered, none lost), so the batch is long
# enough to leave several waves of 4 calls after it
LINES = 72
# short answers: how many waves of calls follow the kill is set by LINES, not by the answers' length
# (a wave of 4 calls of 4 takes seconds at 12 tokens on these cores, against 0.2 s between checks)
MAX_TOKENS = 12
# how long the victim's engine processes may take to go once the replacement serves
ORPHAN_WAIT_S = 60.0


@dataclass(frozen=True)
class Proc:
    """A process found under a replica (pid + start time: a reused pid is another process)."""

    pid: int
    created: float
    cmdline: str

    def alive(self) -> bool:
        try:
            proc = psutil.Process(self.pid)
            return proc.create_time() == self.created and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False


def descendants(pid: int) -> list[Proc]:
    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            found.append(Proc(child.pid, child.create_time(), " ".join(child.cmdline()) or child.name()))
        except psutil.NoSuchProcess:
            continue
    return found


def wait_gone(procs: list[Proc], timeout: float) -> list[Proc]:
    """The processes of ``procs`` still alive after up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while (alive := [p for p in procs if p.alive()]) and time.monotonic() < deadline:
        time.sleep(1)
    return alive


@pytest.fixture(scope="module")
def found() -> Iterator[list[Proc]]:
    """Every engine process the test saw; whichever still runs at the end is killed (by pid)."""
    procs: list[Proc] = []
    yield procs
    for proc in procs:
        if proc.alive():
            os.kill(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def serve(ray_settings: RaySettings, found: list[Proc]) -> Iterator[ServeApi]:
    api = ServeApi(ray_settings.address, timeout_s=120)
    yield api
    _remove(api, ray_settings)


def _remove(api: ServeApi, ray_settings: RaySettings, timeout: float = 180) -> None:
    """Deploy no engine (with the same HTTP options as every deploy of this cluster: Serve keeps
    the first ones) and wait until the model's application is gone."""
    asyncio.run(api.deploy(serve_config(EngineRegistry(models={}), http_address=ray_settings.serve_address)))
    deadline = time.monotonic() + timeout
    while app_name(MODEL) in (asyncio.run(api.status()).get("applications") or {}):
        assert time.monotonic() < deadline, f"{app_name(MODEL)} was not removed"
        time.sleep(1)


def _wait_replica(api: ServeApi, *, other_than: int | None = None, timeout: float = 900) -> int:
    """The pid of the model's one running replica (one that is not ``other_than``)."""
    deadline = time.monotonic() + timeout
    while True:
        details = asyncio.run(api.status())
        app = (details.get("applications") or {}).get(app_name(MODEL)) or {}
        assert app.get("status") != "DEPLOY_FAILED", app
        pids = [p for p in replica_pids(details, MODEL) if p != other_than]
        if app.get("status") == "RUNNING" and len(pids) == 1:
            return pids[0]
        assert time.monotonic() < deadline, f"no running replica of the engine: {app}"
        time.sleep(1)


def _engine_procs(replica: int) -> list[Proc]:
    procs = descendants(replica)
    assert any("EngineCore" in p.cmdline for p in procs), (replica, procs)
    return procs


def test_a_killed_vllm_replica_is_replaced_and_the_batch_completes_once(
    s3_settings: S3Settings,
    ray_settings: RaySettings,
    redis_settings: RedisSettings,
    serve: ServeApi,
    found: list[Proc],
) -> None:
    h = Harness(s3_settings, ray_settings, redis_settings)
    model_path = str(ensure_model())
    registry = EngineRegistry(
        models={
            MODEL: EngineModel(
                path=model_path,
                engine=EngineConfig(**ENGINE),
                # a small reservation, so the job's stages fit beside it on the 2-CPU head
                resources=ReplicaResources(num_cpus=0.25),
                scaling=Scaling(min_replicas=1, max_replicas=1, idle_s=3600),
                # 8 at once: a batch alone keeps twice that, 4 calls of 4 (call_rows), so the kill
                # finds calls in flight and waves of them after it
                max_active_requests=8,
            )
        }
    )
    # vLLM's own engine processes (a CPU engine runs in its replica's process by default, see
    # ray_job.engines.engine_env; a GPU engine or a pinned CPU one keeps an EngineCore process): the case
    # in which a SIGKILLed replica could leave processes behind
    env = {**engine_vars(), "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    asyncio.run(serve.deploy(serve_config(registry, env, http_address=ray_settings.serve_address)))
    victim = _wait_replica(serve)
    victim_procs = _engine_procs(victim)
    found.extend(victim_procs)

    uri = h.put_input(
        "faults.jsonl",
        [
            chat_line(
                f"k{i:02d}", f"Tell me a fact about the number {i}.", max_tokens=MAX_TOKENS, temperature=0.0
            )
            for i in range(LINES)
        ],
    )
    spec = h.spec(
        "vllm-kill",
        input_uri=uri,
        model_path=model_path,
        engine=EngineConfig(**ENGINE),
        shard_max_lines=4,
        engine_app=app_name(MODEL),
        engine_wait_s=900,
    )
    sid = h.submit(spec)
    # the first answers are written: the engine is busy with the batch's next calls
    deadline = time.monotonic() + 900
    while not any("/output-a1-" in o for o in h.objects(spec)):
        assert time.monotonic() < deadline, h.logs_tail(sid)
        assert not h.client.get_job_status(sid).is_terminal(), h.logs_tail(sid)
        time.sleep(0.2)
    os.kill(victim, signal.SIGKILL)
    written_at_kill = len([o for o in h.objects(spec) if "/output-a1-" in o])

    status = h.wait(sid, timeout=1800)
    assert status == JobStatus.SUCCEEDED, h.logs_tail(sid)
    logs = h.client.get_job_logs(sid)
    # calls were on the victim when it died, and were sent again
    assert "lost during a call" in logs, logs[-6000:]
    manifest = h.manifest(spec)
    assert manifest.status == BatchStatus.COMPLETED
    assert manifest.request_counts.model_dump() == {"total": LINES, "completed": LINES, "failed": 0}
    assert manifest.error_uris == []
    outputs = h.lines(manifest.output_uris)
    assert Counter(o["custom_id"] for o in outputs) == Counter({f"k{i:02d}": 1 for i in range(LINES)})
    assert all(o["response"]["body"]["choices"][0]["message"]["content"].strip() for o in outputs)
    assert written_at_kill < len(manifest.output_shards), (written_at_kill, manifest.output_shards)

    # a new replica took the victim's place, and the victim's engine did not outlive it
    replacement = _wait_replica(serve, other_than=victim)
    assert replacement != victim
    replacement_procs = _engine_procs(replacement)
    found.extend(replacement_procs)
    orphans = wait_gone(victim_procs, ORPHAN_WAIT_S)
    assert not orphans, f"the killed replica's engine processes still run: {orphans}"

    # removing the application stops the replacement's engine as well
    _remove(serve, ray_settings)
    left = wait_gone(replacement_procs, 120)
    assert not left, f"engine processes left after the application was removed: {left}"
