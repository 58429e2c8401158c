"""Live checks of what deploy/ relies on, against real Kafka, Redis and MinIO:

- the dispatcher started exactly as its image starts it (the Dockerfile's ENTRYPOINT + CMD) serves
  /livez, /readyz and /metrics on the settings' port; every metric the Grafana dashboard queries is
  in a real scrape; SIGTERM ends it cleanly inside the Deployment's grace period;
- fetch_model.py (the images' model loader) mirrors a model folder out of MinIO.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from llmbatch.settings import KafkaSettings, LLMBatchSettings, S3Settings
from llmbatch.stack.ports import free_port
from tests.support.dispatcher_kit import registry_env, settings_env
from tests.support.scripts import load_file, load_script

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


vd = load_script("validate_deploy")
dockerfiles = load_script("validate_dockerfiles")
grafana = load_script("validate_dashboard")
fetch_model = load_file("fetch_model", ROOT / "deploy" / "docker" / "fetch_model.py")


def _get(url: str, timeout: float = 5) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read().decode()


def _image_argv() -> list[str]:
    """The dispatcher image's ENTRYPOINT + CMD, with the console script taken from this venv."""
    runtime = dockerfiles.parse_dockerfile(dockerfiles.DOCKERFILES[0]).stage("runtime")
    entry = json.loads([i for i in runtime.instructions if i.keyword == "ENTRYPOINT"][-1].args)
    cmd = json.loads([i for i in runtime.instructions if i.keyword == "CMD"][-1].args)
    argv = entry + cmd
    script = Path(sys.executable).parent / argv[0]
    assert script.exists(), f"console script {argv[0]} is not installed in {script.parent}"
    return [str(script), *argv[1:]]


@pytest.fixture
def dispatcher(settings: LLMBatchSettings, tmp_path: Path) -> Any:
    uid = uuid.uuid4().hex[:8]
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMBATCH_")}
    env.update(settings_env(settings))
    env.update(registry_env())  # a dispatcher without a model refuses to start
    env.update(
        {
            "LLMBATCH_KAFKA__TOPICS__REQUESTS": f"deploy-{uid}.requests",
            "LLMBATCH_KAFKA__TOPICS__RESULTS": f"deploy-{uid}.results",
            "LLMBATCH_KAFKA__TOPICS__DEAD_LETTER": f"deploy-{uid}.requests.dlt",
            "LLMBATCH_KAFKA__TOPICS__PARTITIONS": "1",
            "LLMBATCH_KAFKA__TOPICS__REPLICATION_FACTOR": "1",
            "LLMBATCH_REDIS__KEY_PREFIX": f"deploy-{uid}",
            "LLMBATCH_DISPATCHER__GROUP_ID": f"deploy-{uid}",
            "LLMBATCH_DISPATCHER__METRICS_HOST": "127.0.0.1",
            "LLMBATCH_DISPATCHER__METRICS_PORT": str(port),
            "LLMBATCH_DISPATCHER__SESSION_TIMEOUT_MS": "6000",
            "LLMBATCH_DISPATCHER__HEARTBEAT_INTERVAL_MS": "1000",
            "LLMBATCH_RAY__ADDRESS": f"http://127.0.0.1:{free_port()}",  # no job is ever submitted here
            # the short path is on, as deployed: the runner's credential comes with it (from the Secret)
            "LLMBATCH_RAY__RUNNER_TOKEN": secrets.token_hex(32),
            "PYTHONUNBUFFERED": "1",
        }
    )
    log_path = tmp_path / "dispatcher.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            _image_argv(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=tmp_path,
            start_new_session=True,
        )
    handle = {"proc": proc, "url": f"http://127.0.0.1:{port}", "env": env, "log": log_path}
    try:
        yield handle
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)


def _tail(handle: dict[str, Any]) -> str:
    return "\n".join(handle["log"].read_text(errors="replace").splitlines()[-40:])


async def _wait_ready(handle: dict[str, Any], within_s: float = 120) -> None:
    deadline = time.monotonic() + within_s
    last: Any = None
    while time.monotonic() < deadline:
        assert handle["proc"].poll() is None, (
            f"dispatcher exited {handle['proc'].returncode}:\n{_tail(handle)}"
        )
        try:
            last = await asyncio.to_thread(_get, handle["url"] + "/readyz")
            if last[0] == 200:
                return
        except OSError as exc:
            last = exc
        await asyncio.sleep(0.5)
    raise AssertionError(f"/readyz never 200 (last {last!r}):\n{_tail(handle)}")


async def test_dashboard_metrics_are_in_a_live_scrape(
    dispatcher: dict[str, Any], kafka_settings: KafkaSettings
) -> None:
    from aiokafka import AIOKafkaProducer

    await _wait_ready(dispatcher)
    status, _, body = await asyncio.to_thread(_get, dispatcher["url"] + "/livez")
    assert status == 200, body

    # one undecodable record: the dispatcher dead-letters it, so labelled counters get samples too
    producer = AIOKafkaProducer(**kafka_settings.client_kwargs())
    await producer.start()
    try:
        await producer.send_and_wait(
            dispatcher["env"]["LLMBATCH_KAFKA__TOPICS__REQUESTS"], b"{not json", key=b"deploy-test"
        )
    finally:
        await producer.stop()

    deadline = time.monotonic() + 90
    text = ""
    while time.monotonic() < deadline:
        status, ctype, text = await asyncio.to_thread(_get, dispatcher["url"] + "/metrics")
        assert status == 200 and ctype.startswith("text/plain"), (status, ctype)
        if "llmbatch_dispatcher_dead_letters_total{" in text:
            break
        await asyncio.sleep(1)
    else:
        raise AssertionError(f"no dead letter counted:\n{text[-2000:]}\n{_tail(dispatcher)}")

    scraped = grafana.exposition_names(text)
    dashboard = json.loads(grafana.DASHBOARD.read_text())
    targets = grafana.dashboard_targets(dashboard)
    referenced = set().union(*(grafana.promql_metric_names(e) for _, e in targets))
    assert referenced, "the dashboard queries nothing"
    missing = referenced - scraped
    assert missing == set(), f"dashboard queries series the live /metrics lacks: {sorted(missing)}"
    # what the scrape offers under the llmbatch_ prefix is what the registry declares (no drift)
    assert {n for n in scraped if n.startswith("llmbatch_") and not n.endswith("_created")} >= set(
        grafana.registry_metrics()
    )

    # SIGTERM (Kubernetes / docker stop): clean exit well inside terminationGracePeriodSeconds
    deployment = vd.load_yaml((vd.KUSTOMIZE / "base/dispatcher/deployment.yaml").read_text())
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    proc = dispatcher["proc"]
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = await asyncio.to_thread(proc.wait, grace)
    assert code == 0, _tail(dispatcher)
    assert time.monotonic() - started < grace


def test_fetch_model_mirrors_a_model_from_minio(
    s3_settings: S3Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    from minio import Minio

    client = Minio(
        s3_settings.host,
        access_key=s3_settings.access_key.get_secret_value(),
        secret_key=s3_settings.secret_key.get_secret_value(),
        secure=s3_settings.secure,
        region=s3_settings.region,
    )
    bucket = f"deploy-models-{uuid.uuid4().hex[:8]}"
    client.make_bucket(bucket)
    files = {
        "config.json": b'{"model_type": "llama"}',
        "model.safetensors": os.urandom(3000),
        "tokenizer/tokenizer.json": b"{}",
    }
    for name, data in files.items():
        client.put_object(bucket, f"tiny/{name}", io.BytesIO(data), len(data))
    client.put_object(bucket, "other/config.json", io.BytesIO(b"{}"), 2)  # another model: not copied
    monkeypatch.setenv("LLMBATCH_S3__ENDPOINT", s3_settings.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_settings.access_key.get_secret_value())
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_settings.secret_key.get_secret_value())
    dest = tmp_path / "models" / "tiny"

    assert fetch_model.main(["--from-s3", f"s3://{bucket}/tiny/", "--dest", str(dest)]) == 0
    got = {p.relative_to(dest).as_posix(): p.read_bytes() for p in dest.rglob("*") if p.is_file()}
    assert got == files
    assert sorted(p.name for p in dest.parent.iterdir()) == ["tiny"], "no partial folders left"

    # present: nothing is fetched again; --force replaces it
    (dest / "marker").write_text("x")
    assert fetch_model.main(["--from-s3", f"s3://{bucket}/tiny/", "--dest", str(dest)]) == 0
    assert (dest / "marker").exists()
    assert fetch_model.main(["--from-s3", f"s3://{bucket}/tiny/", "--dest", str(dest), "--force"]) == 0
    assert not (dest / "marker").exists() and (dest / "config.json").exists()

    # a prefix without config.json is not a model: fails, leaves nothing behind
    assert fetch_model.main(["--from-s3", f"s3://{bucket}/nothing/", "--dest", str(tmp_path / "m2")]) == 1
    assert not (tmp_path / "m2").exists()
    # wrong credentials: fails
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    assert fetch_model.main(["--from-s3", f"s3://{bucket}/tiny/", "--dest", str(tmp_path / "m3")]) == 1
