"""`llmbatch stack env` and `llmbatch stack dispatcher`: what a shell and a local dispatcher get.

The state file is written by hand (fake records, no services): the commands only read it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from llmbatch.demo import batch as demo_batch
from llmbatch.demo import run as demo
from llmbatch.stack import state as stack_state
from llmbatch.stack.cli import app
from llmbatch.stack.state import ServiceRecord, StackState

pytestmark = pytest.mark.unit

# hostile values: spaces, quotes and command substitutions must arrive verbatim and run nothing
ACCESS_KEY = "local user"
SECRET_KEY = 'it\'s $(touch PWNED) `touch PWNED2`; touch PWNED3 "x"'


def _state(run_dir: Path, pid: int = 999_999_999) -> StackState:
    state = StackState(run_dir=run_dir)
    state.services = {
        "kafka": ServiceRecord("kafka", pid, {"broker": 19092}, "127.0.0.1:19092", "l", "d"),
        "redis": ServiceRecord("redis", pid, {"redis": 16379}, "redis://127.0.0.1:16379/0", "l", "d"),
        "minio": ServiceRecord(
            "minio",
            pid,
            {"s3": 19000},
            "http://127.0.0.1:19000",
            "l",
            "d",
            extra={"access_key": ACCESS_KEY, "secret_key": SECRET_KEY},
        ),
        "ray": ServiceRecord("ray", pid, {"dashboard": 18265}, "http://127.0.0.1:18265", "l", "d"),
    }
    state.save()
    return state


def _fake_model(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMBATCH_")}
    env.update(extra)
    return env


def _source(exports: str, cwd: Path, env: dict[str, str]) -> dict[str, str]:
    """The environment a bash that `eval`s ``exports`` ends up with."""
    script = 'eval "$1" && exec "$2" -c "import json, os; print(json.dumps(dict(os.environ)))"'
    proc = subprocess.run(
        ["bash", "-c", script, "bash", exports, sys.executable],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    result: dict[str, str] = json.loads(proc.stdout)
    return result


def test_env_sourced_by_bash_points_at_stack_and_carries_dispatcher_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run dir"
    _state(run_dir)
    model = _fake_model(tmp_path / "my models" / "SmolLM2")
    cache = tmp_path / "cache with space"
    embedder = tmp_path / "my models" / "MiniLM"
    env = _clean_env(
        LLMBATCH_CACHE=str(cache), LLMBATCH_MODEL_DIR=str(model), LLMBATCH_EMBEDDING_MODEL_DIR=str(embedder)
    )
    proc = subprocess.run(
        [sys.executable, "-m", "llmbatch", "stack", "env", "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert all(line.startswith("export LLMBATCH_") for line in proc.stdout.splitlines())
    assert "prepare" not in proc.stderr  # the model is there: nothing to say about it

    got = _source(proc.stdout, tmp_path, env)
    assert got["LLMBATCH_KAFKA__BOOTSTRAP_SERVERS"] == "127.0.0.1:19092"
    assert got["LLMBATCH_REDIS__URL"] == "redis://127.0.0.1:16379/0"
    assert got["LLMBATCH_S3__ENDPOINT"] == "http://127.0.0.1:19000"
    assert got["LLMBATCH_S3__ACCESS_KEY"] == ACCESS_KEY
    assert got["LLMBATCH_S3__SECRET_KEY"] == SECRET_KEY
    assert got["LLMBATCH_RAY__ADDRESS"] == "http://127.0.0.1:18265"
    assert got["LLMBATCH_JOB__PYTHON"] == sys.executable
    # the name the demo sends -> the converted model, with the fast-start engine; and the embedding model
    threads = {"omp_threads": len(os.sched_getaffinity(0))}
    assert json.loads(got["LLMBATCH_ENGINES__MODELS"]) == {
        "HuggingFaceTB/SmolLM2-135M-Instruct": {
            "path": str(model),
            "engine": {
                "enforce_eager": True,
                "dtype": "auto",
                "max_model_len": 2048,
                "batch_size": 4,
                "max_num_batched_tokens": 512,
            },
            # it computes on every core of the machine, not on the one thread Ray gives 1 CPU
            "resources": threads,
        },
        "sentence-transformers/all-MiniLM-L6-v2": {
            "path": str(embedder),
            "engine": {"runner": "pooling", "enforce_eager": True, "dtype": "float32", "batch_size": 16},
            "resources": threads,
        },
    }
    assert demo_batch.MODEL == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert got["LLMBATCH_JOB__ENGINE_CACHE_DIR"] == str(cache / "engine-cache")
    # what the dispatcher makes of it
    from llmbatch.dispatcher.settings import DispatcherSettings

    for key in [k for k in os.environ if k.startswith("LLMBATCH_")]:
        monkeypatch.delenv(key)
    for key, value in got.items():
        if key.startswith("LLMBATCH_"):
            monkeypatch.setenv(key, value)
    settings = DispatcherSettings(_env_file=None)
    assert settings.serving_problem() is None
    entry = settings.engines.get(demo_batch.MODEL)
    assert entry.path == str(model) and entry.engine.enforce_eager and entry.engine.dtype == "auto"
    assert settings.pooling_models == {"sentence-transformers/all-MiniLM-L6-v2"}
    assert not list(tmp_path.glob("PWNED*")), "a value was executed by the shell"


def test_env_without_prepared_model_says_how_and_converts_nothing(tmp_path: Path) -> None:
    _state(tmp_path)
    missing = tmp_path / "models" / "SmolLM2"
    env = _clean_env(LLMBATCH_MODEL_DIR=str(missing))
    proc = subprocess.run(
        [sys.executable, "-m", "llmbatch", "stack", "env", "--run-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "LLMBATCH_ENGINES__MODELS" not in proc.stdout
    assert "LLMBATCH_JOB__PYTHON=" in proc.stdout
    assert "llmbatch stack prepare" in proc.stderr
    assert all(line.startswith("# ") for line in proc.stderr.splitlines())  # harmless if eval'd too
    assert not missing.exists() and not missing.parent.exists()


def test_demo_and_stack_env_give_a_dispatcher_the_same_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in [k for k in os.environ if k.startswith("LLMBATCH_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("LLMBATCH_OMP_THREADS_BIND", "0-1")
    model = _fake_model(tmp_path / "model")
    monkeypatch.setenv("LLMBATCH_MODEL_DIR", str(model))
    state = _state(tmp_path / "run")

    result = CliRunner().invoke(app, ["env", "--run-dir", str(state.run_dir)])
    assert result.exit_code == 0, result.output
    shell = _source(result.stdout, tmp_path, _clean_env())
    from_env = {k: v for k, v in shell.items() if k.startswith("LLMBATCH_")}
    demo_env = demo.dispatcher_env(StackState.load(state.run_dir), model, metrics_port=12345)

    differing = {k: (v, demo_env.get(k)) for k, v in from_env.items() if demo_env.get(k) != v}
    assert not differing, "`stack env` and the demo's dispatcher disagree"
    demo_job = {k for k in demo_env if k.startswith("LLMBATCH_JOB__")}
    assert demo_job <= set(from_env), f"job settings only the demo sets: {demo_job - set(from_env)}"
    assert from_env["LLMBATCH_JOB__OMP_THREADS_BIND"] == "0-1"
    assert from_env["LLMBATCH_JOB__ENGINE_CACHE_DIR"] == str(stack_state.CACHE_DIR / "engine-cache")


def test_stack_dispatcher_execs_dispatcher_run_with_layered_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in [k for k in os.environ if k.startswith("LLMBATCH_")]:
        monkeypatch.delenv(key)
    model = _fake_model(tmp_path / "model")
    monkeypatch.setenv("LLMBATCH_MODEL_DIR", str(model))
    mine = '{"my-model": {"path": "/elsewhere", "engine": {"dtype": "float32"}}}'
    monkeypatch.setenv("LLMBATCH_ENGINES__MODELS", mine)  # the user's setting wins
    monkeypatch.setenv("LLMBATCH_REDIS__URL", "redis://elsewhere:6379/0")  # the stack's address wins
    state = _state(tmp_path / "run", pid=os.getpid())  # "running": a live pid
    calls: list[tuple[str, list[str], dict[str, str]]] = []

    def fake_execve(path: str, argv: list[str], env: dict[str, str]) -> Any:
        calls.append((path, list(argv), dict(env)))
        raise SystemExit(0)

    monkeypatch.setattr(os, "execve", fake_execve)
    result = CliRunner().invoke(app, ["dispatcher", "--run-dir", str(state.run_dir), "--max-in-flight", "2"])
    assert result.exit_code == 0, result.output
    [(path, argv, env)] = calls
    assert path == sys.executable
    assert argv == [sys.executable, "-m", "llmbatch", "dispatcher", "run", "--max-in-flight", "2"]
    assert env["LLMBATCH_JOB__PYTHON"] == sys.executable
    assert env["LLMBATCH_ENGINES__MODELS"] == mine
    assert env["LLMBATCH_REDIS__URL"] == "redis://127.0.0.1:16379/0"
    assert env["LLMBATCH_S3__SECRET_KEY"] == SECRET_KEY
    assert SECRET_KEY not in result.output and ACCESS_KEY not in result.output  # secrets: `env` only


def test_stack_dispatcher_refuses_a_stack_that_is_not_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMBATCH_MODEL_DIR", str(_fake_model(tmp_path / "model")))
    state = _state(tmp_path / "run")  # pid 999999999: not running
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("must not start a dispatcher"))
    result = CliRunner().invoke(app, ["dispatcher", "--run-dir", str(state.run_dir)])
    assert result.exit_code == 1
    assert "not running" in result.stderr and "llmbatch stack up" in result.stderr
    assert SECRET_KEY not in result.output
