"""Settings validation and the stack's pure helpers (no services)."""

from __future__ import annotations

import os
import ssl
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from llmbatch.settings import KafkaSettings, LLMBatchSettings, RedisSettings, S3Settings
from llmbatch.stack import manager
from llmbatch.stack.ports import free_port
from llmbatch.stack.process import StackError, alive, port_open, spawn, stop_tree, wait_until
from llmbatch.stack.state import ServiceRecord, StackState

pytestmark = pytest.mark.unit


def test_settings_from_nested_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMBATCH_KAFKA__BOOTSTRAP_SERVERS", "a:1, b:2")
    monkeypatch.setenv("LLMBATCH_S3__SECRET_KEY", "s3cr3t")
    monkeypatch.setenv("LLMBATCH_KAFKA__TOPICS__PARTITIONS", "6")
    s = LLMBatchSettings()
    assert s.kafka.bootstrap_servers == "a:1,b:2"
    assert s.kafka.topics.partitions == 6
    assert s.s3.secret_key.get_secret_value() == "s3cr3t"
    assert "s3cr3t" not in repr(s) and "s3cr3t" not in str(s.model_dump())


@pytest.mark.parametrize("servers", ["", "localhost", "host:port", " , "])
def test_bad_bootstrap_servers_name_the_setting(servers: str) -> None:
    with pytest.raises(ValidationError) as info:
        KafkaSettings(bootstrap_servers=servers)
    assert "bootstrap" in str(info.value).lower()


def test_sasl_needs_mechanism_and_credentials() -> None:
    with pytest.raises(ValidationError, match="SASL_MECHANISM"):
        KafkaSettings(security_protocol="SASL_SSL")
    with pytest.raises(ValidationError, match="SASL_USERNAME"):
        KafkaSettings(security_protocol="SASL_PLAINTEXT", sasl_mechanism="SCRAM-SHA-512")
    ok = KafkaSettings(
        security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN", sasl_username="u", sasl_password="p"
    )
    kwargs = ok.client_kwargs()
    assert kwargs["sasl_mechanism"] == "PLAIN"
    assert kwargs["sasl_plain_password"] == "p"


def test_tls_builds_ssl_context() -> None:
    kwargs = KafkaSettings(security_protocol="SSL", ssl_check_hostname=False).client_kwargs()
    ctx = kwargs["ssl_context"]
    assert isinstance(ctx, ssl.SSLContext)
    assert ctx.check_hostname is False


@pytest.mark.parametrize(
    ("model", "field", "value"),
    [
        (RedisSettings, "url", "http://x"),
        (S3Settings, "endpoint", "127.0.0.1:9000"),
    ],
)
def test_bad_urls_are_rejected(model: type, field: str, value: str) -> None:
    with pytest.raises(ValidationError) as info:
        model(**{field: value})
    assert field in str(info.value)


def test_a_replay_key_is_long_and_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMBATCH_REPLAY__KEY", "too-short")
    with pytest.raises(ValidationError) as info:
        LLMBatchSettings(_env_file=None)
    assert "replay.key" in str(info.value) and "32 characters" in str(info.value)
    key = "r" * 40
    monkeypatch.setenv("LLMBATCH_REPLAY__KEY", key)
    settings = LLMBatchSettings(_env_file=None)
    assert settings.replay.key_bytes() == key.encode() and key not in repr(settings)
    monkeypatch.delenv("LLMBATCH_REPLAY__KEY")
    assert LLMBatchSettings(_env_file=None).replay.key_bytes() is None


def test_state_file_round_trip_is_owner_only(tmp_path: Path) -> None:
    state = StackState(run_dir=tmp_path)
    state.services["minio"] = ServiceRecord(
        "minio",
        123,
        {"s3": 9000},
        "http://127.0.0.1:9000",
        "l",
        "d",
        1.5,
        {"access_key": "a", "secret_key": "b"},
    )
    state.save()
    assert stat.S_IMODE(os.stat(state.path).st_mode) == 0o600
    back = StackState.load(tmp_path)
    assert back.services["minio"] == state.services["minio"]
    env = manager.env_exports(back)
    assert env["LLMBATCH_S3__ENDPOINT"] == "http://127.0.0.1:9000"
    assert env["LLMBATCH_S3__SECRET_KEY"] == "b"
    settings = manager.settings_for(back, LLMBatchSettings())
    assert settings.s3.access_key.get_secret_value() == "a"


def test_free_port_is_bindable() -> None:
    port = free_port()
    assert 0 < port < 65536
    assert not port_open(port)


def test_stop_tree_kills_children(tmp_path: Path) -> None:
    script = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    )
    pid = spawn([sys.executable, "-c", script], tmp_path / "log")
    import psutil

    for _ in range(100):
        children = psutil.Process(pid).children(recursive=True)
        if children:
            break
        time.sleep(0.05)
    assert children, "child did not start"
    stop_tree(pid, timeout=5)
    assert not alive(pid)
    assert not any(alive(c.pid) for c in children)


def test_wait_until_reports_dead_process_with_log_tail(tmp_path: Path) -> None:
    log = tmp_path / "svc.log"
    pid = spawn([sys.executable, "-c", "print('bind: address already in use'); raise SystemExit(3)"], log)
    with pytest.raises(StackError) as info:
        wait_until(lambda: False, 30, pid, "svc", log)
    assert "exited during start-up" in str(info.value)
    assert "address already in use" in info.value.log_tail
    # the tail rides along as a note, so a failing test's report shows why the service died
    assert any("address already in use" in n for n in info.value.__notes__)
    assert "address already in use" not in str(info.value)


def test_cli_status_of_empty_run_dir_fails_cleanly(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "llmbatch", "stack", "status", "--run-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "kafka" in proc.stdout


def test_cli_rejects_unknown_service(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "llmbatch", "stack", "up", "zookeeper", "--run-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "unknown service 'zookeeper'" in proc.stderr
    assert "Traceback" not in proc.stderr


# a parent that, on SIGTERM, stops its child itself (after a moment, as `ray start` stops its raylet and
# GCS in order) and exits; the child notes who stopped it
ORDERLY_PARENT = """
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", CHILD])
def stop(*_):
    time.sleep(0.5)
    child.send_signal(signal.SIGINT)
    child.wait()
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
time.sleep(60)
"""
ORDERLY_CHILD = """
import signal, sys, time
def note(what):
    def handler(*_):
        open(sys.argv[1], "a").write(what + "\\n")
        sys.exit(0)
    return handler
signal.signal(signal.SIGINT, note("stopped by its parent"))
signal.signal(signal.SIGTERM, note("terminated from outside"))
time.sleep(60)
"""


def test_stop_tree_lets_the_root_stop_its_own_children_first(tmp_path: Path) -> None:
    import psutil

    notes = tmp_path / "child.notes"
    child = ORDERLY_CHILD.replace("sys.argv[1]", repr(str(notes)))
    script = f"CHILD = {child!r}\n{ORDERLY_PARENT}"
    pid = spawn([sys.executable, "-c", script], tmp_path / "log")
    wait_until(
        lambda: "ready" in (tmp_path / "log").read_text() and bool(psutil.Process(pid).children()),
        30,
        pid,
        "parent",
        tmp_path / "log",
    )
    [kid] = psutil.Process(pid).children()
    time.sleep(0.5)  # the child's signal handlers are set

    stop_tree(pid, timeout=10)

    assert not alive(pid) and not alive(kid.pid)
    assert notes.read_text() == "stopped by its parent\n"
