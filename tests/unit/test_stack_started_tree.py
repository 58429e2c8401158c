"""StartedTree: the children a start-up left behind when its parent gave up are stopped too (a ``ray
start`` that gives up exits before its GCS and dashboard, which kept answering in CI)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from llmbatch.stack.process import StartedTree, alive, spawn

pytestmark = pytest.mark.unit

# a parent that starts a child in its own process and then exits, as `ray start` does when it gives up
PARENT = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
time.sleep(1.5)
"""


def test_children_that_outlive_their_parent_are_stopped(tmp_path: Path) -> None:
    tree = StartedTree()
    parent = spawn([sys.executable, "-c", PARENT], tmp_path / "parent.log")
    end = time.monotonic() + 30
    seen_both = tree.checking(parent, lambda: len(tree.procs) >= 2)  # as wait_until polls it
    while not seen_both() and time.monotonic() < end:
        time.sleep(0.05)
    children = [pid for pid in tree.procs if pid != parent]
    assert len(children) == 1, tree.procs
    (child,) = children
    while alive(parent) and time.monotonic() < end:  # the parent gives up and exits
        time.sleep(0.1)
    assert not alive(parent) and alive(child)

    tree.stop()

    assert not alive(child)
    assert tree.procs == {}
