"""The producer SDK installed alone, as another team's service would: its three wheels (llmbatch-producer,
-adapters, -schemas, built here) in fresh venvs of Python 3.10 and 3.13, with the dependencies of
requirements/lock/sdk.txt only. No Ray, pyarrow, FastAPI, Redis client, torch or vLLM gets in; and the
SDK, from those interpreters, submits batches to the real stack (Kafka, MinIO, a dispatcher running
them on Ray) and reads their results back; the README's SDK example runs there too, as written.

The interpreters are pyenv's (``~/.pyenv/versions/3.10.*``, ``3.13.*``): a machine without them fails
this test, naming the one missing."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from llmbatch.chaos.processes import settings_env
from llmbatch.settings import KafkaSettings, RaySettings, RedisSettings, S3Settings
from tests.e2e.test_dispatcher_e2e import Env, buckets, world  # noqa: F401 (buckets: a fixture)
from tests.support.dispatcher_kit import MODEL

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
UNITS = ("schemas", "adapters", "producer")
HEAVY = ("ray", "pyarrow", "fastapi", "uvicorn", "redis", "torch", "vllm", "prometheus_client")
PYTHONS = ("3.10", "3.13")


def _uv(*args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "uv.sh"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, f"uv {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done


def _interpreter(version: str) -> Path:
    found = sorted((Path.home() / ".pyenv" / "versions").glob(f"{version}.*/bin/python"))
    assert found, (
        f"no Python {version} under ~/.pyenv/versions: the SDK is tested on {', '.join(PYTHONS)}; "
        f"install it (pyenv install {version}) on this machine"
    )
    return found[-1]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sdk-wheels")
    for unit in UNITS:
        _uv("build", "--quiet", "--wheel", "--out-dir", str(out), unit)
    return out


@pytest.fixture(scope="module", params=PYTHONS)
def sdk(request: pytest.FixtureRequest, wheels: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv holding the SDK alone: the locked dependencies (hash-checked), then its wheels."""
    venv = tmp_path_factory.mktemp(f"sdk-{request.param}") / "venv"
    _uv("venv", "--quiet", "--python", str(_interpreter(request.param)), str(venv))
    python = venv / "bin" / "python"
    _uv(
        "pip",
        "install",
        "--quiet",
        "--python",
        str(python),
        "--require-hashes",
        "-r",
        str(ROOT / "requirements" / "lock" / "sdk.txt"),
    )
    _uv(
        "pip",
        "install",
        "--quiet",
        "--python",
        str(python),
        "--no-deps",
        *map(str, sorted(wheels.glob("*.whl"))),
    )
    listed = _uv("pip", "list", "--python", str(python), "--format", "json").stdout
    site = next((venv / "lib").glob("python3.*/site-packages"))
    size = sum(p.stat().st_size for p in site.rglob("*") if p.is_file())
    print(
        f"\nthe SDK on Python {request.param}: {len(json.loads(listed))} packages, {size / 2**20:.1f} MiB "
        f"in site-packages"
    )
    return python


def _run(python: Path, script: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [str(python), "-c", textwrap.dedent(script)],
        cwd=python.parents[2],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_sdk_installs_without_the_service(sdk: Path) -> None:
    said = _run(
        sdk,
        f"""
        import importlib.util, sys
        import llmbatch.producer, llmbatch.producer.cli
        print(sys.version_info[:2])
        print(sorted(m for m in {HEAVY!r} if importlib.util.find_spec(m) is not None))
        print([m for m in ("llmbatch.dispatcher", "llmbatch.ray_job", "llmbatch.api")
               if importlib.util.find_spec(m) is not None])
        """,
    ).splitlines()
    assert said[1:] == ["[]", "[]"], said
    cli = sdk.parent / "llmbatch-producer"
    done = subprocess.run([str(cli), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "submit" in done.stdout, done.stdout + done.stderr


@pytest.fixture
async def stack(
    kafka_settings: KafkaSettings,
    redis_settings: RedisSettings,
    buckets: S3Settings,  # noqa: F811
    ray_settings: RaySettings,
    tmp_path: Path,
) -> AsyncIterator[Env]:
    from llmbatch.adapters.topics import ensure_topics

    env = Env(world(kafka_settings, redis_settings, buckets, ray_settings), tmp_path)
    await ensure_topics(env.settings)
    env.spawn("d1")
    try:
        yield env
    finally:
        await env.close()


async def test_the_sdk_alone_runs_a_batch_on_the_real_stack(sdk: Path, stack: Env) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMBATCH_")}
    env.update(
        {
            k: v
            for k, v in settings_env(stack.settings).items()
            if k.startswith(("LLMBATCH_KAFKA__", "LLMBATCH_S3__"))
        }
    )
    said = _run(
        sdk,
        f"""
        from llmbatch.producer import SyncBatchClient
        lines = [{{"custom_id": f"q-{{i}}", "method": "POST", "url": "/v1/chat/completions",
                  "body": {{"model": {MODEL!r}, "messages": [{{"role": "user", "content": f"Say {{i}}"}}],
                           "max_tokens": 8}}}} for i in range(3)]
        with SyncBatchClient() as client:
            handle = client.submit(lines, model={MODEL!r})
            done = client.wait(handle.batch_id, timeout=480)
            print(done.type.value, done.data.request_counts.completed)
            results = client.results_by_custom_id(done.data)
            print(sorted(results), sorted({{line.response.status_code for line in results.values()}}))
        """,
        env=env,
    ).splitlines()
    assert said == ["llmbatch.batch.completed.v1 3", "['q-0', 'q-1', 'q-2'] [200]"], said
    # the README's SDK example, as written there
    readme = (ROOT / "README.md").read_text()
    example = readme.split("<!-- sdk-example -->\n```python\n", 1)[1].split("```", 1)[0]
    printed = _run(sdk, example, env=env).splitlines()
    answered = sorted(line.split()[0] for line in printed[1:])
    assert printed[0] == "completed" and answered == ["q0", "q1"], printed
