"""The real MinIO server: objects, multipart, auth, pyarrow and Ray Data against it."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from minio import Minio
from minio.error import S3Error

from llmbatch.settings import RaySettings, S3Settings
from tests.support.services import ServiceProvider

pytestmark = pytest.mark.integration


def _client(s3: S3Settings, secret: str | None = None) -> Minio:
    return Minio(
        s3.host,
        access_key=s3.access_key.get_secret_value(),
        secret_key=secret if secret is not None else s3.secret_key.get_secret_value(),
        secure=s3.secure,
        region=s3.region,
    )


@pytest.fixture(scope="module")
def bucket(s3_settings: S3Settings) -> str:
    name = f"test-{uuid.uuid4().hex[:12]}"
    _client(s3_settings).make_bucket(name)
    return name


def test_put_get(s3_settings: S3Settings, bucket: str) -> None:
    client = _client(s3_settings)
    client.put_object(bucket, "a/b.txt", io.BytesIO(b"hello"), 5)
    resp = client.get_object(bucket, "a/b.txt")
    try:
        assert resp.read() == b"hello"
    finally:
        resp.close()
        resp.release_conn()


async def test_the_apis_conditional_write_creates_once_and_never_overwrites(
    s3_settings: S3Settings, bucket: str
) -> None:
    """api.store.storage's put_new (S3's If-None-Match: *), what idempotent creates claim their key with:
    the first write wins, a second leaves it as it is; other errors are not taken for "exists"."""
    import asyncio

    from llmbatch.adapters.errors import StorageError
    from llmbatch.api.store.storage import MinioObjectStore

    store = MinioObjectStore(s3_settings)
    key = f"claims/{uuid.uuid4().hex}.json"
    results = await asyncio.gather(
        *(
            store.put_new(bucket, key, f'{{"n": {n}}}'.encode(), content_type="application/json")
            for n in range(8)
        )
    )
    assert sorted(results) == [False] * 7 + [True]  # concurrent: exactly one wins
    winner = results.index(True)
    assert await store.get(bucket, key) == f'{{"n": {winner}}}'.encode()
    with pytest.raises(StorageError):
        await store.put_new(f"no-such-{uuid.uuid4().hex[:8]}", key, b"{}", content_type="application/json")


async def test_a_files_uses_are_empty_markers_listed_back_by_batch_id(
    s3_settings: S3Settings, bucket: str
) -> None:
    """api.store.records' use markers (what keeps a file a batch may still read from being deleted) on the
    real server: empty objects under the file's folder, listed back as batch ids."""
    from llmbatch.api.store.records import Layout, RecordStore, new_id
    from llmbatch.api.store.storage import MinioObjectStore

    records = RecordStore(MinioObjectStore(s3_settings), Layout(bucket))
    tenant = f"t{uuid.uuid4().hex[:8]}"
    file_id, other = new_id("file-", 1.79e9), new_id("file-", 1.79e9)
    batches = [new_id("batch_", 1.79e9 + n) for n in range(3)]
    for batch_id in batches:
        await records.add_use(tenant, file_id, batch_id)
    await records.add_use(tenant, other, new_id("batch_", 1.79e9))
    await records.add_use(tenant, "../not-a-file", batches[0])  # never builds a key from a bad id
    assert sorted(await records.uses(tenant, file_id)) == sorted(batches)
    assert await records.uses(tenant, "file-unknown") == []
    marker = f"{tenant}/api/file-uses/{file_id}/{batches[0]}"
    assert _client(s3_settings).stat_object(bucket, marker).size == 0


async def test_active_marks_are_listed_newest_first_and_dropped(s3_settings: S3Settings, bucket: str) -> None:
    """api.store.records' active-batch marks (what the API's active-batch quota counts) on the real server."""
    from llmbatch.api.store.records import BATCH_PREFIX, Layout, RecordStore, made_at, new_id
    from llmbatch.api.store.storage import MinioObjectStore

    records = RecordStore(MinioObjectStore(s3_settings), Layout(bucket))
    tenant = f"t{uuid.uuid4().hex[:8]}"
    batches = [new_id(BATCH_PREFIX, 1.79e9 + n) for n in range(3)]
    for batch_id in batches:
        await records.add_active(tenant, batch_id)
    await records.add_active(tenant, "../not-a-batch")  # never builds a key from a bad id
    assert await records.active(tenant, limit=10) == batches[::-1]
    assert await records.active(tenant, limit=2) == batches[:0:-1]
    await records.drop_active(tenant, batches[1])
    assert await records.active(tenant, limit=10) == [batches[2], batches[0]]
    assert made_at(batches[2], BATCH_PREFIX) == 1.79e9 + 2


async def test_the_storage_quota_counts_the_bytes_under_a_prefix(
    s3_settings: S3Settings, bucket: str
) -> None:
    """api.store.storage's total_size (what the API's storage quota reads): one listing, sizes summed."""
    from llmbatch.api.store.storage import MinioObjectStore

    store = MinioObjectStore(s3_settings)
    prefix = f"quota-{uuid.uuid4().hex[:8]}/files/"
    assert await store.total_size(bucket, prefix) == 0
    for n, size in enumerate((10, 0, 3000)):
        await store.put(bucket, f"{prefix}f{n}.jsonl", io.BytesIO(b"x" * size), size, content_type="x")
    await store.put(bucket, f"{prefix[:-1]}-other/f.jsonl", io.BytesIO(b"y"), 1, content_type="x")
    assert await store.total_size(bucket, prefix) == 3010


def test_multipart_upload_20mb(s3_settings: S3Settings, bucket: str) -> None:
    client = _client(s3_settings)
    payload = os.urandom(20 * 1024 * 1024)
    # part_size 5 MiB forces a 4-part multipart upload
    client.put_object(bucket, "big.bin", io.BytesIO(payload), -1, part_size=5 * 1024 * 1024)
    stat = client.stat_object(bucket, "big.bin")
    assert stat.size == len(payload)
    assert stat.etag and stat.etag.endswith("-4"), f"expected a 4-part multipart ETag, got {stat.etag}"
    resp = client.get_object(bucket, "big.bin")
    try:
        assert hashlib.sha256(resp.read()).digest() == hashlib.sha256(payload).digest()
    finally:
        resp.close()
        resp.release_conn()


def test_wrong_secret_is_rejected(s3_settings: S3Settings, services: ServiceProvider, bucket: str) -> None:
    if services.sources.get("minio") == "local stack":
        assert services.local_record("minio") is not None
    with pytest.raises(S3Error) as info:
        _client(s3_settings, secret="definitely-not-the-secret").list_objects(bucket).__next__()
    assert info.value.code in {"SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied"}


def test_pyarrow_s3_jsonl_roundtrip(s3_settings: S3Settings, bucket: str) -> None:
    from pyarrow import fs

    s3fs = fs.S3FileSystem(
        access_key=s3_settings.access_key.get_secret_value(),
        secret_key=s3_settings.secret_key.get_secret_value(),
        endpoint_override=s3_settings.endpoint,
        region=s3_settings.region,
        scheme="https" if s3_settings.secure else "http",
    )
    lines = [json.dumps({"custom_id": f"r{i}", "n": i}) for i in range(100)]
    with s3fs.open_output_stream(f"{bucket}/pa/input.jsonl") as out:
        out.write(("\n".join(lines) + "\n").encode())
    with s3fs.open_input_stream(f"{bucket}/pa/input.jsonl") as inp:
        back = inp.read().decode().splitlines()
    assert back == lines
    # the object is byte-exact through the S3 API too (no aws-chunked framing stored inside)
    resp = _client(s3_settings).get_object(bucket, "pa/input.jsonl")
    try:
        assert resp.read().decode().splitlines() == lines
    finally:
        resp.close()
        resp.release_conn()


def test_ray_data_read_write_json(
    s3_settings: S3Settings, ray_settings: RaySettings, services: ServiceProvider, bucket: str
) -> None:
    lines = [json.dumps({"custom_id": f"r{i}", "n": i}) for i in range(40)]
    client = _client(s3_settings)
    body = ("\n".join(lines) + "\n").encode()
    client.put_object(bucket, "rd/in/input.jsonl", io.BytesIO(body), len(body))
    rec = services.local_record("ray")
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "disabled",
        "AWS_ACCESS_KEY_ID": s3_settings.access_key.get_secret_value(),
        "AWS_SECRET_ACCESS_KEY": s3_settings.secret_key.get_secret_value(),
    }
    if rec is not None:
        env["RAY_ADDRESS"] = rec.extra["gcs_address"]
    script = Path(__file__).parent.parent / "support" / "ray_data_s3_roundtrip.py"
    proc = subprocess.run(
        [sys.executable, str(script), s3_settings.endpoint, bucket],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    written = [o.object_name for o in client.list_objects(bucket, prefix="rd/out/", recursive=True)]
    assert written, "Ray Data wrote nothing"
    rows = []
    for name in written:
        resp = client.get_object(bucket, name)
        try:
            rows += [json.loads(x) for x in resp.read().decode().splitlines() if x.strip()]
        finally:
            resp.close()
            resp.release_conn()
    assert sorted(r["custom_id"] for r in rows) == sorted(f"r{i}" for i in range(40))
    assert all(r["doubled"] == 2 * r["n"] for r in rows)
