"""The faults the chaos suite injects: kill -9 of a process, then (for a service) a restart on the same
ports with the same data, as a crashed pod comes back. Each returns one line for the run's log."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmbatch.chaos.kafka_cluster import KafkaCluster
from llmbatch.chaos.processes import DispatcherProcess
from llmbatch.chaos.proxy import FaultProxy
from llmbatch.stack import manager
from llmbatch.stack.process import alive
from llmbatch.stack.state import StackState

FAULT_KINDS = (
    "dispatcher",
    "driver",
    "runner",
    "redis",
    "kafka",
    "minio",
    "ray",
    "pause",
    "runner_pause",
    "redis_partition",
    "minio_reset",
    "redis_rollback",
    "kafka_leader",
)
"""What can be killed: dispatcher replicas, a running job's driver, the shared engines' batch runner
replica, and each service of the stack (the Ray head with its whole process tree, as a head pod dies);
and what can be frozen (SIGSTOP, then SIGCONT): the tracker's leader (``pause``: a long GC pause, a VM
stalled; its lease expires and another replica leads meanwhile) and the batch runner's replicas
(``runner_pause``: a runner that takes requests and answers none); and the network to a service cut
through its :class:`~llmbatch.chaos.proxy.FaultProxy`: ``redis_partition`` (the dispatchers'
connections to Redis hang; the Ray side's stay up) and ``minio_reset`` (every connection to MinIO
reset, uploads in the middle of their writes included, and new ones too), each for ``pause_s``;
``kafka_leader``: on a run with a Kafka cluster, the broker leading the requests topic's first
partition killed; and ``redis_rollback``: Redis restored from a copy of its data taken ``pause_s``
earlier (a restore of an older snapshot, a failover to a replica that
lagged), so terminal batches may reappear running and writes since are gone."""

PROXIED = {"redis_partition": "redis", "minio_reset": "minio"}
"""The faults that need their service behind a proxy, and that service."""

RUNNER_ONLY = ("runner", "runner_pause")
RUNNER_WAIT_S = 180.0  # a runner fault waits this long for a replica (starting, or back after a head fault)


def default_faults(shared_engines: bool, kafka_brokers: int = 1) -> tuple[str, ...]:
    """Every fault that can hit a run's batches: the batch runner's replicas on the shared engines'
    short path, a job's driver on the Ray-job path (the others never run there); the one broker of the
    stack killed, or the leader of a partition of a cluster of ``kafka_brokers``."""
    left_out: tuple[str, ...] = ("driver",) if shared_engines else RUNNER_ONLY
    left_out += ("kafka",) if kafka_brokers > 1 else ("kafka_leader",)
    return tuple(kind for kind in FAULT_KINDS if kind not in left_out)


async def kill9(pid: int, within: float = 30.0) -> None:
    """SIGKILL ``pid`` and wait until it is gone (reaped when it is this process's child)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    while loop.time() < end:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # noqa: ASYNC222 (WNOHANG: never blocks)
        if not alive(pid):
            return
        await asyncio.sleep(0.1)


async def kill9_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process under it (Ray's raylet, GCS and workers set up process
    groups of their own, so one killpg would miss some)."""
    import psutil

    try:
        root = psutil.Process(pid)
        tree = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for proc in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    for proc in tree:
        await kill9(proc.pid)


async def _frozen(pids: list[int], seconds: float) -> None:
    """SIGSTOP ``pids``, wait ``seconds``, SIGCONT them (always, even when the wait is cancelled)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(seconds)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _copy_tree(source: Path, target: Path) -> None:
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target)


@dataclass
class Faults:
    """Injects faults into one chaos run: its stack (``run_dir``) and its dispatcher replicas."""

    run_dir: Path
    replicas: list[DispatcherProcess]
    ray_address: str
    job_prefix: str
    down_s: float = 3.0  # how long a killed service stays down before its restart
    pause_s: float = 10.0  # how long a paused process stays stopped
    proxies: dict[str, FaultProxy] = field(default_factory=dict)  # service -> its proxy
    kafka: KafkaCluster | None = None  # a run on a Kafka cluster rather than the stack's broker
    requests_topic: str = ""
    counts: dict[str, int] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)
    _next_replica: int = 0

    async def inject(self, kind: str) -> str:
        """Kill one ``kind`` (and bring it back); returns what was done."""
        if kind == "dispatcher":
            line = await self._dispatcher()
        elif kind == "driver":
            line = await self._driver()
        elif kind == "runner":
            line = await self._runner()
        elif kind == "pause":
            line = await self._pause_leader()
        elif kind == "runner_pause":
            line = await self._pause_runner()
        elif kind in PROXIED:
            line = await self._cut(kind, PROXIED[kind])
        elif kind == "redis_rollback":
            line = await self._rollback()
        elif kind == "kafka_leader":
            line = await self._kafka_leader()
        elif kind in manager.RESTARTABLE:
            line = await self._service(kind)
        else:
            raise ValueError(f"unknown fault {kind!r}: one of {', '.join(FAULT_KINDS)}")
        if not line.startswith("skipped"):
            self.counts[kind] = self.counts.get(kind, 0) + 1
        self.log.append(f"{kind}: {line}")
        return line

    async def _dispatcher(self) -> str:
        victim = self.replicas[self._next_replica % len(self.replicas)]
        self._next_replica += 1
        pid = victim.pid
        await kill9(pid)
        await asyncio.sleep(self.down_s)
        victim.start()
        return f"killed replica pid {pid}, restarted as pid {victim.pid}"

    async def _pause_leader(self) -> str:
        """SIGSTOP the replica that leads the tracker (by its own /readyz) for ``pause_s``, then
        SIGCONT: it wakes up believing it still leads, with a lease that expired meanwhile."""
        leader = await asyncio.to_thread(self._leader)
        if leader is None:
            return "skipped: no replica said it leads the tracker"
        pid = leader.pid
        await _frozen([pid], self.pause_s)
        return f"paused the tracker's leader pid {pid} for {self.pause_s:g} s"

    def _leader(self) -> DispatcherProcess | None:
        import urllib.request

        for replica in self.replicas:
            port = getattr(getattr(replica.settings, "dispatcher", None), "metrics_port", None)
            if not replica.alive() or not port:
                continue
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as reply:
                    text = reply.read().decode(errors="replace")
            except OSError as exc:  # 503 (not ready) is an HTTPError, an OSError: its body still says
                text = exc.read().decode(errors="replace") if hasattr(exc, "read") else ""
            if "tracker: leader" in text.splitlines():
                return replica
        return None

    async def _pause_runner(self) -> str:
        """SIGSTOP every batch-runner replica for ``pause_s``, then SIGCONT: the dispatcher gets no
        answer (an outage: its runs are unknown, never lost), then the same runs again."""
        pids = await _wait_runner_pids(self.ray_address)
        if not pids:
            return f"skipped: no batch runner replica ran within {RUNNER_WAIT_S:.0f} s"
        await _frozen(pids, self.pause_s)
        return f"paused the batch runner's replicas {pids} for {self.pause_s:g} s"

    async def _cut(self, kind: str, service: str) -> str:
        proxy = self.proxies.get(service)
        if proxy is None:
            return f"skipped: {service} is not behind a proxy in this run"
        proxy.partition() if kind == "redis_partition" else proxy.reset()
        try:
            await asyncio.sleep(self.pause_s)
        finally:
            proxy.heal()
        what = (
            "partitioned from the dispatchers" if kind == "redis_partition" else "resetting every connection"
        )
        return f"{service} {what} for {self.pause_s:g} s"

    async def _kafka_leader(self) -> str:
        """kill -9 the broker leading the requests topic's partition 0; back after ``down_s``."""
        if self.kafka is None:
            return "skipped: this run has one broker (no cluster)"
        leader = await self.kafka.leader_of(self.requests_topic, 0)
        if leader is None:
            return f"skipped: no leader of {self.requests_topic}[0] known"
        pid = leader.pid
        await kill9(pid)
        await asyncio.sleep(self.down_s)
        await asyncio.to_thread(self.kafka.restart, leader)
        led = f"{self.requests_topic}[0]"
        return f"killed broker {leader.node_id} (pid {pid}), leader of {led}; back as pid {leader.pid}"

    async def _rollback(self) -> str:
        """Copy Redis's data (killed for it: a consistent copy), let the run go on ``pause_s``, then
        kill Redis again and bring it back from that copy."""
        rec = StackState.load(self.run_dir).services["redis"]
        data, copy = Path(rec.data_dir), self.run_dir / "redis-snapshot"
        await kill9(rec.pid)
        await asyncio.to_thread(_copy_tree, data, copy)
        again = await asyncio.to_thread(manager.start_again, self.run_dir, "redis")
        await asyncio.sleep(self.pause_s)  # batches launch, end and publish meanwhile
        await kill9(again.pid)
        await asyncio.to_thread(_copy_tree, copy, data)
        back = await asyncio.to_thread(manager.start_again, self.run_dir, "redis")
        return f"restored Redis to its data of {self.pause_s:g} s before (pid {back.pid})"

    async def _service(self, name: str) -> str:
        state = StackState.load(self.run_dir)
        rec = state.services[name]
        await (kill9_tree(rec.pid) if name == "ray" else kill9(rec.pid))
        await asyncio.sleep(self.down_s)
        again = await asyncio.to_thread(manager.start_again, self.run_dir, name)
        return f"killed pid {rec.pid}, back on {again.address} as pid {again.pid}"

    async def _driver(self, within: float = 60.0) -> str:
        """kill -9 the driver of one running Ray job of this run (the job fails; the batch is retried),
        waiting up to ``within`` seconds for one to run."""
        loop = asyncio.get_running_loop()
        end = loop.time() + within
        running = await asyncio.to_thread(self._running_drivers)
        while not running and loop.time() < end:
            await asyncio.sleep(1)
            running = await asyncio.to_thread(self._running_drivers)
        if not running:
            return f"skipped: no job of this run ran within {within:.0f} s"
        sid, pid = running[0]
        await kill9(pid)
        return f"killed the driver of {sid} (pid {pid})"

    async def _runner(self) -> str:
        """kill -9 the batch runner's replica (shared engines: Serve starts another, the runs it had
        are lost and the dispatcher runs those batches again), waiting for one to run."""
        pids = await _wait_runner_pids(self.ray_address)
        if not pids:
            return f"skipped: no batch runner replica ran within {RUNNER_WAIT_S:.0f} s"
        await kill9(pids[0])
        return f"killed the batch runner replica (pid {pids[0]})"

    def _running_drivers(self) -> list[tuple[str, int]]:
        from ray.job_submission import JobSubmissionClient

        out: list[tuple[str, int]] = []
        for job in JobSubmissionClient(self.ray_address).list_jobs():
            info: Any = job.driver_info
            sid = job.submission_id or ""
            if str(job.status) == "RUNNING" and sid.startswith(self.job_prefix) and info and info.pid:
                out.append((sid, int(info.pid)))
        return out


async def _wait_runner_pids(ray_address: str) -> list[int]:
    """The batch runner's running replicas, waiting up to :data:`RUNNER_WAIT_S` for one (none then):
    the dispatcher deploys the runner as it starts and again after a fault of Ray's head, and on a
    busy machine a replica takes a while to start."""
    from llmbatch.dispatcher.backends.engines import runner_pids
    from llmbatch.dispatcher.backends.serve_api import ServeApi
    from llmbatch.dispatcher.errors import DispatcherError

    api = ServeApi(ray_address)
    deadline = asyncio.get_running_loop().time() + RUNNER_WAIT_S
    while True:
        with contextlib.suppress(DispatcherError):
            if pids := runner_pids(await api.status()):
                return pids
        if asyncio.get_running_loop().time() >= deadline:
            return []
        await asyncio.sleep(1.0)
