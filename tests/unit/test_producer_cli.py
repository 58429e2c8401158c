"""CLI user mistakes: one readable ``error:`` line, non-zero exit, never a traceback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner, Result

from llmbatch.producer import cli
from llmbatch.settings import KafkaSettings, LLMBatchSettings, S3Settings

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@pytest.fixture
def unreachable() -> LLMBatchSettings:
    return LLMBatchSettings(
        kafka=KafkaSettings(bootstrap_servers=f"127.0.0.1:{closed_port()}", request_timeout_ms=2000),
        s3=S3Settings(endpoint=f"http://127.0.0.1:{closed_port()}"),
    )


@pytest.fixture
def good_file(tmp_path: Path) -> Path:
    path = tmp_path / "good.jsonl"
    rows = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}]},
        }
        for i in range(3)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def invoke(settings: LLMBatchSettings, *args: str) -> Result:
    return runner.invoke(cli.app, list(args), obj=settings)


def assert_one_line_error(result: Result, *fragments: str) -> str:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    error_lines = [ln for ln in lines if ln.startswith("error:")]
    assert len(error_lines) == 1, result.output
    for fragment in fragments:
        assert fragment in error_lines[0], result.output
    return error_lines[0]


def test_missing_file(unreachable: LLMBatchSettings, tmp_path: Path) -> None:
    result = invoke(unreachable, "submit", str(tmp_path / "nope.jsonl"), "--model", "m")
    assert_one_line_error(result, "nope.jsonl", "no such file")


def test_bad_jsonl_names_line_and_field(unreachable: LLMBatchSettings, tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": '
        '[{"role": "user", "content": "x"}], "temperature": 9}}\n{not json\n'
    )
    line = assert_one_line_error(invoke(unreachable, "submit", str(path), "--model", "m"))
    assert "2 invalid lines of 2" in line
    assert "line 1: body.temperature" in line
    assert "--skip-invalid" in line


def test_unknown_endpoint(unreachable: LLMBatchSettings, good_file: Path) -> None:
    result = invoke(unreachable, "submit", str(good_file), "--model", "m", "--endpoint", "moderations")
    assert_one_line_error(result, "unknown endpoint 'moderations'")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--metadata", "novalue"], "key=value"),
        (["--batch-id", "bad id"], "batch_id"),
        (["--tenant", "UPPER"], "tenant"),
        (["--completion-window", "99d"], "completion_window"),
        (["--deadline", "someday"], "--deadline"),
        (["--deadline", "2020-01-01T00:00:00Z"], "deadline"),
        (["--deadline", "2099-01-01T00:00:00"], "UTC offset"),
        (["--model", "bad model"], "model"),
    ],
)
def test_bad_options(unreachable: LLMBatchSettings, good_file: Path, args: list[str], fragment: str) -> None:
    base = ["submit", str(good_file)] + ([] if "--model" in args else ["--model", "m"])
    assert_one_line_error(invoke(unreachable, *base, *args), fragment)


def test_broker_unreachable_fails_fast(unreachable: LLMBatchSettings, good_file: Path) -> None:
    started = time.monotonic()
    result = invoke(unreachable, "submit", str(good_file), "--model", "m")
    assert_one_line_error(result, "Kafka at 127.0.0.1:", "unreachable")
    assert time.monotonic() - started < 15
    assert_one_line_error(invoke(unreachable, "cancel", "b-1"), "unreachable")
    assert_one_line_error(invoke(unreachable, "watch", "b-1", "--timeout", "5"), "unreachable")


def test_storage_unreachable_for_results(unreachable: LLMBatchSettings) -> None:
    assert_one_line_error(invoke(unreachable, "results", "b-1"), "object storage", "unreachable")


def test_bad_since_and_cancel_id(unreachable: LLMBatchSettings) -> None:
    assert_one_line_error(invoke(unreachable, "watch", "b-1", "--since", "last tuesday"), "--since")
    assert_one_line_error(invoke(unreachable, "cancel", "bad id"), "batch_id")


def test_invalid_settings_from_environment(monkeypatch: pytest.MonkeyPatch, good_file: Path) -> None:
    monkeypatch.setenv("LLMBATCH_KAFKA__BOOTSTRAP_SERVERS", "no-port-here")
    result = runner.invoke(cli.app, ["submit", str(good_file), "--model", "m"])
    assert_one_line_error(result, "invalid setting", "kafka.bootstrap_servers")


def test_register_adds_commands_to_a_root_app() -> None:
    root = typer.Typer()

    @root.command("version")
    def version() -> None:
        typer.echo("0")

    cli.register(root)
    result = runner.invoke(root, ["--help"])
    assert result.exit_code == 0
    for name in ("submit", "cancel", "watch", "results", "version"):
        assert name in result.output


def test_subprocess_error_has_no_traceback(tmp_path: Path) -> None:
    env = {**os.environ, "LLMBATCH_KAFKA__BOOTSTRAP_SERVERS": f"127.0.0.1:{closed_port()}"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmbatch.producer.cli",
            "submit",
            str(tmp_path / "missing.jsonl"),
            "--model",
            "m",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [f"error: {tmp_path / 'missing.jsonl'}: no such file"]


def test_subprocess_unreachable_broker_is_one_stderr_line(good_file: Path) -> None:
    env = {**os.environ, "LLMBATCH_KAFKA__BOOTSTRAP_SERVERS": f"127.0.0.1:{closed_port()}"}
    proc = subprocess.run(
        [sys.executable, "-m", "llmbatch.producer.cli", "submit", str(good_file), "--model", "m"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: Kafka at 127.0.0.1:")
