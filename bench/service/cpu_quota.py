"""A CPU quota for one process of a bench (a cgroup v1 ``cpu`` group of its own; needs root).

What makes "one more replica" mean "one more machine's worth of CPU" on a 2-core box: each dispatcher
replica gets e.g. 0.25 of a core, so their sum stays below what the machine has and the replicas'
count, not the machine, bounds the throughput. Removed (after its processes ended) by :meth:`remove`.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from bench.service.common import BenchError

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


class CpuQuota:
    """A cgroup holding the processes given to :meth:`add`, at most ``cores`` cores between them."""

    def __init__(self, name: str, cores: float) -> None:
        if not 0.01 <= cores <= (os.cpu_count() or 1):
            raise BenchError(f"a CPU quota of {cores:g} cores is outside 0.01 .. the machine's cores")
        if not (CPU_ROOT / "cgroup.procs").is_file():
            raise BenchError(f"no cgroup v1 cpu controller at {CPU_ROOT}: run without a CPU quota")
        self.path = CPU_ROOT / name
        try:
            self.path.mkdir()
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(int(cores * PERIOD_US)))
        except OSError as exc:
            raise BenchError(f"cannot make the cgroup {self.path} (a CPU quota needs root): {exc}") from exc

    def add(self, pid: int) -> None:
        """Move process ``pid`` (and the threads it starts from now on) into the group."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def throttled_s(self) -> float:
        """How long the group's processes waited for their quota (``cpu.stat``'s ``throttled_time``)."""
        for line in (self.path / "cpu.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "throttled_time":
                return int(value) / 1e9
        return 0.0

    def remove(self) -> None:
        """Remove the group once its processes ended (a group with a process in it cannot go)."""
        for _ in range(50):
            with contextlib.suppress(OSError):
                self.path.rmdir()
                return
            time.sleep(0.1)
