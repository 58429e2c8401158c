"""A private Ray head that can be killed and started again on the SAME ports (a head restart as a
KubeRay head pod restart looks to clients: same address, no job records), and worker nodes that
join it (``ray start --address``, on this machine, with custom resources such as an engine node's
``llmbatch_engine``). Every process is stopped by PID only; nothing here runs ``ray stop``."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pydantic import SecretStr

from llmbatch.ray_job.storage import node_secrets
from llmbatch.settings import RaySettings, S3Settings
from llmbatch.stack.node_credentials import ray_node_credentials
from llmbatch.stack.ports import free_port, free_port_range
from llmbatch.stack.process import StackError, StartedTree, port_open, spawn, stop_tree, wait_until
from llmbatch.stack.ray_head import ONE_NODE_STOP_ENV, QUIET_LOG_MONITOR_ENV, QUIET_SERVE_ENV, ray_executable
from tests.support.pod_network import Pod, PodNetwork

T = TypeVar("T")

# a head in a pod of a PodNetwork has the pod's whole port space: Ray's own ports, as in the pod spec
POD_HEAD_PORTS = {"gcs": 6379, "dashboard": 8265, "client": 10001, "agent": 52365, "serve": 8000}
POD_WORKER_PORTS = 11000  # first of the worker processes' ports in a pod


class PodPlace:
    """Where a Ray node of these tests runs when it runs in a pod of a :class:`PodNetwork`: its
    processes in the pod's network namespace, its address the pod IP, and the test's own calls to it
    made from the node (as a kubelet's probes are)."""

    def __init__(self, net: PodNetwork, pod: Pod) -> None:
        self.net, self.pod = net, pod

    def command(self, argv: list[str]) -> list[str]:
        return self.net.command(argv, self.pod.netns)

    def call(self, fn: Callable[[], T]) -> T:
        return self.net.on_node(fn)


def start_in_attempts(start_once: Callable[[], T], stop: Callable[[], None], attempts: int) -> T:
    """``start_once()``, and after a :class:`StackError` ``stop()`` and again, ``attempts`` times in all."""
    for attempt in range(1, attempts + 1):
        try:
            return start_once()
        except StackError:
            stop()
            if attempt == attempts:
                raise
    raise AssertionError("unreachable")


KEPT_LOG_BYTES = 1_000_000  # the end of each log, where a start-up failure is


def keep_session_logs(temp: Path, dest: Path) -> None:
    """Copy the Ray processes' own logs of a node that failed to start (the raylet's, the GCS's, the
    agents') from its temp dir, which :meth:`stop` deletes, to ``dest`` (a test's tmp dir, kept by
    pytest): the ``ray start`` output only says that the node timed out."""
    logs = temp / "session_latest" / "logs"
    if not logs.is_dir():
        return
    dest.mkdir(parents=True, exist_ok=True)
    for path in logs.iterdir():
        if path.is_file() and path.suffix in {".out", ".err", ".log"}:
            with path.open("rb") as src:
                src.seek(max(path.stat().st_size - KEPT_LOG_BYTES, 0))
                (dest / path.name).write_bytes(src.read())


class PrivateRay:
    def __init__(
        self,
        run_dir: Path,
        num_cpus: int = 2,
        resources: dict[str, float] | None = None,
        auth_token: str | None = None,
        s3: S3Settings | None = None,
        redis_password: str | None = None,
        start_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        place: PodPlace | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.place = place  # None: this machine's network, on 127.0.0.1 and free ports
        self.start_args = list(start_args)  # more ``ray start`` options, e.g. ``--no-monitor``
        self.env = dict(env or {})  # more environment for the head's processes
        # what its jobs and replicas find in their environment (never sent in a runtime_env)
        self.runner_token = secrets.token_hex(32)  # the batch runner's credential on this head
        self.node_env = (
            ray_node_credentials(
                s3.access_key.get_secret_value(),
                s3.secret_key.get_secret_value(),
                redis_password,
                runner_token=self.runner_token,
            )
            if s3
            else {node_secrets.RUNNER_TOKEN: self.runner_token}
        )
        self.auth_token = auth_token  # None: auth off; else Ray's token auth with this token
        self.num_cpus = num_cpus
        self.resources = resources  # custom resources (``--resources``); None = Ray's default
        if place is not None:
            self.host = place.pod.ip
            self.gcs, self.dashboard, self.client, self.agent, self.serve = (
                POD_HEAD_PORTS[k] for k in ("gcs", "dashboard", "client", "agent", "serve")
            )
            self.workers = POD_WORKER_PORTS
        else:
            self.host = "127.0.0.1"
            self.gcs, self.dashboard, self.client, self.agent = (
                free_port(),
                free_port(),
                free_port(),
                free_port(),
            )
            self.serve = free_port()  # for Serve's HTTP proxy: Serve binds it once a config names it
            # one allocator, so the worker range never overlaps the ports above; the reservations
            # belong to this (test) process, not to the head, so they stay ours across a head restart
            self.workers = free_port_range(100)
        self.pid: int | None = None
        self.starts = 0
        self.temps: list[Path] = []
        self._tree = StartedTree()

    @property
    def address(self) -> str:
        return f"http://{self.host}:{self.dashboard}"

    @property
    def gcs_address(self) -> str:
        """What a worker node's ``ray start --address`` names."""
        return f"{self.host}:{self.gcs}"

    @property
    def serve_address(self) -> str:
        return f"http://{self.host}:{self.serve}"

    def settings(self) -> RaySettings:
        """How a dispatcher reaches this head: its Jobs API, Serve's proxy, the runner's credential."""
        return RaySettings(
            address=self.address, serve_address=self.serve_address, runner_token=SecretStr(self.runner_token)
        )

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` where the head's addresses are reachable (on the pod's node, or here)."""
        return fn() if self.place is None else self.place.call(fn)

    def start(self, timeout: float = 180, attempts: int = 3) -> None:
        """Start the head on its ports; return once its Jobs API answers and it lists itself ALIVE
        (the Jobs API answers some seconds before the node has registered, more on a loaded machine).
        A ``ray start`` that gives up (see :class:`StartedTree`) is stopped with what it left and
        started again, ``attempts`` times in all."""
        start_in_attempts(lambda: self._start_once(timeout), self.stop, attempts)

    def _start_once(self, timeout: float) -> None:
        self.starts += 1
        temp = Path("/tmp") / f"llmbatch-pray-{os.getpid()}-{secrets.token_hex(3)}"
        temp.mkdir(parents=True, exist_ok=True)
        self.temps.append(temp)
        log = self.run_dir / f"ray-{self.starts}.log"
        env = {
            "RAY_AUTH_MODE": "disabled",
            "RAY_USAGE_STATS_ENABLED": "0",
            "PYTHONUNBUFFERED": "1",
            **QUIET_LOG_MONITOR_ENV,
            **QUIET_SERVE_ENV,
            # stopped only at a test's end: no drain first (as the local stack's head); a pod's head
            # keeps the environment its manifest gives it
            **(ONE_NODE_STOP_ENV if self.place is None else {}),
            **self.node_env,
        }
        if self.auth_token is not None:
            env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.auth_token)
        env.update(self.env)
        argv = [
            str(ray_executable()),
            "start",
            "--head",
            "--block",
            f"--num-cpus={self.num_cpus}",
            f"--port={self.gcs}",
            f"--node-ip-address={self.host}",
            # in a pod, as KubeRay's head: every address of the pod (and nothing else is on it)
            f"--dashboard-host={'127.0.0.1' if self.place is None else '0.0.0.0'}",
            f"--dashboard-port={self.dashboard}",
            "--include-dashboard=true",
            f"--dashboard-agent-listen-port={self.agent}",
            f"--ray-client-server-port={self.client}",
            f"--min-worker-port={self.workers}",
            f"--max-worker-port={self.workers + 99}",
            "--object-store-memory=500000000",
            f"--temp-dir={temp}",
            "--disable-usage-stats",
            *self.start_args,
        ]
        if self.resources is not None:
            argv.append(f"--resources={json.dumps(self.resources)}")
        self.pid = spawn(argv if self.place is None else self.place.command(argv), log, env=env)
        try:
            wait_until(
                self._tree.checking(self.pid, lambda: self.call(self._ready)),
                timeout,
                self.pid,
                "private Ray head",
                log,
                interval=1.0,
            )
        except StackError:
            keep_session_logs(temp, self.run_dir / f"ray-{self.starts}")
            raise

    def _auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.auth_token}"} if self.auth_token else {}

    def _ready(self) -> bool:
        """The Jobs API answers, the head lists itself ALIVE and the Ray Client server listens.

        The last one because ``ray start --block`` stops the whole head when any of its processes
        exits, and the Ray Client server does when the node has not registered within its own 30 s
        (a loaded machine): the head then dies a second after it listed itself ALIVE. The server
        binds its port only once it found the node, so a listening port means that danger is over."""
        request = urllib.request.Request(f"{self.address}/api/jobs/", headers=self._auth_headers())
        with urllib.request.urlopen(request, timeout=3) as resp:
            if int(resp.status) != 200:
                return False
        if not any(n["is_head_node"] and n["state"] == "ALIVE" for n in self.nodes()):
            return False
        return port_open(self.client, self.host)

    def stop(self, timeout: float = 20) -> None:
        """Stop the head by PID (:func:`stop_tree`: ``ray start`` stops its own processes first, then
        what is left gets SIGTERM), SIGKILL what is left after ``timeout`` seconds."""
        if self.pid is not None:
            stop_tree(self.pid, timeout=timeout)
            self.pid = None
        self._tree.stop()

    def remove_temp(self) -> None:
        """Delete Ray's temp dirs of every start (session logs, sockets); call after :meth:`stop`."""
        for temp in self.temps:
            shutil.rmtree(temp, ignore_errors=True)
        self.temps.clear()

    def nodes(self) -> list[dict[str, Any]]:
        """The cluster's nodes as the state API reports them (``node_id``, ``is_head_node``,
        ``state``, ``resources_total``, ...), dead ones included."""
        url = f"{self.address}/api/v0/nodes?limit=100&detail=true"
        request = urllib.request.Request(url, headers=self._auth_headers())

        def fetch() -> Any:
            with urllib.request.urlopen(request, timeout=10) as resp:
                return json.loads(resp.read())

        rows: list[dict[str, Any]] = self.call(fetch)["data"]["result"]["result"]
        return rows


class PrivateRayWorker:
    """A worker node of a :class:`PrivateRay` head on this machine: ``ray start --address=<gcs>
    --block`` with its own ports, CPUs, custom resources and temp dir (Ray allows one per node).

    :meth:`start` returns once the head lists the node ALIVE; :attr:`node_id` is its id."""

    def __init__(
        self,
        head: PrivateRay,
        run_dir: Path,
        *,
        num_cpus: int = 1,
        resources: dict[str, float] | None = None,
        name: str = "worker",
        node_env: dict[str, str] | None = None,
        start_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        place: PodPlace | None = None,
    ) -> None:
        self.head = head
        self.place = place  # None: this machine's network (see PrivateRay)
        self.host = "127.0.0.1" if place is None else place.pod.ip
        self.start_args = list(start_args)  # more ``ray start`` options, e.g. ``--num-gpus=1``
        self.env = dict(env or {})  # more environment for the node's processes
        # what its jobs and replicas find in their environment: the head's unless given (a tenant
        # pool's node carries that tenant's own S3 keys)
        self.node_env = dict(head.node_env if node_env is None else node_env)
        self.run_dir = run_dir
        self.num_cpus = num_cpus
        self.resources = dict(resources or {})
        self.name = name
        self.attempts = 0
        self.pid: int | None = None
        self.node_id: str | None = None
        self.temp: Path | None = None
        self.log = run_dir / f"ray-{name}.log"
        self.agent_port: int | None = None
        self._tree = StartedTree()

    def start(self, timeout: float = 120, attempts: int = 3) -> str:
        """Start the node; return its node id once the head reports it ALIVE.

        A ``ray start`` that gives up (see :class:`StartedTree`), which happens on a machine loaded by
        other work, is stopped with its leftovers and started again, ``attempts`` times in all."""
        return start_in_attempts(lambda: self._start_once(timeout), self.stop, attempts)

    def _start_once(self, timeout: float) -> str:
        self.temp = Path("/tmp") / f"llmbatch-prayw-{os.getpid()}-{secrets.token_hex(3)}"
        self.temp.mkdir(parents=True, exist_ok=True)
        self.attempts += 1
        # the ports Ray would otherwise pick itself (the agent's 52365 default is shared machine-wide),
        # new ones each attempt: nothing depends on a worker node's ports, and a port some other
        # process took meanwhile would fail every attempt alike
        node_manager, object_manager, agent, agent_grpc, metrics, runtime_env_agent = (
            free_port() for _ in range(6)
        )
        workers = free_port_range(50)
        self.agent_port = agent  # the dashboard agent's HTTP port (its /api/healthz)
        before = {n["node_id"] for n in self.head.nodes()}
        env = {
            "RAY_AUTH_MODE": "disabled",
            "RAY_USAGE_STATS_ENABLED": "0",
            "PYTHONUNBUFFERED": "1",
            **QUIET_LOG_MONITOR_ENV,
            **QUIET_SERVE_ENV,
            **(ONE_NODE_STOP_ENV if self.place is None else {}),  # as the head above
            **self.node_env,
        }
        if self.head.auth_token is not None:
            env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.head.auth_token)
        env.update(self.env)
        argv = [
            str(ray_executable()),
            "start",
            f"--address={self.head.gcs_address}",
            "--block",
            f"--num-cpus={self.num_cpus}",
            f"--resources={json.dumps(self.resources)}",
            f"--node-ip-address={self.host}",
            f"--node-manager-port={node_manager}",
            f"--object-manager-port={object_manager}",
            f"--dashboard-agent-listen-port={agent}",
            f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--metrics-export-port={metrics}",
            f"--runtime-env-agent-port={runtime_env_agent}",
            f"--min-worker-port={workers}",
            f"--max-worker-port={workers + 49}",
            "--object-store-memory=200000000",
            f"--temp-dir={self.temp}",
            "--disable-usage-stats",
            *self.start_args,
        ]
        self.node_id = None
        self.pid = spawn(argv if self.place is None else self.place.command(argv), self.log, env=env)
        try:
            wait_until(
                self._tree.checking(self.pid, lambda: self._joined(before)),
                timeout,
                self.pid,
                f"Ray {self.name} node",
                self.log,
                interval=0.5,
            )
        except StackError:
            keep_session_logs(self.temp, self.run_dir / f"ray-{self.name}-attempt-{self.attempts}")
            raise
        assert self.node_id is not None
        return self.node_id

    def _joined(self, before: set[str]) -> bool:
        new = [
            n
            for n in self.head.nodes()
            if n["node_id"] not in before and not n["is_head_node"] and n["state"] == "ALIVE"
        ]
        if len(new) == 1:
            self.node_id = str(new[0]["node_id"])
        return self.node_id is not None

    def stop(self, timeout: float = 20) -> None:
        """Stop the node's process tree by PID (before the head's), then delete its temp dir.

        Processes of the tree seen during start-up that outlived their parent are stopped too."""
        if self.pid is not None:
            stop_tree(self.pid, timeout=timeout)
            self.pid = None
        self._tree.stop()
        if self.temp is not None:
            shutil.rmtree(self.temp, ignore_errors=True)
            self.temp = None
