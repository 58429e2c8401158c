"""The suite's CPU accounting charges a test what its process tree burned, reaped children included."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.cpu_account import CpuMeter, machine_busy_seconds, tree_cpu_seconds

pytestmark = pytest.mark.unit

BURN = "import time\nend = time.process_time() + {s}\nwhile time.process_time() < end: pass\n"


def test_a_live_grandchild_is_counted() -> None:
    """A child that starts a grandchild which burns CPU: the tree's total grows by the grandchild's burn."""
    inner = BURN.format(s=0.6)
    outer = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {inner!r}])\nprint('done')\n"
    child = subprocess.Popen([sys.executable, "-c", outer], stdout=subprocess.PIPE, text=True)
    try:
        before = tree_cpu_seconds()
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "done"  # the grandchild is reaped by the child
        during = tree_cpu_seconds()  # the child is alive and carries the grandchild's seconds
    finally:
        child.wait(timeout=30)
    assert during - before >= 0.5


def test_the_meter_hands_out_each_second_once() -> None:
    meter = CpuMeter()
    subprocess.run([sys.executable, "-c", BURN.format(s=0.5)], check=True)
    first = meter.take()
    second = meter.take()
    assert first >= 0.45
    assert second < 0.2  # only the meter's own reading since the first take


def test_an_other_process_tree_is_not_counted() -> None:
    """A burn in a process that is not our descendant is not charged to us."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        meter = CpuMeter(sleeper.pid)
        subprocess.run([sys.executable, "-c", BURN.format(s=0.4)], check=True)  # our child, not the sleeper's
        assert meter.take() < 0.2
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_machine_counts_a_burn_in_any_process() -> None:
    before = machine_busy_seconds()
    subprocess.run([sys.executable, "-c", BURN.format(s=0.5)], check=True)
    assert machine_busy_seconds() - before >= 0.45
