"""ray_job command line, submit helpers, result line, progress fields, import isolation."""

from __future__ import annotations

import base64
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from llmbatch.ray_job.engines.backends import FAKE_BACKEND
from llmbatch.ray_job.errors import ExitCode, InvalidSpecError
from llmbatch.ray_job.job import spec as spec_loader
from llmbatch.ray_job.job.main import main
from llmbatch.ray_job.job.outcome import RESULT_PREFIX
from llmbatch.ray_job.job.progress import Counters, Progress, progress_fields
from llmbatch.ray_job.job.submit import (
    SessionRef,
    SpecTooLargeError,
    encode_spec,
    entrypoint,
    entrypoint_for_uri,
    package_dirs,
    parse_result,
    runtime_env,
    submit_kwargs,
)
from llmbatch.schemas.job import JobSpec

pytestmark = pytest.mark.unit


def make_spec(**kw: Any) -> JobSpec:
    data: dict[str, Any] = {
        "batch_id": "b-1",
        "attempt": 2,
        "endpoint": "/v1/chat/completions",
        "model": "m",
        "input_uri": "s3://in-bucket/k.jsonl",
        "output_prefix": "s3://out-bucket/default/b-1/",
        "engine": {"backend": FAKE_BACKEND},
    }
    data.update(kw)
    return JobSpec.model_validate(data)


def test_every_spec_source_gives_the_same_spec(tmp_path: Path) -> None:
    spec = make_spec()
    raw = spec.model_dump_json()
    path = tmp_path / "spec.json"
    path.write_text(raw)
    plain_b64 = base64.urlsafe_b64encode(raw.encode()).decode()
    for argv in (
        ["--spec-json", raw],
        ["--spec-file", str(path)],
        ["--spec-b64", encode_spec(spec)],
        ["--spec-b64", plain_b64],
    ):
        assert spec_loader.load(argv) == spec


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--spec-json", "{"],
        ["--spec-json", '{"batch_id": "x"}'],
        ["--spec-b64", "@@@"],
        ["--spec-b64", base64.urlsafe_b64encode(b"\x00\x01nonsense").decode()],
        ["--spec-file", "/nonexistent/x"],
    ],
)
def test_bad_specs_are_invalid(argv: list[str]) -> None:
    with pytest.raises(InvalidSpecError):
        spec_loader.load(argv)


def test_output_prefix_must_belong_to_the_batch() -> None:
    with pytest.raises(ValueError, match="output_prefix"):
        make_spec(output_prefix="s3://out-bucket/default/other/")


def test_main_exits_65_with_a_result_line_for_an_invalid_spec(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--spec-json", '{"batch_id": "x"}'])
    assert code == ExitCode.INVALID_SPEC and int(code) == 65
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert out.startswith(RESULT_PREFIX)
    result = parse_result(out)
    assert result is not None and result["status"] == "failed" and result["exit_code"] == 65
    assert result["error"]["code"] == "invalid_job_spec"


def test_submit_helpers() -> None:
    spec = make_spec()
    env = runtime_env(
        s3_endpoint="http://127.0.0.1:9000",
        engine_env={"VLLM_CPU_KVCACHE_SPACE": "1"},
        env_vars={"X": "1"},
    )
    assert env["py_modules"] == package_dirs()
    # one folder named llmbatch: a Ray node imports llmbatch.ray_job and llmbatch.schemas, and no more
    [shipped] = env["py_modules"]
    assert Path(shipped).name == "llmbatch" and sorted(p.name for p in Path(shipped).iterdir()) == [
        "ray_job",
        "schemas",
    ]
    assert env["env_vars"]["LLMBATCH_S3__ENDPOINT"] == "http://127.0.0.1:9000"
    assert env["env_vars"]["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["env_vars"]["X"] == "1"
    secret_names = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "LLMBATCH_REDIS__PASSWORD"}
    assert not secret_names & set(env["env_vars"])
    assert env["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"] == "15"
    kwargs = submit_kwargs(spec, env, python="/opt/py/bin/python")
    assert kwargs["submission_id"] == "b-1-a2" and kwargs["entrypoint_num_cpus"] == 0
    command = kwargs["entrypoint"]
    assert command.startswith("/opt/py/bin/python -P -m llmbatch.ray_job --spec-b64 ")
    assert spec_loader.load(command.split()[-2:]) == spec
    assert submit_kwargs(spec, env, spec_uri="s3://b/s.json")["entrypoint"].endswith(
        "--spec-uri s3://b/s.json"
    )
    with pytest.raises(ValueError, match="unsafe"):
        entrypoint_for_uri("s3://b/x; rm -rf /")


def test_a_session_reference_rides_the_command_line_quoted_and_is_parsed_back() -> None:
    spec = make_spec()
    ref = SessionRef(redis_url="redis://job@redis:6379/0?ssl_cert_reqs=none&x=1", key="p:s3session:a b")
    command = entrypoint(spec, python="python", session=ref)
    argv = shlex.split(command)[4:]  # what the shell hands python -P -m llmbatch.ray_job
    args = spec_loader.parse_args(argv)
    assert (args.s3_session_key, args.s3_session_redis) == (ref.key, ref.redis_url)
    assert spec_loader.load_spec(args) == spec
    uri_args = spec_loader.parse_args(shlex.split(entrypoint_for_uri("s3://b/s.json", session=ref))[4:])
    assert uri_args.spec_uri == "s3://b/s.json" and uri_args.s3_session_key == ref.key
    with pytest.raises(ValueError, match="no password"):
        SessionRef(redis_url="redis://job:pw@redis:6379/0", key="k").arguments()
    with pytest.raises(InvalidSpecError, match="go together"):
        spec_loader.parse_args(["--spec-json", "{}", "--s3-session-key", "k"])


def test_huge_inline_specs_need_a_spec_uri() -> None:
    import random

    rnd = random.Random(0)
    requests = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "".join(rnd.choices("abcdefghij", k=400))}]},
        }
        for i in range(800)
    ]
    spec = make_spec(input_uri=None, requests=requests)
    with pytest.raises(SpecTooLargeError):
        entrypoint(spec)


def test_parse_result_takes_the_last_result_line() -> None:
    logs = "\n".join(
        [
            "noise",
            RESULT_PREFIX + '{"a": 1}',
            "INFO x " + RESULT_PREFIX + '{"a": 2}',
            RESULT_PREFIX + "{broken",
            "tail",
        ]
    )
    assert parse_result(logs) == {"a": 2}
    assert parse_result("nothing") is None


def test_progress_fields_and_disabled_progress() -> None:
    fields = progress_fields(Counters(3, 1, 30, 9, None), 2, 1700000000.25)
    assert fields == {
        "completed": "3",
        "failed": "1",
        "prompt_tokens": "30",
        "completion_tokens": "9",
        "attempt": "2",
        "heartbeat_at": "1700000000.250",
    }
    assert progress_fields(Counters(total=7), 1, 0)["total"] == "7"
    progress = Progress(None, None, attempt=1, interval_s=0.1, base=Counters())
    progress.start()
    progress.add(completed=2, prompt_tokens=5)
    progress.set_total(9)
    progress.close()
    assert not progress.enabled and progress.writes == 0
    assert progress.snapshot() == Counters(2, 0, 5, 0, 9)


def test_ray_job_imports_without_redis_kafka_or_llmbatch() -> None:
    """Every module of the job (what ships to Ray nodes beside the contracts) imports at once without
    Redis, Kafka, vLLM or any other part of llmbatch."""
    code = """
import sys
sys.modules['redis'] = None; sys.modules['aiokafka'] = None
import importlib, pkgutil
from llmbatch import ray_job
names = [m.name for m in pkgutil.walk_packages(ray_job.__path__, 'llmbatch.ray_job.')]
for name in names:
    if name != 'llmbatch.ray_job.__main__':
        importlib.import_module(name)
shipped = ('llmbatch.ray_job', 'llmbatch.schemas')
bad = sorted(
    n for n, m in sys.modules.items()
    if m is not None and (
        n.split('.')[0] in {'vllm', 'redis', 'aiokafka'}
        or (n.startswith('llmbatch.') and not n.startswith(shipped))
    )
)
print('MODULES', len(names))
print('BAD', bad)
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "BAD []" in proc.stdout, proc.stdout
    counted = int(proc.stdout.split("MODULES ", 1)[1].split()[0])
    assert counted >= 40, proc.stdout  # the walk really reached the job's modules


def test_failure_codes() -> None:
    from llmbatch.ray_job.errors import EngineDeadError, InputNotFoundError
    from llmbatch.ray_job.job.outcome import failure_code

    assert failure_code(EngineDeadError("x")) == "engine_dead"
    assert failure_code(InputNotFoundError("x")) == "input_not_found"
    wrapped = RuntimeError("RayTaskError: ... ray_job.errors.EngineDeadError: gone")
    assert failure_code(wrapped) == "engine_dead"
    assert failure_code(OSError(5, "io")) == "job_failed"
