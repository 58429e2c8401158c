"""`llmbatch stack prepare` says what each uncached step does before it runs, and sums up at the end.

The preparers are replaced by fakes that write what the real ones would into a temporary cache; the
checks that decide "cached" are the real ones (and are checked against the real preparers).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmbatch.stack import kafka_broker, manager, model, services
from llmbatch.stack import state as stack_state
from llmbatch.stack.cli import app
from llmbatch.stack.process import StackError

pytestmark = pytest.mark.unit

MINIO_TAG = services.MINIO_MODULE.rsplit("@", 1)[1]


def _kafka_jar(cache: Path) -> Path:
    """Where the real kafka_broker.kafka_libs puts the broker jar (written out here on purpose)."""
    version = kafka_broker.KAFKA_VERSION
    return cache / f"kafka-{version}" / "libs" / f"kafka_2.13-{version}.jar"


def _minio(cache: Path) -> Path:
    return cache / "bin" / f"minio-{MINIO_TAG}"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private cache for both the checks (state.CACHE_DIR) and the real preparers (services' and
    kafka_broker's)."""
    folder = tmp_path / "cache"
    monkeypatch.setattr(stack_state, "CACHE_DIR", folder)
    monkeypatch.setattr(services, "CACHE_DIR", folder)
    monkeypatch.setattr(kafka_broker, "CACHE_DIR", folder)
    monkeypatch.setenv("LLMBATCH_MODEL_DIR", str(folder / "models" / "SmolLM2-135M-Instruct"))
    return folder


@pytest.fixture
def ran(cache: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Fake preparers writing where the real ones do; returns the names of the steps run, in order."""
    calls: list[str] = []

    def fake(name: str, make: Callable[[], Path | None]) -> Callable[[], object]:
        def run() -> object:
            calls.append(name)
            made = make()
            if made is not None:
                made.parent.mkdir(parents=True, exist_ok=True)
                made.write_bytes(b"x")
            return made

        return run

    monkeypatch.setitem(services.PREPARERS, "kafka", fake("kafka", lambda: _kafka_jar(cache)))
    monkeypatch.setitem(services.PREPARERS, "minio", fake("minio", lambda: _minio(cache)))
    monkeypatch.setitem(services.PREPARERS, "redis", fake("redis", lambda: None))
    monkeypatch.setitem(services.PREPARERS, "ray", fake("ray", lambda: None))

    def convert() -> Path:
        calls.append("model")
        target = model.model_dir()
        target.mkdir(parents=True, exist_ok=True)
        (target / "config.json").write_text("{}")
        (target / "model.safetensors").write_bytes(b"")
        return target

    monkeypatch.setattr(model, "ensure_model", convert)
    return calls


def _lines(text: str, prefix: str = "[prepare] ") -> list[str]:
    return [line for line in text.splitlines() if line.startswith(prefix)]


def test_first_prepare_announces_each_uncached_step_then_sums_up(ran: list[str]) -> None:
    result = CliRunner().invoke(app, ["prepare"])
    assert result.exit_code == 0, result.output
    said = _lines(result.stderr)
    announced = [line for line in said if not line.startswith("[prepare] done")]
    assert [line.split(":")[0] for line in announced] == [
        "[prepare] kafka",
        "[prepare] minio",
        "[prepare] model",
    ]
    assert "Maven Central" in announced[0] and "~15 s" in announced[0]
    assert "Go module" in announced[1] and "2-20 min" in announced[1]
    assert "about 1 min" in announced[2]
    summary = said[-1]
    assert summary.startswith("[prepare] done in ")
    for part in ("kafka ", "redis installed", "minio ", "ray installed", "model "):
        assert part in summary
    assert re.search(
        r"kafka \d+\.\d s, redis installed, minio \d+\.\d s, ray installed, model \d+\.\d s$", summary
    ), summary
    assert [name for name in ran if name not in ("redis", "ray")] == ["kafka", "minio", "model"]
    assert "error" not in result.output.lower()
    assert f"model: {model.model_dir()}" in result.stdout


def test_second_prepare_is_quiet_and_says_cached(ran: list[str]) -> None:
    assert CliRunner().invoke(app, ["prepare"]).exit_code == 0
    result = CliRunner().invoke(app, ["prepare"])
    assert result.exit_code == 0, result.output
    said = _lines(result.stderr)
    assert len(said) == 1, said
    assert said[0].endswith("kafka cached, redis installed, minio cached, ray installed, model cached")
    assert "error" not in result.output.lower()


def test_announcement_comes_before_the_step_and_no_model_skips_it(
    ran: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    fake_kafka = services.PREPARERS["kafka"]

    def kafka() -> object:
        events.append("kafka ran")
        return fake_kafka()

    monkeypatch.setitem(services.PREPARERS, "kafka", kafka)
    outcomes = manager.prepare(["kafka", "redis"], report=events.append)
    assert [e.split(":")[0] for e in events] == ["[prepare] kafka", "kafka ran"]
    assert [(o.name, o.cached) for o in outcomes] == [("kafka", False), ("redis", True)]

    result = CliRunner().invoke(app, ["prepare", "minio", "--no-model"])
    assert result.exit_code == 0, result.output
    said = _lines(result.stderr)
    assert [line.split(":")[0] for line in said[:-1]] == ["[prepare] minio"]
    assert "model" not in said[-1] and "model" not in ran


def test_failing_step_was_announced_and_fails_cleanly(
    ran: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken() -> object:
        raise StackError("building MinIO with `go install` failed (exit 1)", "go: network unreachable")

    monkeypatch.setitem(services.PREPARERS, "minio", broken)
    result = CliRunner().invoke(app, ["prepare", "--no-model"])
    assert result.exit_code == 1
    assert "[prepare] minio: building MinIO" in result.stderr
    assert "error: building MinIO with `go install` failed" in result.stderr
    assert "go: network unreachable" in result.stderr
    assert "done in" not in result.stderr and "Traceback" not in result.output


def test_cached_checks_agree_with_the_real_preparers(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # without mvn/go the real preparers can only succeed if their result is where the check looks
    real_which = shutil.which
    monkeypatch.setattr(
        shutil, "which", lambda cmd, *a, **k: None if cmd in ("mvn", "go") else real_which(cmd)
    )
    steps = manager.PREPARE_STEPS
    for name, real in (("kafka", kafka_broker.kafka_libs), ("minio", services.minio_binary)):
        assert not steps[name].is_cached()
        with pytest.raises(StackError):
            real()
    kafka_jar, minio = _kafka_jar(cache), _minio(cache)
    for made in (kafka_jar, minio):
        made.parent.mkdir(parents=True, exist_ok=True)
        made.write_bytes(b"x")
    assert steps["kafka"].is_cached() and steps["minio"].is_cached()
    assert kafka_broker.kafka_libs() == kafka_jar.parent
    assert services.minio_binary() == minio


def test_model_check_is_the_one_ensure_model_reuses(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_conversion(*args: object, **kwargs: object) -> object:
        raise AssertionError("ensure_model converted although the folder was complete")

    assert model.cached_model() is None and not manager.PREPARE_STEPS["model"].is_cached()
    target = model.model_dir()
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    assert model.cached_model() is None  # no weights yet: still to convert
    (target / "model.safetensors").write_bytes(b"")
    assert model.cached_model() == target and manager.PREPARE_STEPS["model"].is_cached()
    monkeypatch.setattr(subprocess, "run", no_conversion)
    assert model.ensure_model() == target
