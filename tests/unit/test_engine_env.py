"""The engine environment: where a CPU engine runs (in the caller's process unless threads are pinned),
at which priority."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmbatch.ray_job.engines.engine_env import engine_env

pytestmark = pytest.mark.unit


def test_a_cpu_engine_runs_in_the_callers_process(tmp_path: Path) -> None:
    env = engine_env(tmp_path)
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_pinned_threads_keep_vllms_processes(tmp_path: Path) -> None:
    # vLLM pins OpenMP threads only in its worker process: a binding needs the processes
    env = engine_env(tmp_path, omp_threads_bind="0-1")
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env


def test_a_gpu_engine_keeps_vllms_processes(tmp_path: Path) -> None:
    env = engine_env(tmp_path, cpu=False)
    assert not {"VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD"} & set(env)
    assert env["HF_HUB_OFFLINE"] == "1"


@pytest.mark.parametrize("cpu", [True, False])
def test_an_engine_runs_at_the_priority_of_a_plain_process(tmp_path: Path, cpu: bool) -> None:
    # Ray starts workers at nice 15; the engine's replica (runtime_env env_vars) asks for 0
    assert engine_env(tmp_path, cpu=cpu)["RAY_worker_niceness"] == "0"
