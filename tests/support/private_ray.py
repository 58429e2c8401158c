"""A private Ray head that can be killed and started again on the SAME ports (a head restart as a
KubeRay head pod restart looks to clients: same address, no job records). Stopped by PID only."""

from __future__ import annotations

import os
import secrets
import urllib.request
from pathlib import Path

from llmbatch.stack.process import free_port, free_port_range, spawn, stop_tree, wait_until
from llmbatch.stack.services import ray_executable


class PrivateRay:
    def __init__(self, run_dir: Path, num_cpus: int = 2) -> None:
        self.run_dir = run_dir
        self.num_cpus = num_cpus
        self.gcs, self.dashboard, self.client, self.agent = free_port(), free_port(), free_port(), free_port()
        # one allocator, so the worker range never overlaps the ports above; the reservations belong
        # to this (test) process, not to the head, so they stay ours across a head restart
        self.workers = free_port_range(100)
        self.pid: int | None = None
        self.starts = 0

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard}"

    def start(self, timeout: float = 180) -> None:
        self.starts += 1
        temp = Path("/tmp") / f"llmbatch-pray-{os.getpid()}-{secrets.token_hex(3)}"
        temp.mkdir(parents=True, exist_ok=True)
        log = self.run_dir / f"ray-{self.starts}.log"
        env = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
        argv = [
            str(ray_executable()),
            "start",
            "--head",
            "--block",
            f"--num-cpus={self.num_cpus}",
            f"--port={self.gcs}",
            "--node-ip-address=127.0.0.1",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={self.dashboard}",
            "--include-dashboard=true",
            f"--dashboard-agent-listen-port={self.agent}",
            f"--ray-client-server-port={self.client}",
            f"--min-worker-port={self.workers}",
            f"--max-worker-port={self.workers + 99}",
            "--object-store-memory=500000000",
            f"--temp-dir={temp}",
            "--disable-usage-stats",
        ]
        self.pid = spawn(argv, log, env=env)
        wait_until(self._ready, timeout, self.pid, "private Ray head", log, interval=1.0)

    def _ready(self) -> bool:
        with urllib.request.urlopen(f"{self.address}/api/jobs/", timeout=3) as resp:
            return int(resp.status) == 200

    def stop(self) -> None:
        if self.pid is not None:
            stop_tree(self.pid, timeout=20)
            self.pid = None
