"""What a dispatcher needs, beyond the service addresses, to run jobs on the local stack.

One definition for ``make demo`` (:mod:`llmbatch.demo`), ``llmbatch stack env`` and
``llmbatch stack dispatcher``, so the three cannot drift: the jobs run with the python that runs
llmbatch (the checkout's .venv, which the local Ray head runs from too), on the locally converted
model (served as :data:`llmbatch.stack.model.SERVED_MODEL` in ``LLMBATCH_ENGINES__MODELS``, beside
the embedding model :data:`llmbatch.stack.model.EMBEDDING_MODEL`), with the engine settings measured
to start fast on these CPU machines.
None of it is secret; the MinIO keys stay in :func:`llmbatch.stack.manager.env_exports`.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from llmbatch.stack import manager
from llmbatch.stack.model import EMBEDDING_MODEL, SERVED_MODEL, embedding_model_dir
from llmbatch.stack.state import CACHE_DIR, StackState

ENGINES = "LLMBATCH_ENGINES__MODELS"
LOCAL_ENGINE: dict[str, object] = {
    "enforce_eager": True,  # 18-20 s engine start instead of 70-130 s
    # bfloat16 where the CPU computes it natively, float32 where it would emulate it (5.8x faster on
    # an AVX2-only CPU): see llmbatch.ray_job.engines.cpu_dtype
    "dtype": "auto",
    "max_model_len": 2048,
    "batch_size": 4,  # small Ray Data batches: live progress
    # steps of at most 512 tokens (vLLM's default 4096 makes a CPU prefill step 4-6 s long, and an
    # urgent batch waits for it): 1.7x instead of 5x the idle time beside a big batch, same throughput
    "max_num_batched_tokens": 512,
}
LOCAL_EMBEDDING_ENGINE: dict[str, object] = {
    "runner": "pooling",
    "enforce_eager": True,
    "dtype": "float32",  # a 22M-parameter model: full precision costs little and matches the model
    "batch_size": 16,
}
OMP_BIND_SOURCE = "LLMBATCH_OMP_THREADS_BIND"  # tooling variable (README): the demo's CPU binding


def engine_cache_dir() -> Path:
    """vLLM / torch compile caches, reused across runs (``$LLMBATCH_CACHE/engine-cache``)."""
    return CACHE_DIR / "engine-cache"


def local_defaults(model_path: Path | None, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The local dispatcher's job and engine settings (``LLMBATCH_*`` name -> value).

    ``model_path`` is the converted local model (:func:`llmbatch.stack.model.cached_model`), served
    as :data:`~llmbatch.stack.model.SERVED_MODEL` with :data:`LOCAL_ENGINE` (one JSON value,
    ``LLMBATCH_ENGINES__MODELS``); None leaves it out (the model is not prepared yet, and a dispatcher
    without a model refuses to start). ``environ`` (default ``os.environ``) is read for
    ``LLMBATCH_OMP_THREADS_BIND`` only.
    """
    environ = os.environ if environ is None else environ
    env: dict[str, str] = {}
    if model_path is not None:
        env[ENGINES] = engines_json(model_path)
    env.update(
        {
            "LLMBATCH_JOB__PYTHON": sys.executable,  # the local Ray head runs from this venv
            "LLMBATCH_JOB__ENGINE_CACHE_DIR": str(engine_cache_dir()),
            "LLMBATCH_JOB__PROGRESS_INTERVAL_S": "1",
            "LLMBATCH_DISPATCHER__PROGRESS_INTERVAL_S": "2",
            "LLMBATCH_DISPATCHER__POLL_INTERVAL_S": "0.5",
            "LLMBATCH_DISPATCHER__METRICS_HOST": "127.0.0.1",  # a laptop, not a pod: loopback only
        }
    )
    bind = environ.get(OMP_BIND_SOURCE)
    if bind:
        env["LLMBATCH_JOB__OMP_THREADS_BIND"] = bind
    return env


def engines_json(model_path: Path, embedding_path: Path | None = None) -> str:
    """``LLMBATCH_ENGINES__MODELS`` of the local stack: the converted model and its fast-start engine,
    and the embedding model when its package is installed (default: looked up). Both scale from zero:
    a model costs nothing until a batch names it."""
    threads = {"omp_threads": local_engine_threads()}
    models: dict[str, object] = {
        SERVED_MODEL: {"path": str(model_path), "engine": LOCAL_ENGINE, "resources": threads}
    }
    embedding_path = embedding_path or embedding_model_dir()
    if embedding_path is not None:
        models[EMBEDDING_MODEL] = {
            "path": str(embedding_path),
            "engine": LOCAL_EMBEDDING_ENGINE,
            "resources": threads,
        }
    return json.dumps(models)


def local_engine_threads() -> int:
    """Threads the local engine computes on: every core this process may use. The replica reserves
    one Ray CPU, and Ray would give it one thread; on a laptop or a CI machine the engine is most of
    the work, and 2 threads on 2 cores gave 1.9x its tokens/s (bench/bench_service.py --omp-threads)."""
    return max(1, len(os.sched_getaffinity(0)))


def dispatcher_environ(
    state: StackState,
    model_path: Path | None,
    environ: Mapping[str, str] | None = None,
    extra_defaults: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """A local dispatcher process's whole environment.

    Layers, lowest first: ``extra_defaults`` (the caller's own, e.g. the demo's instance id), the
    :func:`local_defaults`, the caller's environment (a user's ``LLMBATCH_*`` wins over the
    defaults), and the stack's service addresses and keys (always this stack's).
    """
    base = dict(os.environ if environ is None else environ)
    return {
        **(extra_defaults or {}),
        **local_defaults(model_path, base),
        **base,
        **manager.env_exports(state),
    }


def shell_exports(state: StackState) -> tuple[dict[str, str], list[str]]:
    """What ``llmbatch stack env`` prints: the stack's addresses and keys, then :func:`local_defaults`;
    and notes for stderr about what is missing (a service not running, the model not prepared).

    Only reads the state file and looks at the model folder: converts nothing, starts nothing.
    """
    from llmbatch.stack.model import cached_model, model_dir
    from llmbatch.stack.process import alive

    notes: list[str] = []
    if not state.services:
        notes.append(
            f"no services recorded in {state.run_dir}: start the stack with "
            "`.venv/bin/llmbatch stack up` (or `LLMBATCH_DEMO_KEEP=1 make demo`)"
        )
    for name, rec in state.services.items():
        if not alive(rec.pid):
            notes.append(
                f"{name} is recorded in {state.path} but not running (pid {rec.pid}): "
                "`.venv/bin/llmbatch stack up` starts it again"
            )
    model = cached_model()
    if model is None:
        notes.append(
            f"the local model is not prepared yet ({model_dir()}): run "
            f"`.venv/bin/llmbatch stack prepare` (converts it once, about 1 min), then this "
            f"again to get {ENGINES}"
        )
    return {**manager.env_exports(state), **local_defaults(model)}, notes
