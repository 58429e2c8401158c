"""A runner batch's own S3 session on the real MinIO (dispatcher.s3_sessions, issue 14): the keys the
dispatcher mints for one batch reach its input object and its output prefix, and nothing else, even in
a process whose environment holds keys that reach everything."""

from __future__ import annotations

import io
import uuid

import pytest
from minio import Minio
from pyarrow import fs as pafs
from pydantic import SecretStr

from llmbatch.dispatcher.backends.ray_backend import RayJobsBackend
from llmbatch.dispatcher.backends.s3_sessions import JobSessions, SessionMinter
from llmbatch.dispatcher.errors import JobRejected, RayUnavailable, StorageUnavailable
from llmbatch.dispatcher.settings import DispatcherSettings
from llmbatch.dispatcher.state.store import StateStore
from llmbatch.ray_job.engines.backends import FAKE_BACKEND
from llmbatch.ray_job.errors import InputNotFoundError
from llmbatch.ray_job.storage import s3
from llmbatch.schemas.common import BatchStatus
from llmbatch.schemas.job import JobSpec, output_prefix
from llmbatch.settings import RaySettings, RedisSettings, S3Settings
from llmbatch.stack.ports import free_port

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def client(s3_settings: S3Settings) -> Minio:
    minio = Minio(
        s3_settings.host,
        access_key=s3_settings.access_key.get_secret_value(),
        secret_key=s3_settings.secret_key.get_secret_value(),
        secure=False,
    )
    for bucket in (s3_settings.input_bucket, s3_settings.results_bucket):
        if not minio.bucket_exists(bucket):
            minio.make_bucket(bucket)
    return minio


@pytest.fixture
def all_keys_env(node_s3_env: None) -> None:
    """The process's environment holds keys that reach everything (as the runner's node does)."""


def _put(client: Minio, bucket: str, key: str, data: bytes = b'{"x": 1}\n') -> str:
    client.put_object(bucket, key, io.BytesIO(data), len(data))
    return f"s3://{bucket}/{key}"


def _spec(s3_settings: S3Settings, tenant: str, batch_id: str, input_uri: str) -> JobSpec:
    prefix = output_prefix(s3_settings.results_bucket, tenant, batch_id)
    return JobSpec(
        batch_id=batch_id,
        attempt=1,
        endpoint="/v1/chat/completions",
        model="m",
        tenant=tenant,
        input_uri=input_uri,
        output_prefix=prefix,
    )


def _refused(action: object) -> bool:
    try:
        action()  # type: ignore[operator]
    except (OSError, InputNotFoundError) as exc:
        return isinstance(exc, InputNotFoundError) or s3.is_refusal(exc)
    return False


def test_a_batchs_session_reaches_its_input_and_its_prefix_only(
    s3_settings: S3Settings, client: Minio, all_keys_env: None
) -> None:
    run = uuid.uuid4().hex[:8]
    inputs, results = s3_settings.input_bucket, s3_settings.results_bucket
    mine = _put(client, inputs, f"acme/{run}/in.jsonl")
    other_input_of_mine = _put(client, inputs, f"acme/{run}/other.jsonl")
    theirs = _put(client, inputs, f"globex/{run}/in.jsonl")
    spec = _spec(s3_settings, "acme", f"b-{run}", mine)
    their_object = _put(client, results, f"globex/b-{run}/secret.jsonl")
    sibling = _put(client, results, f"acme/b2-{run}/output.jsonl")  # the same tenant's other batch

    session = SessionMinter(s3_settings, duration_s=900).mint(spec)
    assert session.expires_at is not None
    for value in (session.access_key, session.secret_key, session.session_token):
        assert value.get_secret_value() not in repr(session)
    fs = s3.filesystem(session)
    prefix = s3.path_of(spec.output_prefix)

    # its input and its prefix
    assert s3.check_readable(fs, s3.path_of(mine)) > 0
    s3.write_bytes(fs, prefix + "output-00000.jsonl", b"{}\n")
    assert s3.read_bytes(fs, prefix + "output-00000.jsonl") == b"{}\n"
    assert [i.path for i in s3.list_objects(fs, prefix)] == [prefix + "output-00000.jsonl"]
    fs.delete_file(prefix + "output-00000.jsonl")

    # nothing else, though the environment's keys reach everything
    assert _refused(lambda: s3.check_readable(fs, s3.path_of(theirs)))
    assert _refused(lambda: s3.check_readable(fs, s3.path_of(other_input_of_mine)))
    assert _refused(lambda: s3.read_bytes(fs, s3.path_of(their_object)))
    assert _refused(lambda: s3.read_bytes(fs, s3.path_of(sibling)))
    assert _refused(lambda: s3.write_bytes(fs, s3.path_of(sibling), b"overwritten\n"))
    assert _refused(lambda: s3.write_bytes(fs, f"{results}/globex/b-{run}/planted.jsonl", b"{}\n"))
    assert _refused(lambda: fs.get_file_info(pafs.FileSelector(f"{results}/acme/", recursive=True)))
    # ... which the environment's keys do reach
    env_fs = s3.filesystem()
    assert s3.check_readable(env_fs, s3.path_of(theirs)) > 0
    assert client.get_object(results, f"acme/b2-{run}/output.jsonl").read() == b'{"x": 1}\n'


def test_wrong_keys_fail_the_batch_naming_the_setting_and_no_answer_is_retriable(
    s3_settings: S3Settings,
) -> None:
    spec = _spec(s3_settings, "acme", "b-refused", f"s3://{s3_settings.input_bucket}/acme/in.jsonl")
    wrong = s3_settings.model_copy(update={"secret_key": SecretStr("not-the-secret-key")})
    with pytest.raises(JobRejected, match="RUNNER_S3_SESSIONS") as refused:
        SessionMinter(wrong).mint(spec)
    assert not refused.value.retriable and "not-the-secret-key" not in str(refused.value)
    away = s3_settings.model_copy(update={"endpoint": "http://127.0.0.1:9"})  # the discard port: closed
    with pytest.raises(StorageUnavailable) as unavailable:
        SessionMinter(away).mint(spec)
    assert unavailable.value.retriable


def test_the_runner_reads_and_writes_a_batch_with_its_session_not_its_environments_keys(
    s3_settings: S3Settings, client: Minio, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runner attempt (in this process, fake engine) whose environment holds keys MinIO refuses: with
    the batch's session it reads its input and writes its results; without it, it cannot."""
    import json

    from llmbatch.ray_job.batch_runner.runner_attempt import RunnerAttempt
    from llmbatch.ray_job.engines.backend_fake import WhitespaceTokenizer
    from llmbatch.ray_job.job.engine import LocalEngine
    from llmbatch.schemas.job import EngineConfig, parse_manifest
    from tests.integration.ray_job_harness import chat_line

    monkeypatch.setenv("LLMBATCH_S3__ENDPOINT", s3_settings.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody-has-these-keys")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "nobody-has-these-keys-secret")
    run = uuid.uuid4().hex[:8]
    data = b"".join(json.dumps(chat_line(f"c{i}", f"hello {i}")).encode() + b"\n" for i in range(3))
    uri = _put(client, s3_settings.input_bucket, f"acme/{run}/in.jsonl", data)
    engine = EngineConfig(backend=FAKE_BACKEND, batch_size=2)

    def attempt(batch_id: str, *, with_session: bool) -> tuple[int, JobSpec]:
        spec = _spec(s3_settings, "acme", batch_id, uri).model_copy(
            update={"engine": engine, "engine_app": "llmbatch-engine-fake"}
        )
        session = SessionMinter(s3_settings, duration_s=900).mint(spec) if with_session else None
        runner = RunnerAttempt(
            spec,
            tokenizer=WhitespaceTokenizer,
            keep_text=True,
            engine=lambda: LocalEngine("fake", engine),
            s3_session=session,
        )
        return runner.run(), spec

    code, spec = attempt(f"b-{run}", with_session=True)
    assert code == 0
    manifest = parse_manifest(
        client.get_object(
            s3_settings.results_bucket, spec.manifest_uri.removeprefix(f"s3://{s3_settings.results_bucket}/")
        ).read()
    )
    assert manifest.status == BatchStatus.COMPLETED and manifest.request_counts.completed == 3
    code, spec = attempt(f"b2-{run}", with_session=False)
    assert code != 0  # the environment's keys are refused: the session was what worked
    assert not list(client.list_objects(s3_settings.results_bucket, prefix=f"acme/b2-{run}/", recursive=True))


async def test_a_submit_that_makes_no_job_leaves_no_session_in_redis(
    s3_settings: S3Settings, redis_settings: RedisSettings, ray_settings: RaySettings, client: Minio
) -> None:
    """A Ray job attempt's session waits in Redis for its driver; when the submit makes no job (Ray
    not there, or the attempt exists already with a session of its own) the dispatcher drops it."""
    from ray.job_submission import JobSubmissionClient

    prefix = f"ses{uuid.uuid4().hex[:8]}"
    redis = redis_settings.model_copy(update={"key_prefix": prefix})
    store = StateStore.from_settings(redis)

    def backend(ray: RaySettings) -> RayJobsBackend:
        settings = DispatcherSettings(_env_file=None, s3=s3_settings, redis=redis, ray=ray)
        return RayJobsBackend(
            settings, timeout_s=10, sessions=JobSessions(SessionMinter(s3_settings, duration_s=900), store)
        )

    async def left() -> list[str]:
        return [key async for key in store.client.scan_iter(match=f"{prefix}:s3session:*")]

    batch_id = f"nojob-{uuid.uuid4().hex[:8]}"
    input_uri = _put(client, s3_settings.input_bucket, f"acme/{batch_id}.jsonl")
    spec = _spec(s3_settings, "acme", batch_id, input_uri)
    spec = spec.model_copy(update={"redis_url": redis.url_without_password()})
    try:
        with pytest.raises(RayUnavailable):
            await backend(RaySettings(address=f"http://127.0.0.1:{free_port()}")).submit(spec)
        assert await left() == []
        ray = JobSubmissionClient(ray_settings.address)
        ray.submit_job(entrypoint="true", submission_id=spec.submission_id)  # the attempt exists already
        assert (await backend(ray_settings).submit(spec)).already_existed
        assert await left() == []
        await store.put_s3_session("kept", b"{}", 60)  # what a made job's driver has yet to take stays
        assert await left() == [f"{prefix}:s3session:kept"]
    finally:
        await store.close()
