"""CPU time spent by a process and everything it started: where the suite's CPU goes.

The suite is CPU-bound on 2 cores, so a test's wall time says little about what it costs: a test that
waits on a fake engine is long and cheap, one that starts a vLLM engine is costly in any order. Each test
is charged the CPU its pytest process and everything that process started (the local stack, Ray's
workers and job drivers, engines) used from the end of the previous test's report to the end of its own.

Two ways to count, the first that works:

- a CPU-accounting cgroup of its own (cgroup v1 ``cpuacct`` or v2 ``cpu.stat``) that the process moves
  into: it counts every descendant, exited ones included, whoever reaps them;
- the process tree (:func:`tree_cpu_seconds`): live descendants plus the children their parents reaped.
  A lower bound: Ray's raylet ignores SIGCHLD, so the kernel drops the times of every Ray worker that
  exits (job supervisors, actors, replicas), about half of the suite's CPU.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

import psutil

CGROUP_ROOT = Path("/sys/fs/cgroup")


def tree_cpu_seconds(pid: int | None = None) -> float:
    """User + system seconds of ``pid`` (default: this process), its live descendants and reaped children."""
    root = psutil.Process(pid if pid is not None else os.getpid())
    total = 0.0
    procs = [root]
    with contextlib.suppress(psutil.Error):
        procs += root.children(recursive=True)
    for proc in procs:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue  # exited between the listing and the read: its parent counts it once reaped
        total += times.user + times.system + times.children_user + times.children_system
    return total


class CpuCgroup:
    """A CPU-accounting cgroup this process moves into (its children follow it): every second any of
    them ever ran is counted. :meth:`join` returns None where no such cgroup can be made."""

    def __init__(self, path: Path, home: Path, usage: Callable[[Path], float]) -> None:
        self.kind = "cgroup v1 cpuacct" if usage is _v1_usage else "cgroup v2 cpu.stat"
        self.path = path
        self.home = home  # the cgroup the process came from, to go back to
        self._usage = usage

    @classmethod
    def join(cls, name: str, root: Path = CGROUP_ROOT) -> CpuCgroup | None:
        for hierarchy, controller, usage in (
            (root / "cpuacct", "cpuacct", _v1_usage),
            (root / "unified", "", _v2_usage),
            (root, "", _v2_usage),
        ):
            if not (hierarchy / ("cpuacct.usage" if controller else "cpu.stat")).exists():
                continue
            home = hierarchy / _own_cgroup(controller).lstrip("/")
            path = home / name
            try:
                path.mkdir(exist_ok=True)
                (path / "cgroup.procs").write_text(f"{os.getpid()}\n")
                usage(path)
            except OSError:
                with contextlib.suppress(OSError):
                    path.rmdir()
                continue
            return cls(path, home, usage)
        return None

    def seconds(self) -> float:
        return self._usage(self.path)

    def leave(self) -> None:
        """Move back to the cgroup this process came from; remove the cgroup once nothing runs in it."""
        with contextlib.suppress(OSError):
            (self.home / "cgroup.procs").write_text(f"{os.getpid()}\n")
        # children first (a test's own cgroup left behind by a crash): rmdir is refused while a process
        # started by the tests still runs in one of them, and then the rest stays too
        for path in sorted((p for p in self.path.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                path.rmdir()
        with contextlib.suppress(OSError):
            self.path.rmdir()


def _own_cgroup(controller: str) -> str:
    """This process's cgroup path in the hierarchy of ``controller`` ("" for cgroup v2)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (controller and controller in controllers.split(",")) or (not controller and controllers == ""):
            return path
    return "/"


def _v1_usage(path: Path) -> float:
    return int((path / "cpuacct.usage").read_text()) / 1e9


def _v2_usage(path: Path) -> float:
    for line in (path / "cpu.stat").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "usage_usec":
            return int(value) / 1e6
    raise OSError(f"no usage_usec in {path / 'cpu.stat'}")


class CpuMeter:
    """Hands out the CPU seconds used by a process and all it started since the previous reading:
    through a :class:`CpuCgroup` when given one, else by the process tree of ``pid``."""

    def __init__(self, pid: int | None = None, cgroup: CpuCgroup | None = None) -> None:
        self.pid = pid
        self.cgroup = cgroup
        self._last = self._read()

    @property
    def source(self) -> str:
        if self.cgroup is not None:
            return f"a cgroup of each pytest process's own ({self.cgroup.kind})"
        return "each pytest process's tree (a lower bound: Ray workers that exited are lost)"

    def _read(self) -> float:
        return self.cgroup.seconds() if self.cgroup is not None else tree_cpu_seconds(self.pid)

    def take(self) -> float:
        now = self._read()
        # a descendant that exits unreaped (or re-parented) takes its seconds with it: never below zero
        spent, self._last = max(0.0, now - self._last), now
        return spent


def machine_busy_seconds() -> float:
    """CPU seconds every core of the machine spent on anything but idling or waiting on I/O since boot."""
    times = psutil.cpu_times()
    # guest time is already inside user time in /proc/stat
    not_busy = ("idle", "iowait", "guest", "guest_nice")
    return sum(times) - sum(getattr(times, name, 0.0) for name in not_busy)
