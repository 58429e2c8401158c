"""A batch-runner replica imports its tokenizers' machinery as it starts, not in its first batch."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

CHILD = """
import sys, threading
from llmbatch.ray_job.batch_runner.run_store import MemoryRuns
from llmbatch.ray_job.batch_runner.runner import BatchRunner

auto = "transformers.models.auto.tokenization_auto"
assert auto not in sys.modules, "imported before the runner starts"
BatchRunner(runs=MemoryRuns())  # a replica starting; no batch yet
for thread in threading.enumerate():
    if thread.name == "runner-preload":
        thread.join()
print(auto in sys.modules)
"""


def test_a_starting_replica_imports_what_its_first_tokenizer_needs() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "True"
