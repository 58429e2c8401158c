"""Every entrypoint of the product answers ``--help`` with its usage and exit 0, and nothing else (no
error line, no result line): `python -m` of each unit that runs, and the console scripts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
MODULES = [
    "llmbatch",
    "llmbatch.cli",
    "llmbatch.ray_job",
    "llmbatch.dispatcher",
    "llmbatch.api",
    "llmbatch.producer.cli",
    "llmbatch.demo",
    "llmbatch.docs",
    "llmbatch.chaos",
    "llmbatch.schemas.generate",
    "llmbatch.stack.tls_front",
    "llmbatch.stack.vllm_check",
]


@pytest.mark.parametrize("module", MODULES)
def test_help_exits_0_with_the_usage_only(module: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "usage" in done.stdout.lower(), done.stdout
    said = done.stdout + done.stderr
    assert "ERROR" not in said and "LLMBATCH_RESULT" not in said, said
