"""Shared engines on a real Ray head with real Ray Serve (fake engine inside the replicas).

Deployed the way the dispatcher deploys them (Serve REST config), used the way a batch uses them
(a Ray job whose driver calls :class:`llmbatch.ray_job.engines.serve_client.ServeEngine`). Real vLLM behind
the same deployment: tests/integration/test_ray_job_vllm.py (batches on a shared engine) and
test_serve_engine_vllm_faults.py (a replica SIGKILLed mid-batch).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import psutil
import pytest
from ray.job_submission import JobStatus, JobSubmissionClient

from llmbatch.dispatcher.backends.engines import replica_pids, serve_config, summarize
from llmbatch.dispatcher.backends.serve_api import ServeApi
from llmbatch.ray_job.engines.backends import FAKE_BACKEND
from llmbatch.schemas.engines import EngineModel, EngineRegistry, ReplicaResources, Scaling, app_name
from llmbatch.schemas.job import EngineConfig
from llmbatch.settings import RaySettings
from llmbatch.stack.ray_head import QUIET_SERVE_ENV
from llmbatch.stack.state import ServiceRecord
from tests.support.proc_env import environ_of_first
from tests.support.services import ServiceProvider

pytestmark = pytest.mark.integration

MODEL = "fake-shared"
# a probe driver: N requests through the shared engine in one call, results as one JSON line
# The driver's stdout is unbuffered (PYTHONUNBUFFERED on the Ray node): print() writes a line's text and
# its newline in two calls, and a log line written between them (Ray's, on stderr, to the same job log)
# lands on the probe's line; Ray's own lines are written that way too, so a probe line written between
# their two calls would start after the log line's text. The probes write each line in one call, starting
# with a newline.
EMIT = """
def emit(result):
    sys.stdout.write("\\nPROBE " + orjson.dumps(result).decode() + "\\n")
    sys.stdout.flush()
"""
PROBE = (
    """
import sys, time, orjson
"""
    + EMIT
    + """
from llmbatch.ray_job.engines.serve_client import ServeEngine
from llmbatch.ray_job.lines.records import GenRequest
app, n, wait = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
started = time.time()
try:
    engine = ServeEngine(app, wait_s=wait, retries=3)
    out = engine.generate([GenRequest(str(i), [1, 2, 3], {"max_tokens": 4}, prompt_text=f"p{i}",
                                      custom_id=f"c{i}") for i in range(n)])
    emit({"keys": [g.key for g in out], "texts": [g.text for g in out],
          "failures": [g.failure.code if g.failure else None for g in out],
          "slots": engine.slots(), "seconds": time.time() - started})
except Exception as exc:
    emit({"error": type(exc).__name__, "code": getattr(exc, "code", None),
          "message": str(exc)[:500], "seconds": time.time() - started})
"""
)
# two batches through one replica: a long low-priority one, then (while it runs) a short urgent one
PRIORITY_PROBE = (
    """
import sys, time, threading, orjson
"""
    + EMIT
    + """
from llmbatch.ray_job.engines.serve_client import ServeEngine
from llmbatch.ray_job.lines.records import GenRequest
engine = ServeEngine(sys.argv[1], wait_s=120, retries=0)
done = {}
def call(name, n, priority):
    out = engine.generate([GenRequest(str(i), [1], {"max_tokens": 4}, prompt_text=f"{name}{i}")
                           for i in range(n)], group=name, priority=priority)
    done[name] = {"at": time.time(), "keys": [g.key for g in out],
                  "failures": [g.failure.code if g.failure else None for g in out]}
low = threading.Thread(target=call, args=("low", 8, 0))
started = time.time()
low.start()
time.sleep(1.5)
urgent_at = time.time()
call("urgent", 2, 9)
low.join()
emit({"started": started, "urgent_at": urgent_at, **done})
"""
)

# a call given up by its caller (its batch stopped) while two of its requests run and six wait
ABANDON_PROBE = (
    """
import sys, time, threading, orjson
"""
    + EMIT
    + """
from llmbatch.ray_job.engines.serve_client import ServeEngine
from llmbatch.ray_job.lines.records import GenRequest
engine = ServeEngine(sys.argv[1], wait_s=120, retries=0)
before = engine._call("info", timeout_s=60)
stop, out = threading.Event(), {}
def call():
    try:
        engine.generate([GenRequest(str(i), [1], {"max_tokens": 4}, prompt_text=f"gone{i}")
                         for i in range(8)], group="gone", stop=stop)
        out["error"] = None
    except Exception as exc:
        out["error"] = type(exc).__name__
caller = threading.Thread(target=call)
caller.start()
while True:  # until the replica holds the call
    info = engine._call("info", timeout_s=60)
    if info["queued"] + info["active"] >= 8:
        break
    time.sleep(0.05)
stop.set()
caller.join(60)
while True:  # until the replica is idle
    after = engine._call("info", timeout_s=60)
    if after["queued"] == 0 and after["active"] == 0:
        break
    time.sleep(0.05)
emit({"error": out.get("error"), "caller_done": not caller.is_alive(), "before": before, "after": after})
"""
)

# one batch at risk of its deadline: its call says so (``due``), its requests wait one at a time
DUE_PROBE = (
    """
import sys, time, orjson
"""
    + EMIT
    + """
from llmbatch.ray_job.engines.serve_client import ServeEngine
from llmbatch.ray_job.lines.records import GenRequest
engine = ServeEngine(sys.argv[1], wait_s=120, retries=0)
requests = [GenRequest(str(i), [1], {"max_tokens": 4}, prompt_text=f"p{i}") for i in range(int(sys.argv[2]))]
out = engine.generate(requests, group="late", priority=5, due=time.time() + 1)
emit({"keys": [g.key for g in out], "failures": [g.failure.code if g.failure else None for g in out]})
"""
)

# two batches of one priority through one replica: a long one, then (while it runs) a short one that says
# it is at risk of its deadline (``due``)
DUE_ORDER_PROBE = (
    """
import sys, time, threading, orjson
"""
    + EMIT
    + """
from ray import serve
from llmbatch.ray_job.engines.serve_client import ServeEngine
from llmbatch.ray_job.lines.records import GenRequest
engine = ServeEngine(sys.argv[1], wait_s=120, retries=0)
replica = serve.get_deployment_handle("EngineServer", app_name=sys.argv[1])
due = None if sys.argv[2] == "0" else 1.0
done = {"base": replica.info.remote().result(timeout_s=30)["finished"]}
def call(name, n, due):
    out = engine.generate([GenRequest(str(i), [1], {"max_tokens": 4}, prompt_text=f"{name}{i}")
                           for i in range(n)], group=name, priority=5, due=due)
    # requests the replica finished when this call's answers came (the other batch's included)
    finished = replica.info.remote().result(timeout_s=30)["finished"]
    done[name] = {"finished": finished, "keys": [g.key for g in out],
                  "failures": [g.failure.code if g.failure else None for g in out]}
long = threading.Thread(target=call, args=("long", 10, None))
long.start()
time.sleep(1.5)
call("late", 3, None if due is None else time.time() + due)
long.join()
emit(done)
"""
)


def _registry(
    delay_s: float,
    *,
    backend: str = FAKE_BACKEND,
    path: str = "fake",
    max_active: int = 256,
    replicas: int = 1,
) -> EngineRegistry:
    options = {"delay_s": delay_s} if backend == FAKE_BACKEND else {}
    return EngineRegistry(
        models={
            MODEL: EngineModel(
                path=path,
                engine=EngineConfig(backend=backend, backend_options=options),
                resources=ReplicaResources(num_cpus=0.25),
                scaling=Scaling(min_replicas=replicas, max_replicas=replicas, idle_s=60),
                max_active_requests=max_active,
            )
        }
    )


def _details(api: ServeApi) -> dict[str, Any]:
    return asyncio.run(api.status())


def _wait_app(api: ServeApi, registry: EngineRegistry, want: set[str], timeout: float = 240) -> Any:
    deadline = time.monotonic() + timeout
    row = None
    while time.monotonic() < deadline:
        row = summarize(registry, _details(api))[0]
        if row.status in want and (row.status != "RUNNING" or row.running >= 1):
            return row
        time.sleep(1)
    raise AssertionError(f"engine app never reached {want}: {row}")


@pytest.fixture(scope="module")
def serve(ray_settings: RaySettings) -> Iterator[ServeApi]:
    api = ServeApi(ray_settings.address, timeout_s=60)
    yield api
    asyncio.run(api.deploy({"applications": []}))  # remove every engine again


def _probe(
    ray_settings: RaySettings, n: int, wait_s: float = 120, code: str = PROBE, extra: str = ""
) -> tuple[JobSubmissionClient, str]:
    client = JobSubmissionClient(ray_settings.address)
    job_id = f"probe-{uuid.uuid4().hex[:8]}"
    client.submit_job(
        submission_id=job_id,
        entrypoint_num_cpus=0,
        entrypoint=f"python -P -c {_quote(code)} {app_name(MODEL)} {n} {wait_s} {_quote(extra)}",
        runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled"}},
    )
    return client, job_id


def _quote(code: str) -> str:
    import shlex

    return shlex.quote(code)


def _result(
    client: JobSubmissionClient, job_id: str, timeout: float = 300, *, key: str | None = None
) -> dict[str, Any]:
    """The probe's last result line (with ``key``: the last one that has it; Ray ships a driver's output
    to the job's log a moment after the job ends, so its last lines may come after its end)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not client.get_job_status(job_id).is_terminal():
        time.sleep(0.5)
    logs = client.get_job_logs(job_id)
    assert client.get_job_status(job_id) == JobStatus.SUCCEEDED, logs[-3000:]
    shipped = time.monotonic() + 30
    while True:
        lines = [orjson.loads(ln[len("PROBE ") :]) for ln in logs.splitlines() if ln.startswith("PROBE ")]
        found = [ln for ln in lines if key is None or key in ln]
        if found or time.monotonic() > shipped:
            break
        time.sleep(0.5)
        logs = client.get_job_logs(job_id)
    assert found, logs[-3000:]
    result: dict[str, Any] = found[-1]
    return result


def test_batches_share_one_warm_engine(ray_settings: RaySettings, serve: ServeApi) -> None:
    registry = _registry(delay_s=0.2)
    asyncio.run(serve.deploy(serve_config(registry, http_address=ray_settings.serve_address)))
    _wait_app(serve, registry, {"RUNNING"})
    pids_before = replica_pids(_details(serve), MODEL)
    assert len(pids_before) == 1
    # two batches at once on the same replica, each gets exactly its own answers in order
    jobs = [_probe(ray_settings, n) for n in (8, 5)]
    results = [_result(client, job_id) for client, job_id in jobs]
    assert results[0]["keys"] == [str(i) for i in range(8)]
    assert results[1]["keys"] == [str(i) for i in range(5)]
    assert all(t.startswith("fake reply to") for r in results for t in r["texts"]), results
    assert all(f is None for r in results for f in r["failures"])
    # what a batch alone may keep at the engine: the one live replica's max_active_requests
    assert [r["slots"] for r in results] == [256, 256]
    # no batch started an engine of its own: the same single replica served both
    assert replica_pids(_details(serve), MODEL) == pids_before


def test_a_batch_alone_may_keep_every_running_replicas_requests(
    ray_settings: RaySettings, serve: ServeApi
) -> None:
    """Two running replicas of 3 requests each: a batch's share is 6 (it was 3, one replica, whatever
    ran: Serve's replica states are plain strings in this Ray, and reading them failed)."""
    registry = _registry(delay_s=0.0, max_active=3, replicas=2)
    asyncio.run(serve.deploy(serve_config(registry, http_address=ray_settings.serve_address)))
    _wait_app(serve, registry, {"RUNNING"})
    deadline = time.monotonic() + 240
    while (row := summarize(registry, _details(serve))[0]).running < 2:
        assert time.monotonic() < deadline, row
        time.sleep(1)
    result = _result(*_probe(ray_settings, 2))
    assert result["slots"] == 6, result


def _titled(title: str) -> Callable[[list[str]], bool]:
    """Matches a command line whose process title starts with ``title`` (a Ray actor's)."""
    return lambda argv: bool(argv) and argv[0].startswith(title)


def _deployed_on_own_head(
    ray_settings: RaySettings, serve: ServeApi, services: ServiceProvider, needs: str
) -> ServiceRecord:
    """Deploy the probe model and return the suite's own Ray head (a test that needs ``needs``)."""
    registry = _registry(delay_s=0.0)
    asyncio.run(serve.deploy(serve_config(registry, http_address=ray_settings.serve_address)))
    _wait_app(serve, registry, {"RUNNING"})
    record = services.local_record("ray")
    if record is None:
        pytest.fail(f"the check needs the suite's own Ray head ({needs})")
    return record


def test_serve_wakes_less_often_beside_the_engine(
    ray_settings: RaySettings, serve: ServeApi, services: ServiceProvider
) -> None:
    record = _deployed_on_own_head(ray_settings, serve, services, "its process tree")
    for title in ("ray::ServeController", "ray::ServeReplica"):
        tree = (p.pid for p in psutil.Process(record.pid).children(recursive=True))
        env = environ_of_first(tree, _titled(title))
        assert env is not None, f"no {title} process under the Ray head {record.pid}"
        assert QUIET_SERVE_ENV.items() <= env.items(), (title, {k: env.get(k) for k in QUIET_SERVE_ENV})


def test_replicas_export_engine_metrics(
    ray_settings: RaySettings, serve: ServeApi, services: ServiceProvider
) -> None:
    record = _deployed_on_own_head(ray_settings, serve, services, "its metrics port")
    before = _metric(record.ports["metrics"], "requests_total")
    result = _result(*_probe(ray_settings, 7))
    assert result["keys"] == [str(i) for i in range(7)]
    deadline = time.monotonic() + 90  # Ray's agent exports every ~10 s
    while _metric(record.ports["metrics"], "requests_total") < before + 7:
        assert time.monotonic() < deadline, _metric_lines(record.ports["metrics"])
        time.sleep(2)
    assert _metric(record.ports["metrics"], "completion_tokens_total") > 0
    assert "ray_llmbatch_engine_queued_requests" in _metric_lines(record.ports["metrics"])


def _metric_lines(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return "\n".join(ln for ln in text.splitlines() if "llmbatch_engine" in ln and MODEL in ln)


def _metric(port: int, name: str) -> float:
    return sum(
        float(ln.rsplit(" ", 1)[1])
        for ln in _metric_lines(port).splitlines()
        if ln.startswith(f"ray_llmbatch_engine_{name}{{")
    )


def test_an_urgent_batch_overtakes_a_running_one_on_the_replica(
    ray_settings: RaySettings, serve: ServeApi
) -> None:
    # two requests at a time on the engine, 1 s each: the low batch alone needs 4 s
    registry = _registry(delay_s=1.0, max_active=2)
    asyncio.run(serve.deploy(serve_config(registry, http_address=ray_settings.serve_address)))
    _wait_app(serve, registry, {"RUNNING"})
    client, job_id = _probe(ray_settings, 0, code=PRIORITY_PROBE)
    result = _result(client, job_id)
    low, urgent = result["low"], result["urgent"]
    assert low["keys"] == [str(i) for i in range(8)] and urgent["keys"] == ["0", "1"]
    assert all(f is None for f in low["failures"] + urgent["failures"]), result
    # the urgent batch took the engine back: it finished first, in about one request's time
    assert urgent["at"] < low["at"], result
    assert urgent["at"] - result["urgent_at"] < 2.5, result
    info = _engine_info(ray_settings)
    assert info["preempted"] >= 1 and info["queued"] == 0 and info["active"] == 0, info


def test_a_call_its_caller_gives_up_leaves_the_replicas_engine_and_queue(
    ray_settings: RaySettings, serve: ServeApi
) -> None:
    """Through Serve's own request cancellation: the caller's stop cancels the call, the replica drops
    its requests (the two running are aborted, the six waiting never start) instead of answering them."""
    # two requests at a time, 2 s each: the call alone would hold the engine 8 s
    registry = _registry(delay_s=2.0, max_active=2)
    asyncio.run(serve.deploy(serve_config(registry, http_address=ray_settings.serve_address)))
    _wait_app(serve, registry, {"RUNNING"})
    client, job_id = _probe(ray_settings, 0, code=ABANDON_PROBE)
    result = _result(client, job_id)
    assert result["error"] == "CallAbandonedError" and result["caller_done"], result
    before, after = result["before"], result["after"]
    abandoned = after["abandoned"] - before["abandoned"]
    finished = after["finished"] - before["finished"]
    # every request of the call either finished before the stop reached the replica or was dropped;
    # the six waiting behind the first two never reached the engine
    assert abandoned + finished == 8 and abandoned >= 6, result
    assert after["requests"] == before["requests"], result  # nothing of it was answered


def test_requests_of_a_batch_at_risk_waiting_at_a_replica_bring_another_replica(
    ray_settings: RaySettings, serve: ServeApi
) -> None:
    """One call in flight is far below Serve's target (8 a replica): its own rule keeps one replica.
    The call's requests belong to a batch at risk of its deadline and wait one at a time: the replica
    reports them and the model's policy asks for the second replica it may have."""
    registry = EngineRegistry(
        models={
            MODEL: EngineModel(
                path="fake",
                engine=EngineConfig(backend=FAKE_BACKEND, backend_options={"delay_s": 1.0}),
                resources=ReplicaResources(num_cpus=0.25),
                scaling=Scaling(min_replicas=1, max_replicas=2, idle_s=60),
                max_active_requests=1,
            )
        }
    )
    asyncio.run(serve.deploy(serve_config(registry, http_address=ray_settings.serve_address)))
    _wait_app(serve, registry, {"RUNNING"})
    assert summarize(registry, _details(serve))[0].running == 1
    client, job_id = _probe(ray_settings, 30, code=DUE_PROBE)
    # the call takes 30 s on one replica; a replica added stays for idle_s (60 s) whatever comes after
    deadline = time.monotonic() + 60
    while (row := summarize(registry, _details(serve))[0]).running < 2:
        assert time.monotonic() < deadline, row
        time.sleep(0.5)
    result = _result(client, job_id)
    assert result["keys"] == [str(i) for i in range(30)] and not any(result["failures"]), result


def test_a_batch_at_risk_of_its_deadline_goes_before_its_prioritys_turns_on_the_replica(
    ray_settings: RaySettings, serve: ServeApi
) -> None:
    # one request at a time, 1 s each; the late batch (3 requests) comes while the long one's second runs.
    # In turns they alternate: when the late one is done the replica has finished 5 or more of the long
    # one's. At risk, the late one takes the slot as it frees: 2 or 3 of the long one's are done.
    registry = _registry(delay_s=1.0, max_active=1)
    asyncio.run(serve.deploy(serve_config(registry, http_address=ray_settings.serve_address)))
    _wait_app(serve, registry, {"RUNNING"})
    turns = _result(*_probe(ray_settings, 0, code=DUE_ORDER_PROBE))
    at_risk = _result(*_probe(ray_settings, 1, code=DUE_ORDER_PROBE))
    for result in (turns, at_risk):
        assert result["long"]["keys"] == [str(i) for i in range(10)] and result["late"]["keys"] == [
            "0",
            "1",
            "2",
        ]
        assert not any(result["long"]["failures"] + result["late"]["failures"]), result
    # of the long batch's requests, those the replica finished by the time the late batch's answers came
    in_turns = turns["late"]["finished"] - turns["base"] - 3
    first = at_risk["late"]["finished"] - at_risk["base"] - 3
    assert in_turns >= 5 and first <= 3, (turns, at_risk)


# one tenant's five batches at once (4 requests each), then (while they run) another tenant's one batch
TENANT_PROBE = (
    """
import sys, time, threading, orjson
"""
    + EMIT
    + """
from ray import serve
from llmbatch.ray_job.engines.serve_client import ServeEngine
from llmbatch.ray_job.lines.records import GenRequest
engine = ServeEngine(sys.argv[1], wait_s=120, retries=0)
replica = serve.get_deployment_handle("EngineServer", app_name=sys.argv[1])
done = {}
def call(group, n):
    out = engine.generate([GenRequest(str(i), [1], {"max_tokens": 4}, prompt_text=f"{group}{i}")
                           for i in range(n)], group=group, priority=5)
    done[group] = {"finished": replica.info.remote().result(timeout_s=30)["finished"],
                   "failures": [g.failure.code if g.failure else None for g in out]}
big = [threading.Thread(target=call, args=(f"big/b{b}", 4)) for b in range(5)]
for t in big:
    t.start()
time.sleep(1.5)
done["base"] = replica.info.remote().result(timeout_s=30)["finished"]
call("lone/x", 4)
for t in big:
    t.join()
emit(done)
"""
)


def test_a_tenants_many_batches_take_one_tenants_share_of_the_replica(
    ray_settings: RaySettings, serve: ServeApi
) -> None:
    """One request at a time. Tenant big's five batches are running when tenant lone's one batch comes:
    the tenants take turns (the code before: the six batches did, and lone's 4 requests waited for 15
    or more of big's). With lone's weight 3 (the dispatcher's LLMBATCH_TENANTS__WEIGHTS, sent with the
    Serve config), lone takes three turns for one of big's."""
    results = {}
    for weights in (None, {"lone": 3.0}):
        registry = _registry(delay_s=0.3, max_active=1)
        config = serve_config(registry, http_address=ray_settings.serve_address, tenant_weights=weights)
        before = set(replica_pids(_details(serve), MODEL))
        asyncio.run(serve.deploy(config))
        deadline = time.monotonic() + 240
        while before & set(replica_pids(_details(serve), MODEL)) or not replica_pids(_details(serve), MODEL):
            assert time.monotonic() < deadline, _details(serve)  # a replica of this config, not the last
            time.sleep(0.5)
        _wait_app(serve, registry, {"RUNNING"})
        result = _result(*_probe(ray_settings, 0, code=TENANT_PROBE))
        assert not any(f for r in result.values() if isinstance(r, dict) for f in r["failures"]), result
        # big's requests the replica finished between lone's arrival and its answers
        results["equal" if weights is None else "weighted"] = (
            result["lone/x"]["finished"] - result["base"] - 4
        )
    assert results["equal"] <= 6 and results["weighted"] <= 3, results
    assert results["weighted"] < results["equal"], results


def test_a_call_waiting_its_turn_outlasts_the_engine_wait(ray_settings: RaySettings, serve: ServeApi) -> None:
    # one request at a time, 3 s each: the call takes ~9 s, far beyond the batch's 2 s engine wait
    registry = _registry(delay_s=3.0, max_active=1)
    asyncio.run(serve.deploy(serve_config(registry, http_address=ray_settings.serve_address)))
    _wait_app(serve, registry, {"RUNNING"})
    result = _result(*_probe(ray_settings, 3, wait_s=2))
    assert "error" not in result, result  # waiting in the replica's queue is not "unavailable"
    assert result["keys"] == ["0", "1", "2"] and result["seconds"] >= 8, result


def test_an_idle_model_scales_to_zero_and_back(ray_settings: RaySettings, serve: ServeApi) -> None:
    registry = EngineRegistry(
        models={
            MODEL: EngineModel(
                path="fake",
                engine=EngineConfig(backend=FAKE_BACKEND),
                resources=ReplicaResources(num_cpus=0.25),
                scaling=Scaling(min_replicas=0, max_replicas=1, initial_replicas=1, idle_s=25),
            )
        }
    )
    asyncio.run(serve.deploy(serve_config(registry, http_address=ray_settings.serve_address)))
    _wait_app(serve, registry, {"RUNNING"})
    busy_cpus = _free_cpus(ray_settings)  # measured well within the 25 s before it may go
    assert replica_pids(_details(serve), MODEL), "the replica went before its idle time"
    # idle: the replica goes and Ray gets its CPUs back
    deadline = time.monotonic() + 120
    while replica_pids(_details(serve), MODEL):
        assert time.monotonic() < deadline, summarize(registry, _details(serve))
        time.sleep(2)
    # a STOPPING replica is no longer RUNNING but holds its CPUs until its actor exits (CI saw 1.75 -> 1.75)
    free = _free_cpus(ray_settings)
    while free < busy_cpus + 0.25 and time.monotonic() < deadline:
        time.sleep(2)
        free = _free_cpus(ray_settings)
    assert free >= busy_cpus + 0.25, (free, busy_cpus, summarize(registry, _details(serve)))
    # a batch from zero: the call starts a replica and is answered
    result = _result(*_probe(ray_settings, 3, wait_s=120))
    assert "error" not in result and result["keys"] == ["0", "1", "2"], result
    assert len(replica_pids(_details(serve), MODEL)) == 1


def _free_cpus(ray_settings: RaySettings) -> float:
    code = (
        "import ray, sys; ray.init(); "
        "sys.stdout.write('\\nPROBE ' + str(ray.available_resources().get('CPU', 0.0)) + '\\n')"
    )
    client, job_id = _probe(ray_settings, 0, code=code)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not client.get_job_status(job_id).is_terminal():
        time.sleep(0.5)
    lines = [ln for ln in client.get_job_logs(job_id).splitlines() if ln.startswith("PROBE ")]
    assert lines, client.get_job_logs(job_id)[-2000:]
    return float(lines[-1].split()[1])


def _engine_info(ray_settings: RaySettings) -> dict[str, Any]:
    code = (
        "import sys, orjson; from ray import serve; "
        "h = serve.get_deployment_handle('EngineServer', app_name=sys.argv[1]); "
        "print('PROBE ' + orjson.dumps(h.info.remote().result(timeout_s=60)).decode())"
    )
    client, job_id = _probe(ray_settings, 0, code=code)
    return _result(client, job_id)


def test_a_killed_replica_is_replaced_and_its_requests_answered_once(
    ray_settings: RaySettings, serve: ServeApi
) -> None:
    registry = _registry(delay_s=6.0)  # long enough to kill the replica mid-call
    asyncio.run(serve.deploy(serve_config(registry, http_address=ray_settings.serve_address)))
    _wait_app(serve, registry, {"RUNNING"})
    [victim] = replica_pids(_details(serve), MODEL)
    client, job_id = _probe(ray_settings, 6, wait_s=240)
    time.sleep(4)  # the call is in flight on the victim
    os.kill(victim, signal.SIGKILL)
    result = _result(client, job_id)
    assert "error" not in result, result
    assert result["keys"] == [str(i) for i in range(6)]  # every request exactly once, in order
    assert all(f is None for f in result["failures"]), result
    row = _wait_app(serve, registry, {"RUNNING"})
    assert victim not in replica_pids(_details(serve), MODEL) and row.running == 1


# a batch that starts while Serve still builds the model's application (just deployed): it sees the
# application appear, notes whether its deployment exists yet, then asks for the engine
BUILDING_PROBE = (
    """
import sys, time, orjson
"""
    + EMIT
    + """
from pathlib import Path
from ray import serve
from llmbatch.ray_job.engines.serve_client import ServeEngine
app, wait, gate = sys.argv[1], float(sys.argv[3]), Path(sys.argv[4])
serve.status()
emit({"watching": app})
while (seen := serve.status().applications.get(app)) is None:
    time.sleep(0.02)
real, missing = serve.get_deployment_handle, []
def handle(*args, **kwargs):  # the engine's build goes on once the batch found no deployment
    try:
        return real(*args, **kwargs)
    except KeyError:
        missing.append(1)
        gate.touch()
        raise
serve.get_deployment_handle = handle
try:
    engine = ServeEngine(app, wait_s=wait, retries=0)
    emit({"built": not missing, "status": str(seen.status), "slots": engine.slots()})
except Exception as exc:
    emit({"built": not missing, "error": type(exc).__name__, "code": getattr(exc, "code", None),
          "message": str(exc)[:500]})
"""
)
# a Serve application builder that holds the build (the application stays DEPLOYING, without its
# deployment) until its gate file exists: Serve's own build takes milliseconds, too short to start a
# batch inside it every time
GATED_BUILDER = """
import time
from pathlib import Path
from llmbatch.ray_job.engines.serve_engine import build_app as engine_app

def build_app(args):
    gate, deadline = Path(args.pop("gate")), time.monotonic() + 120
    while not gate.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return engine_app(args)
"""


def test_a_batch_started_while_serve_builds_the_engine_waits_for_it(
    ray_settings: RaySettings, serve: ServeApi, tmp_path: Path
) -> None:
    """Serve builds an application after its config is applied; until then the application is
    DEPLOYING and has no deployment. A batch launched then (right after the dispatcher deployed the
    engines) waits for the engine instead of failing ``engine_unavailable``."""
    asyncio.run(serve.deploy({"applications": []}))
    deadline = time.monotonic() + 120
    while _details(serve).get("applications"):
        assert time.monotonic() < deadline, _details(serve)
        time.sleep(0.5)
    (tmp_path / "gated_build.py").write_text(GATED_BUILDER)
    gate = tmp_path / "gate"
    client, job_id = _probe(ray_settings, 0, wait_s=120, code=BUILDING_PROBE, extra=str(gate))
    while "PROBE " not in (logs := client.get_job_logs(job_id)):  # the batch watches Serve
        assert not client.get_job_status(job_id).is_terminal(), logs[-3000:]
        time.sleep(0.2)
    registry = _registry(delay_s=0.0, max_active=5)
    config = serve_config(registry, http_address=ray_settings.serve_address)
    (app,) = config["applications"]
    app["import_path"] = "gated_build:build_app"
    app["args"]["gate"] = str(gate)
    env = app.setdefault("runtime_env", {}).setdefault("env_vars", {})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    asyncio.run(serve.deploy(config))
    result = _result(client, job_id, key="built")
    assert result["built"] is False, result  # the batch did start before its engine's deployment existed
    assert "error" not in result and result["slots"] == 5, result


def test_an_engine_that_cannot_start_fails_the_batch_clearly(
    ray_settings: RaySettings, serve: ServeApi
) -> None:
    registry = _registry(delay_s=0.0, backend="vllm", path="/nonexistent/model-folder")
    asyncio.run(serve.deploy(serve_config(registry, http_address=ray_settings.serve_address)))
    row = _wait_app(serve, registry, {"DEPLOY_FAILED", "UNHEALTHY"}, timeout=600)
    assert row.message, row
    client, job_id = _probe(ray_settings, 2, wait_s=20)
    result = _result(client, job_id)
    assert result.get("code") == "engine_unavailable", result
    assert app_name(MODEL) in result["message"]
