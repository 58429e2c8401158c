"""dispatcher.results against a real MinIO: what a job left (its manifest, or its shards when it stopped
early), object sizes, spec uploads, and how S3's failures are told apart (missing, refused, down)."""

from __future__ import annotations

import io
import uuid
from datetime import UTC, datetime

import pytest
from minio import Minio
from pydantic import SecretStr

from llmbatch.dispatcher.errors import ManifestInvalid, StorageUnavailable
from llmbatch.dispatcher.runs.results import ResultStore
from llmbatch.schemas.job import MANIFEST_NAME, Manifest, Timings
from llmbatch.settings import S3Settings

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def minio(s3_settings: S3Settings) -> Minio:
    client = Minio(
        s3_settings.host,
        access_key=s3_settings.access_key.get_secret_value(),
        secret_key=s3_settings.secret_key.get_secret_value(),
        secure=False,
    )
    if not client.bucket_exists(s3_settings.results_bucket):
        client.make_bucket(s3_settings.results_bucket)
    return client


@pytest.fixture
def prefix(s3_settings: S3Settings) -> str:
    """A batch's results prefix of its own, as the job writes under it."""
    return f"s3://{s3_settings.results_bucket}/acme/b-{uuid.uuid4().hex[:8]}/"


def _put(minio: Minio, uri: str, data: bytes) -> None:
    bucket, _, key = uri[5:].partition("/")
    minio.put_object(bucket, key, io.BytesIO(data), len(data))


async def test_a_manifest_is_read_none_when_absent_and_refused_when_broken(
    minio: Minio, s3_settings: S3Settings, prefix: str
) -> None:
    results = ResultStore(s3_settings)
    assert await results.read_manifest(prefix) is None
    now = datetime.now(UTC)
    timings = Timings(started_at=now, finished_at=now)
    written = Manifest(batch_id="b", attempt=2, status="completed", timings=timings)
    _put(minio, prefix + MANIFEST_NAME, written.to_json())
    read = await results.read_manifest(prefix)
    assert read is not None and (read.batch_id, read.attempt, read.status) == ("b", 2, "completed")
    _put(minio, prefix + MANIFEST_NAME, b'{"batch_id": "b"')
    with pytest.raises(ManifestInvalid, match=MANIFEST_NAME):
        await results.read_manifest(prefix)


async def test_only_result_shards_are_listed_in_order(
    minio: Minio, s3_settings: S3Settings, prefix: str
) -> None:
    for name in (
        "output-a2-00001.jsonl",
        "error-00000.jsonl",
        "output-a1-00000.jsonl",
        "specs/a1.json",
        MANIFEST_NAME,
        "output-notes.txt",
        "lifecycle-2/output-00000.jsonl",
    ):
        _put(minio, prefix + name, b"{}\n")
    shards = await ResultStore(s3_settings).list_shards(prefix)
    assert shards.output_uris == [
        prefix + "lifecycle-2/output-00000.jsonl",
        prefix + "output-a1-00000.jsonl",
        prefix + "output-a2-00001.jsonl",
    ]
    assert shards.error_uris == [prefix + "error-00000.jsonl"]
    nowhere = await ResultStore(s3_settings).list_shards("s3://no-such-bucket-llmbatch/acme/b/")
    assert (nowhere.output_uris, nowhere.error_uris) == ([], [])


async def test_sizes_and_spec_uploads(minio: Minio, s3_settings: S3Settings, prefix: str) -> None:
    results = ResultStore(s3_settings)
    assert await results.object_size(prefix + "input.jsonl") is None
    _put(minio, prefix + "input.jsonl", b"x" * 1234)
    assert await results.object_size(prefix + "input.jsonl") == 1234
    await results.put_bytes(prefix + "specs/a1.json", b'{"a": 1}')
    key = prefix.split("/", 3)[3] + "specs/a1.json"
    assert minio.get_object(s3_settings.results_bucket, key).read() == b'{"a": 1}'
    assert await results.ping()


async def test_refused_keys_and_a_dead_endpoint_make_batches_wait(
    s3_settings: S3Settings, prefix: str
) -> None:
    # the dispatcher's own keys refused: every batch waits (none is failed) and the error names the fix
    wrong = s3_settings.model_copy(update={"secret_key": SecretStr("not-the-key")})
    with pytest.raises(StorageUnavailable, match="LLMBATCH_S3__SECRET_KEY") as refused:
        await ResultStore(wrong).object_size(prefix + "x")
    assert refused.value.retriable and "AccessDenied" in str(refused.value)
    down = s3_settings.model_copy(update={"endpoint": "http://127.0.0.1:9"})
    with pytest.raises(StorageUnavailable) as outage:
        await ResultStore(down).read_manifest(prefix)
    assert outage.value.retriable
