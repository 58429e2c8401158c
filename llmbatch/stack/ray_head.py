"""The local stack's Ray head: ``ray start --head`` with its Jobs API, GCS, Serve and metrics ports
from the stack's allocator, the run folder's S3 keys in its environment (what its jobs and Serve replicas
use) and, on a TLS stack, Ray's gRPC TLS and a TLS front before its dashboard."""

from __future__ import annotations

import json
import os
import secrets
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from llmbatch.stack.node_credentials import minio_credentials, ray_node_credentials, runner_token
from llmbatch.stack.process import (
    StackError,
    StartedTree,
    http_ok,
    port_open,
    spawn,
    stop_tree,
    wait_until,
)
from llmbatch.stack.start_ports import StartPorts, start_ports
from llmbatch.stack.state import ServiceRecord
from llmbatch.stack.tls import TlsFiles


def ray_executable() -> Path:
    candidate = Path(sys.executable).parent / "ray"
    if not candidate.exists():
        raise StackError(f"`ray` not found beside {sys.executable}: run scripts/bootstrap.sh")
    return candidate


def start_ray(
    run_dir: Path,
    num_cpus: int = 2,
    object_store_bytes: int = 1_000_000_000,
    *,
    restart: ServiceRecord | None = None,
    tls: TlsFiles | None = None,
) -> ServiceRecord:
    """Start a Ray head. ``restart`` (an earlier start's record) brings it back on the same addresses
    (Jobs API, GCS, Serve, metrics), as a KubeRay head pod comes back: clients keep their settings,
    the job records of the old head are gone. ``tls``: Ray's gRPC (GCS, raylet, object manager,
    workers, and so every job's driver and Serve replica) speaks mutual TLS with that certificate
    (``RAY_USE_TLS``), its dashboard (Jobs and Serve APIs) is reached through a TLS front
    (:mod:`llmbatch.stack.tls_front`) and the record names an https:// Serve proxy with that
    certificate (Serve's own TLS, turned on by the dispatcher's deploy)."""
    with start_ports() as ports:
        return _start_ray(run_dir, num_cpus, object_store_bytes, ports, restart, tls)


QUIET_LOG_MONITOR_ENV = {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0", "LOG_NAME_UPDATE_INTERVAL_S": "2"}
"""Ray's log monitor globs the logs directory for new worker logs every 0.1 s until it holds 1,000
files, the largest share of an idle head's CPU once jobs have run; with these, every 2 s. A new log is
still read from its start (no line is lost); its first lines reach the driver up to 2 s later."""


QUIET_SERVE_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5", "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000"}
"""Serve's controller runs its control loop every 0.1 s and its replicas and handles export their cached
metrics every 0.1 s; on a node whose engine computes on every core, each wake-up takes a core from one
of the engine's OpenMP threads. With these, every 0.5 s and 1 s: an idle controller beside a warm engine
used 0.037 of a core, now 0.014-0.016. A deploy, a scale-up or a replica's replacement notices each of its
steps up to 0.4 s later; requests to running replicas are routed as before (no router waits on the loop)."""


ONE_NODE_STOP_ENV = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
"""On SIGTERM, ``ray start --block`` first drains its node for up to 30 s, for Serve's replicas to move to
another node; a node that is the whole cluster has none, so with Serve running it waited out the stop's
20 s and every Ray process was SIGKILLed. With this it stops in seconds. (A Kubernetes Ray pod keeps the
drain: there the other nodes take over.)"""


def ray_tls_env(tls: TlsFiles) -> dict[str, str]:
    """The variables that turn on TLS for every Ray process of a node (they inherit them)."""
    return {
        "RAY_USE_TLS": "1",
        "RAY_TLS_SERVER_CERT": str(tls.server_cert),
        "RAY_TLS_SERVER_KEY": str(tls.server_key),
        "RAY_TLS_CA_CERT": str(tls.ca_cert),
    }


def _start_ray(
    run_dir: Path,
    num_cpus: int,
    object_store_bytes: int,
    ports: StartPorts,
    restart: ServiceRecord | None = None,
    tls: TlsFiles | None = None,
) -> ServiceRecord:
    # Ray's own temp dir must be short (unix socket paths are limited to 107 bytes)
    temp = Path(tempfile.gettempdir()) / f"llmbatch-ray-{os.getpid()}-{secrets.token_hex(3)}"
    temp.mkdir(parents=True, exist_ok=True)
    # one allocator for all of them: the dashboard can never land inside the worker range
    if restart is not None:
        gcs, dashboard, client, serve, metrics = ports.again(
            "The Ray head", restart.ports, "gcs", "dashboard", "client", "serve", "metrics"
        )
        agent = ports.one()
        front = 0
        if tls is not None:  # the old head's front goes with it (it holds the port)
            if old_front := int(restart.extra.get("front_pid", 0)):
                stop_tree(old_front)
            front = ports.again("The Ray head", restart.ports, "dashboard_tls")[0]
    else:
        gcs, dashboard, client, agent = ports.one(), ports.one(), ports.one(), ports.one()
        serve = ports.one()  # Serve's HTTP proxy (the batch runner), bound once Serve starts
        metrics = ports.one()  # Prometheus metrics of the node (Ray's, Serve's, llmbatch_engine_*)
        front = ports.one() if tls is not None else 0  # the dashboard's TLS front
    workers = ports.block(200)
    log = run_dir / "logs" / "ray.log"
    env = {
        "RAY_AUTH_MODE": "disabled",  # explicit: a stray ~/.ray/auth_token would otherwise turn auth on
        "RAY_USAGE_STATS_ENABLED": "0",
        # a crashed or SIGKILLed worker's process group goes with it: an engine replica's vLLM
        # EngineCore would otherwise live on, orphaned, holding the model and its KV cache
        "RAY_process_group_cleanup_enabled": "1",
        "RAY_DEDUP_LOGS": "0",
        **QUIET_LOG_MONITOR_ENV,
        **QUIET_SERVE_ENV,
        **ONE_NODE_STOP_ENV,
        "PYTHONUNBUFFERED": "1",
        # job entrypoints say `python ...`: make that the venv's interpreter, as on a worker image
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        # the stack's S3 keys, as a Kubernetes Secret gives them to the Ray pods
        **ray_node_credentials(*minio_credentials(run_dir), runner_token=runner_token(run_dir)),
        **(ray_tls_env(tls) if tls is not None else {}),
    }
    argv = [
        str(ray_executable()),
        "start",
        "--head",
        "--block",
        f"--num-cpus={num_cpus}",
        f"--port={gcs}",
        "--node-ip-address=127.0.0.1",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard}",
        "--include-dashboard=true",
        f"--dashboard-agent-listen-port={agent}",
        f"--ray-client-server-port={client}",
        f"--metrics-export-port={metrics}",
        f"--min-worker-port={workers}",
        f"--max-worker-port={workers + 199}",
        f"--object-store-memory={object_store_bytes}",
        f"--temp-dir={temp}",
        "--disable-usage-stats",
    ]
    address = f"http://127.0.0.1:{dashboard}"
    pid, waited = _spawn_until_ready(argv, log, env, address, ports, client)
    extra = {
        "gcs_address": f"127.0.0.1:{gcs}",
        "serve_address": f"http://127.0.0.1:{serve}",
        "runner_token": runner_token(run_dir),  # what the stack's dispatchers send the batch runner
    }
    named = {"gcs": gcs, "dashboard": dashboard, "client": client, "serve": serve, "metrics": metrics}
    if tls is not None:
        front_pid = start_tls_front(front, dashboard, tls, run_dir / "logs" / "ray-tls-front.log")
        address = f"https://127.0.0.1:{front}"
        named["dashboard_tls"] = front
        extra.update(
            ca_cert=str(tls.ca_cert),
            front_pid=str(front_pid),
            serve_address=f"https://127.0.0.1:{serve}",
            serve_ssl_certfile=str(tls.server_cert),
            serve_ssl_keyfile=str(tls.server_key),
        )
        waited += wait_until(
            lambda: _ray_jobs_api_ready(address, str(tls.ca_cert)),
            30,
            front_pid,
            "Ray dashboard's TLS front",
            run_dir / "logs" / "ray-tls-front.log",
        )
    return ServiceRecord("ray", pid, named, address, str(log), str(temp), round(waited, 2), extra=extra)


START_ATTEMPTS = 3


def _spawn_until_ready(
    argv: list[str], log: Path, env: dict[str, str], address: str, ports: StartPorts, client_port: int
) -> tuple[int, float]:
    """Run ``ray start --head --block`` until a first job has run on it and its Ray Client server
    listens: (its PID, seconds waited).

    The Jobs API answers before the head's job agent can take a job ("No available agent to submit
    job" for tens of seconds on a loaded machine), so healthy means a first job has run. The Ray
    Client server gives up when the node has not registered within its own 30 s, and ``ray start
    --block`` then stops the whole head; it binds its port once it found the node. A ``ray
    start`` that gives up (see :class:`StartedTree`) is stopped with what it left and run again on the
    same ports, :data:`START_ATTEMPTS` times in all."""
    waited = 0.0
    for attempt in range(1, START_ATTEMPTS + 1):
        tree = StartedTree()
        pid = spawn(argv, log, env=env)
        ports.hand_over(pid)
        try:
            waited += wait_until(
                tree.checking(pid, lambda: _ray_jobs_api_ready(address)),
                180,
                pid,
                "Ray head",
                log,
                interval=1.0,
            )
            waited += wait_until(
                tree.checking(pid, _RayJobProbe(address).done),
                180,
                pid,
                "Ray head (first job)",
                log,
                interval=0.5,
            )
            waited += wait_until(
                tree.checking(pid, lambda: port_open(client_port)),
                60,
                pid,
                "Ray head (its Ray Client server)",
                log,
                interval=0.5,
            )
            return pid, waited
        except StackError:
            stop_tree(pid)
            tree.stop()
            if attempt == START_ATTEMPTS:
                raise
    raise AssertionError("unreachable")


def start_tls_front(port: int, dashboard: int, tls: TlsFiles, log: Path) -> int:
    """Start the dashboard's TLS front (:mod:`llmbatch.stack.tls_front`); return its PID."""
    argv = [
        sys.executable,
        "-m",
        "llmbatch.stack.tls_front",
        f"--listen-port={port}",
        f"--target-port={dashboard}",
        f"--cert={tls.server_cert}",
        f"--key={tls.server_key}",
    ]
    return spawn(argv, log)


class _RayJobProbe:
    """Submits one trivial job (again while the head refuses it) and reports when it succeeded."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.submission_id = f"llmbatch-stack-ready-{secrets.token_hex(4)}"
        self.submitted = False

    def done(self) -> bool:
        if not self.submitted:
            body = json.dumps(
                {"entrypoint": "true", "submission_id": self.submission_id, "entrypoint_num_cpus": 0}
            ).encode()
            req = urllib.request.Request(  # noqa: S310 - the head's own loopback address
                f"{self.address}/api/jobs/",
                data=body,
                method="POST",
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 - loopback
                    self.submitted = int(resp.status) == 200
            except urllib.error.HTTPError as exc:  # a retry of a submission that went through
                self.submitted = b"already exists" in exc.read()
            return False
        url = f"{self.address}/api/jobs/{self.submission_id}"
        with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 - loopback
            status = json.loads(resp.read())["status"]
        if status in ("FAILED", "STOPPED"):
            raise StackError(f"the Ray head's first job ended {status}")
        return bool(status == "SUCCEEDED")


def _ray_jobs_api_ready(address: str, ca_cert: str | None = None) -> bool:
    return http_ok(f"{address}/api/jobs/", timeout=3, ca_cert=ca_cert)


def ray_healthy(rec: ServiceRecord) -> bool:
    try:
        return _ray_jobs_api_ready(rec.address, rec.extra.get("ca_cert"))
    except Exception:
        return False
