"""Job submission arguments, job spec building and error classification (pure)."""

from __future__ import annotations

import json
import sys

import pytest
from pydantic import SecretStr, ValidationError

from llmbatch.dispatcher.backends.ray_backend import _status_code, build_submission
from llmbatch.dispatcher.domain.batch_record import BatchRecord
from llmbatch.dispatcher.domain.keys import Keys, batch_key
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.errors import (
    KafkaUnavailable,
    PermanentError,
    StateStoreUnavailable,
    TransientError,
    classify,
)
from llmbatch.dispatcher.job_options import JobOptions
from llmbatch.dispatcher.runs.jobspec import build_job_spec
from llmbatch.dispatcher.settings import DispatcherSettings
from llmbatch.ray_job.engines.backends import FAKE_BACKEND
from llmbatch.schemas.engines import EngineModel, EngineRegistry, UnknownModelError
from llmbatch.schemas.job import EngineConfig
from llmbatch.settings import RedisSettings, S3Settings
from tests.support.dispatcher_kit import MODEL, batch_request, inline_lines, registry, request_message

pytestmark = pytest.mark.unit


ACCESS_KEY, SECRET_KEY, REDIS_PASSWORD = "AKIA-test-access", "s3-secret-value", "redis-pass-value"


def settings(engines: EngineRegistry | None = None, **job: object) -> DispatcherSettings:
    return DispatcherSettings(
        _env_file=None,
        s3=S3Settings(
            endpoint="http://minio:9000", access_key=SecretStr(ACCESS_KEY), secret_key=SecretStr(SECRET_KEY)
        ),
        redis=RedisSettings(url="redis://redis:6379/0", password=SecretStr(REDIS_PASSWORD), key_prefix="p"),
        job=JobOptions(**job),
        engines=engines if engines is not None else registry(),
    )


def record(batch_id: str = "b-1", **extra: str) -> BatchRecord:
    request = batch_request(batch_id, requests=inline_lines(2), tenant="acme")
    _, value, _ = request_message(request)
    fields = {
        "state": "submitted",
        "version": "3",
        "request": value.decode(),
        "tenant": "acme",
        "deadline": "1790000000.5",
        "attempt": "2",
    }
    fields.update(extra)
    return BatchRecord.from_hash(batch_key("acme", batch_id), fields)


def test_job_spec_from_record() -> None:
    s = settings(registry(path="/models/smol"), shard_max_lines=7)
    spec = build_job_spec(record(), 2, s, Keys("p"))
    assert spec.submission_id == "b-1-a2"
    assert spec.output_prefix == "s3://llmbatch-results/acme/b-1/"
    assert spec.requests is not None and len(spec.requests) == 2
    assert spec.progress_key == "p:progress:acme/b-1" and spec.redis_url == "redis://redis:6379/0"
    assert spec.model == MODEL and spec.model_path == "/models/smol" and spec.shard_max_lines == 7
    assert spec.deadline is not None and spec.deadline.timestamp() == 1790000000.5
    assert spec.engine.backend == FAKE_BACKEND
    # deterministic: a resubmission sends the same spec
    assert build_job_spec(record(), 2, s, Keys("p")) == spec


def test_a_lifecycle_gets_its_own_results_prefix_and_submission_ids() -> None:
    s = settings(registry(path="/models/smol"))
    spec = build_job_spec(record(lifecycle="0a1b2c3d4e"), 2, s, Keys("p"))
    assert spec.submission_id == "b-1-0a1b2c3d4e-a2" and spec.lifecycle == "0a1b2c3d4e"
    assert spec.output_prefix == "s3://llmbatch-results/acme/b-1/0a1b2c3d4e/"
    other = build_job_spec(record(lifecycle="ffff000011"), 2, s, Keys("p"))
    assert other.submission_id != spec.submission_id and other.output_prefix != spec.output_prefix


def test_job_spec_takes_path_and_engine_from_the_models_registry_entry() -> None:
    small = EngineConfig(backend="vllm", enforce_eager=True, dtype="bfloat16", batch_size=4)
    engines = EngineRegistry(
        models={
            "other/model": EngineModel(path="/models/other", engine=EngineConfig(backend=FAKE_BACKEND)),
            MODEL: EngineModel(path="/models/smollm2", engine=small),
        }
    )
    spec = build_job_spec(record(), 1, settings(engines), Keys("p"))
    assert spec.model == MODEL and spec.model_path == "/models/smollm2"
    assert spec.engine == small


def test_job_spec_of_a_model_no_longer_served_is_refused_not_run_on_another() -> None:
    engines = registry(models=("other/model",))
    with pytest.raises(UnknownModelError) as info:
        build_job_spec(record(), 1, settings(engines), Keys("p"))
    assert info.value.model == MODEL and info.value.known == ["other/model"]
    assert MODEL in str(info.value) and "other/model" in str(info.value)


def test_vllm_cache_env_follows_the_models_engine() -> None:
    fake = settings(engine_cache_dir="/cache")
    real = settings(registry(EngineConfig(backend="vllm")), engine_cache_dir="/cache")
    fake_env = build_submission(fake, build_job_spec(record(), 1, fake, Keys("p")))["runtime_env"]["env_vars"]
    real_env = build_submission(real, build_job_spec(record(), 1, real, Keys("p")))["runtime_env"]["env_vars"]
    assert not any(k.startswith("VLLM_") for k in fake_env)
    assert any(k.startswith("VLLM_") for k in real_env)


def test_submission_kwargs() -> None:
    s = settings(
        python=sys.executable, pip=["x==1"], entrypoint_resources={"worker": 1.0}, env_vars={"EXTRA": "1"}
    )
    spec = build_job_spec(record(), 2, s, Keys("p"))
    kwargs = build_submission(s, spec)
    assert kwargs["submission_id"] == "b-1-a2"
    entrypoint = kwargs["entrypoint"]
    assert entrypoint.startswith(sys.executable) and " -m llmbatch.ray_job --spec-b64 " in entrypoint
    assert kwargs["entrypoint_num_cpus"] == 0 and kwargs["entrypoint_resources"] == {"worker": 1.0}
    env = kwargs["runtime_env"]
    assert env["pip"] == ["x==1"] and len(env["py_modules"]) == 1
    variables = env["env_vars"]
    assert variables["LLMBATCH_S3__ENDPOINT"] == "http://minio:9000" and variables["EXTRA"] == "1"
    assert variables["AWS_ENDPOINT_URL_S3"] == "http://minio:9000"
    assert kwargs["metadata"]["batch_id"] == "b-1"
    # no secret in anything the Jobs API and the dashboard show (the workers have them in their env)
    shown = json.dumps(kwargs)
    assert not [x for x in (ACCESS_KEY, SECRET_KEY, REDIS_PASSWORD) if x in shown]
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "LLMBATCH_REDIS__PASSWORD"} & set(variables)
    # a job never calls the batch runner: its processes start with the runner's credential blanked
    assert variables["LLMBATCH_RAY__RUNNER_TOKEN"] == ""


def test_sending_s3_keys_to_jobs_is_refused_naming_the_fix() -> None:
    with pytest.raises(ValidationError, match=r"pass_s3_credentials[\s\S]*AWS_SECRET_ACCESS_KEY in their"):
        settings(pass_s3_credentials=True)
    s = settings(pass_s3_credentials=False, pass_redis_url=False, ship_modules=False, s3_sessions=False)
    spec = build_job_spec(record(), 1, s, Keys("p"))
    assert spec.redis_url is None and spec.progress_key is None
    assert "py_modules" not in build_submission(s, spec)["runtime_env"]


def test_job_s3_sessions_need_the_jobs_redis_url() -> None:
    with pytest.raises(ValidationError, match="PASS_REDIS_URL=true or LLMBATCH_JOB__S3_SESSIONS=false"):
        settings(pass_redis_url=False)
    assert settings().job.s3_sessions  # on by default


@pytest.mark.parametrize(
    ("shared", "model_path", "blanked"),
    [
        (True, "/models/smol", True),
        (True, "s3://models/smol", True),  # the shared engine loads it, not the job
        (False, "/models/smol", True),
        (False, "s3://models/smol", False),  # the job's own engine loads the weights with the node's keys
    ],
)
def test_a_job_with_its_own_s3_session_starts_without_the_nodes_s3_keys(
    shared: bool, model_path: str, blanked: bool
) -> None:
    from llmbatch.ray_job.job.submit import SessionRef

    s = settings(registry(path=model_path))
    spec = build_job_spec(record(), 1, s, Keys("p"))
    spec = spec.model_copy(update={"engine_app": "llmbatch-engine-m" if shared else None})
    ref = SessionRef(redis_url="redis://job@redis:6379/0", key="p:s3session:abc-123_x")
    kwargs = build_submission(s, spec, session=ref)
    variables = kwargs["runtime_env"]["env_vars"]
    names = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
    if blanked:
        assert {name: variables.get(name) for name in names} == dict.fromkeys(names, "")
    else:
        assert not set(names) & set(variables)
    assert "LLMBATCH_REDIS__PASSWORD" not in variables  # the job takes its session with it
    assert kwargs["entrypoint"].endswith(
        " --s3-session-key p:s3session:abc-123_x --s3-session-redis redis://job@redis:6379/0"
    )
    plain = build_submission(s, spec)  # no session: the node's keys, nothing blanked, no session arguments
    assert not set(names) & set(plain["runtime_env"]["env_vars"])
    assert "--s3-session" not in plain["entrypoint"]


def test_status_code_parsing() -> None:
    assert _status_code(RuntimeError("Request failed with status code 404: Job x does not exist.")) == 404
    assert _status_code(RuntimeError("Request failed with status code 500: boom")) == 500
    assert _status_code(RuntimeError("something else")) is None


def test_classify_library_errors() -> None:
    import redis.exceptions as rexc
    from aiokafka.errors import KafkaConnectionError, RecordTooLargeError

    assert isinstance(classify(rexc.ConnectionError("x")), StateStoreUnavailable)
    assert isinstance(classify(rexc.ResponseError("LOADING Redis is loading")), StateStoreUnavailable)
    assert isinstance(classify(rexc.ResponseError("ERR syntax")), PermanentError)
    assert isinstance(classify(KafkaConnectionError()), KafkaUnavailable)
    assert not classify(RecordTooLargeError()).retriable
    assert isinstance(classify(ConnectionRefusedError()), TransientError)
    assert not classify(ValueError("bug")).retriable


def test_record_helpers() -> None:
    r = record(attempt_base="1", cancel_requested="1")
    assert r.state is State.SUBMITTED and r.attempt == 2 and r.attempts_made == 1
    assert r.flag("cancel_requested") and not r.flag("published")
    assert r.deadline == 1790000000.5


@pytest.mark.parametrize(
    ("url", "bare", "password"),
    [
        ("redis://:s3cr3t@redis:6379/0", "redis://redis:6379/0", "s3cr3t"),
        ("rediss://worker:p%40ss@redis:6380/1", "rediss://worker@redis:6380/1", "p@ss"),
        ("redis://redis:6379/0", "redis://redis:6379/0", None),
    ],
)
def test_a_password_in_the_redis_url_stays_out_of_the_job_spec(
    url: str, bare: str, password: str | None
) -> None:
    """The spec goes on the job's command line and may be uploaded to the results bucket: the URL in
    it carries no password; the job reads it from LLMBATCH_REDIS__PASSWORD."""
    s = settings()
    s.redis = RedisSettings(url=url, key_prefix="p")
    spec = build_job_spec(record(), 2, s, Keys("p"))
    assert spec.redis_url == bare
    if password is not None:
        assert password not in spec.model_dump_json()
    kwargs = build_submission(s, spec)
    assert "LLMBATCH_REDIS__PASSWORD" not in kwargs["runtime_env"]["env_vars"]
    if password is not None:
        assert password not in json.dumps(kwargs)


@pytest.mark.parametrize(
    ("env_vars", "named"),
    [
        ({"HF_TOKEN": "hf_abc"}, "job.env_vars.HF_TOKEN holds a credential's name"),
        ({"MY_DB_PASSWORD": "x"}, "job.env_vars.MY_DB_PASSWORD holds a credential's name"),
        ({"S3_KEY": SECRET_KEY}, "job.env_vars.S3_KEY holds the value of s3.secret_key"),
        ({"URL": f"redis://:{REDIS_PASSWORD}@r:6379"}, "job.env_vars.URL holds the value of redis.password"),
    ],
)
def test_a_secret_in_the_jobs_env_vars_is_refused(env_vars: dict[str, str], named: str) -> None:
    """job.env_vars go into every runtime_env, which the Ray dashboard shows."""
    with pytest.raises(ValidationError, match=named + r"[\s\S]*in their own environment"):
        settings(env_vars=env_vars)
    assert settings(env_vars={"TOKENIZERS_PARALLELISM": "false", "KEYRING": "x"})  # harmless names pass


def test_the_jobs_connect_as_their_own_redis_user() -> None:
    s = settings(redis_username="job")
    s.redis = RedisSettings(url="redis://dispatcher@redis:6379/0", password=SecretStr(REDIS_PASSWORD))
    spec = build_job_spec(record(), 1, s, Keys("p"))
    assert spec.redis_url == "redis://job@redis:6379/0"
    with pytest.raises(ValidationError, match="redis_username"):
        settings(redis_username="job user")


def test_the_ray_side_may_reach_redis_by_an_address_of_its_own() -> None:
    """The jobs' and the runner's Redis URL: the dispatcher's host by default, LLMBATCH_JOB__REDIS_URL when
    the Ray nodes reach Redis another way; never a password, the jobs' user when one is set."""
    assert settings().job_redis_url() == "redis://redis:6379/0"
    assert settings(redis_username="job").job_redis_url() == "redis://job@redis:6379/0"
    own = settings(redis_url="redis://redis.ray-side.svc:6380/0", redis_username="job")
    assert own.job_redis_url() == "redis://job@redis.ray-side.svc:6380/0"
    spec = build_job_spec(record(), 1, own, Keys("p"))
    assert spec.redis_url == "redis://job@redis.ray-side.svc:6380/0"
    assert settings(pass_redis_url=False, s3_sessions=False).job_redis_url() is None
    for bad in ("redis://u:pw@host:6379/0", "redis://user@host", "http://host:6379", "redis://host:6379/0 x"):
        with pytest.raises(ValidationError, match="redis_url"):
            settings(redis_url=bad)
