"""Process environment for vLLM: offline, caches in one folder, and the CPU tuning measured here.

These variables must be in place before the engine's process starts (``LD_PRELOAD`` in
particular), so they are handed to Ray as ``runtime_env["env_vars"]`` or to a subprocess' env.
"""

from __future__ import annotations

import glob
import os
import sys
from pathlib import Path

_TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def engine_env(
    cache_dir: str | Path,
    *,
    cpu: bool = True,
    omp_threads_bind: str | None = None,
    kv_cache_gib: int = 1,
    preload: bool = True,
) -> dict[str, str]:
    """Environment for a process that builds ``vllm.LLM``.

    ``omp_threads_bind`` (``VLLM_CPU_OMP_THREADS_BIND``) pins OpenMP threads, e.g. ``"0-1"``: about
    40% faster on an idle machine, about 2x slower when other work loads the same cores, so it is a
    setting. ``preload`` adds tcmalloc and Intel OpenMP via ``LD_PRELOAD`` when both are present (CPU
    only).

    Without a binding, a CPU engine runs inside the process that builds it
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: vLLM's in-process engine core and one-process executor)
    with ``OMP_NUM_THREADS`` threads (a Ray actor's ``num_cpus``). vLLM's default on CPU is an
    EngineCore process plus a worker process pinned to one core, the EngineCore busy-polling the
    worker on the core it reserves for itself, so other work on the node lands on the worker's core:
    measured on 2 cores (bench/bench_engine_env.py, bench/bench_service.py), in-process is as fast
    when idle, loses less beside other work, and the engine starts in 6-7 s instead of 42-50 s.
    vLLM needs its worker process to pin threads, so a binding keeps vLLM's processes. GPU engines
    (``cpu=False``) keep them too: there the EngineCore process overlaps scheduling with the GPU.
    """
    cache = Path(cache_dir)
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CACHE_ROOT": str(cache / "vllm"),
        "XDG_CACHE_HOME": str(cache / "xdg"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "TOKENIZERS_PARALLELISM": "false",
        # Ray starts its workers at nice 15, below every ordinary process on the node: an engine
        # replica then yields its cores to Kafka, Redis, a dispatcher, anything. The engine is
        # the node's work: it runs at the priority a plain vLLM process has (Ray's own setting,
        # as Ray's job supervisor sets it for drivers); the rest of Ray keeps 15.
        "RAY_worker_niceness": "0",
    }
    if cpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
        if omp_threads_bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = omp_threads_bind
        else:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if preload:
            libs = [p for p in (_TCMALLOC, _iomp5()) if p and os.path.exists(p)]
            if len(libs) == 2:
                env["LD_PRELOAD"] = ":".join(libs)
    return env


def _iomp5() -> str | None:
    found = glob.glob(os.path.join(sys.prefix, "lib", "libiomp5.so"))
    return found[0] if found else None
