"""CPU time spent by a process and everything it started: where the suite's CPU goes.

The suite is CPU-bound on 2 cores, so a test's wall time says little about what it costs: a test that
waits on a fake engine is long and cheap, one that starts a vLLM engine is costly in any order. Each test
is charged the CPU its pytest process and that process's descendants (the local stack it started, Ray's
workers and job drivers, engines) used from the end of the previous test's report to the end of its own.

Descendants that exit are counted through their parent's ``children_*`` times once reaped; a process
that outlives its parent and is re-parented elsewhere is not counted any more.
"""

from __future__ import annotations

import contextlib
import os

import psutil


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


class CpuMeter:
    """Hands out the CPU seconds used by the process tree since the previous reading."""

    def __init__(self, pid: int | None = None) -> None:
        self.pid = pid
        self._last = tree_cpu_seconds(pid)

    def take(self) -> float:
        now = tree_cpu_seconds(self.pid)
        # a descendant that exits unreaped (or re-parented) takes its seconds with it: never below zero
        spent, self._last = max(0.0, now - self._last), now
        return spent


def machine_busy_seconds() -> float:
    """CPU seconds every core of the machine spent on anything but idling or waiting on I/O since boot."""
    times = psutil.cpu_times()
    # guest time is already inside user time in /proc/stat
    not_busy = ("idle", "iowait", "guest", "guest_nice")
    return sum(times) - sum(getattr(times, name, 0.0) for name in not_busy)
