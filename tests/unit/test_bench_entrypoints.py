"""Every benchmark script is an entrypoint: its ``--help`` exits 0 without starting anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

BENCH = Path(__file__).resolve().parents[2] / "bench"


def run_bench(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``bench/<script> args...`` in a fresh interpreter, its output captured."""
    return subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("bench_*.py")))
def test_help_exits_0(script: str) -> None:
    result = run_bench(script, "--help")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout


@pytest.mark.parametrize(("option", "value"), [("--skip", "plian"), ("--background", "nice20")])
def test_bench_service_refuses_an_unknown_phase_or_scheduling_naming_it(option: str, value: str) -> None:
    # --small 0 would fail later with another message: the unknown value is refused first
    result = run_bench("bench_service.py", option, value, "--small", "0")
    assert result.returncode == 2
    assert f"{option}: unknown ['{value}']; choose from" in result.stderr, result.stderr[-2000:]


def test_bench_service_refuses_plain_cpus_this_machine_does_not_give_it() -> None:
    result = run_bench("bench_service.py", "--plain-cpus", "4096", "--small", "0")
    assert result.returncode == 2
    assert "--plain-cpus: [4096] not among this process' CPUs" in result.stderr, result.stderr[-2000:]


def test_bench_service_refuses_zero_engine_replicas() -> None:
    result = run_bench("bench_service.py", "--max-replicas", "0")
    assert result.returncode == 2
    assert "sizes and --max-replicas must be at least 1" in result.stderr, result.stderr[-2000:]


def test_bench_engine_env_refuses_an_unknown_variant_naming_the_split_ones() -> None:
    result = run_bench("bench_engine_env.py", "--variants", "split3x1")
    assert result.returncode == 2
    assert "unknown variants ['split3x1']" in result.stderr, result.stderr[-2000:]
    assert "split2x1" in result.stderr, result.stderr[-2000:]
