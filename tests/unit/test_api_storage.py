"""The MinIO adapter of the API's object-storage port (api.store.storage), over a stub ``minio`` client:
calls, limits, streaming in chunks with the response released, and errors mapped (a missing object is
ObjectMissing, anything else the producer's StorageError naming the object). And the entrypoint's
help, key hashing and wiring (no connection is made until a call needs one)."""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import urllib3
from minio.error import S3Error

from llmbatch.adapters.errors import StorageError
from llmbatch.api.__main__ import build_app, main
from llmbatch.api.settings import ApiOptions, ApiSettings
from llmbatch.api.store.storage import MinioObjectStore, ObjectMissing
from llmbatch.api.tenancy.auth import hash_api_key
from llmbatch.settings import S3Settings

pytestmark = pytest.mark.unit


def s3_error(code: str) -> S3Error:
    return S3Error(
        urllib3.HTTPResponse(),  # the store reads the code only
        code,
        f"{code} happened",
        "/b/k",
        "req",
        "host",
        bucket_name="b",
        object_name="k",
    )


@dataclass
class Response:
    data: bytes
    closed: bool = False
    released: bool = False

    def read(self) -> bytes:
        return self.data

    def stream(self, size: int) -> Iterator[bytes]:
        for start in range(0, len(self.data), size):
            yield self.data[start : start + size]

    def close(self) -> None:
        self.closed = True

    def release_conn(self) -> None:
        self.released = True


@dataclass
class Obj:
    object_name: str
    size: int = 0


@dataclass
class StubMinio:
    objects: dict[tuple[str, str], bytes] = field(default_factory=dict)
    responses: list[Response] = field(default_factory=list)
    fail: str | None = None

    def _check(self, bucket: str, key: str) -> bytes:
        if self.fail:
            raise s3_error(self.fail)
        if (bucket, key) not in self.objects:
            raise s3_error("NoSuchKey")
        return self.objects[(bucket, key)]

    def put_object(self, bucket: str, key: str, data: Any, length: int, **_: Any) -> None:
        if self.fail:
            raise s3_error(self.fail)
        self.objects[(bucket, key)] = data.read(length)

    def get_object(self, bucket: str, key: str) -> Response:
        response = Response(self._check(bucket, key))
        self.responses.append(response)
        return response

    def stat_object(self, bucket: str, key: str) -> Obj:
        return Obj(key, len(self._check(bucket, key)))

    def list_objects(
        self, bucket: str, prefix: str, recursive: bool, start_after: str | None
    ) -> Iterator[Obj]:
        assert recursive
        for b, key in sorted(self.objects):
            if b == bucket and key.startswith(prefix) and (start_after is None or key > start_after):
                yield Obj(key)

    def remove_object(self, bucket: str, key: str) -> None:
        self._check(bucket, key)
        del self.objects[(bucket, key)]


def store(client: StubMinio) -> MinioObjectStore:
    return MinioObjectStore(S3Settings(endpoint="http://minio.internal:9000"), client)


def test_put_get_size_list_delete() -> None:
    client = StubMinio()
    objects = store(client)

    async def run() -> None:
        for key in ("t/a", "t/b", "t/c", "u/d"):
            await objects.put("b", key, io.BytesIO(key.encode() * 3), 9, content_type="x")
        assert await objects.get("b", "t/b") == b"t/bt/bt/b"
        assert await objects.size("b", "t/c") == 9
        assert await objects.list_keys("b", "t/", limit=2) == ["t/a", "t/b"]
        assert await objects.list_keys("b", "t/", start_after="t/a", limit=10) == ["t/b", "t/c"]
        await objects.delete("b", "t/a")
        await objects.delete("b", "t/a")  # already gone: no error
        assert await objects.list_keys("b", "t/", limit=10) == ["t/b", "t/c"]

    asyncio.run(run())


def test_streams_in_chunks_and_releases_the_connection() -> None:
    client = StubMinio({("b", "k"): b"x" * 300_000})
    objects = store(client)

    async def run() -> list[bytes]:
        return [chunk async for chunk in objects.stream("b", "k", chunk_bytes=1 << 16)]

    chunks = asyncio.run(run())
    assert b"".join(chunks) == b"x" * 300_000 and max(map(len, chunks)) == 1 << 16
    assert client.responses[0].closed and client.responses[0].released


def test_missing_objects_and_failures_are_told_apart() -> None:
    objects = store(StubMinio())

    async def first_chunk() -> bytes:
        return await anext(aiter(objects.stream("b", "nope")))

    with pytest.raises(ObjectMissing):
        asyncio.run(objects.get("b", "nope"))
    with pytest.raises(ObjectMissing):
        asyncio.run(objects.size("b", "nope"))
    with pytest.raises(ObjectMissing):
        asyncio.run(first_chunk())
    denied = store(StubMinio(fail="AccessDenied"))
    with pytest.raises(StorageError) as caught:
        asyncio.run(denied.get("b", "k"))
    assert "LLMBATCH_S3__ACCESS_KEY" in caught.value.message and not caught.value.retriable
    with pytest.raises(StorageError):
        asyncio.run(denied.put("b", "k", io.BytesIO(b"x"), 1, content_type="x"))
    with pytest.raises(StorageError):
        asyncio.run(denied.delete("b", "k"))


def test_the_entrypoint_help_and_key_hashing() -> None:
    def run(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "llmbatch.api", *args],
            input=stdin,
            capture_output=True,
            text=True,
            check=False,
        )

    done = run("--help")
    assert done.returncode == 0 and "LLMBATCH_API__KEYS" in done.stdout and "--hash-key" in done.stdout
    hashed = run("--hash-key", stdin="sk-abc\n")
    assert hashed.returncode == 0 and hashed.stdout.strip() == hash_api_key("sk-abc")
    empty = run("--hash-key")
    assert empty.returncode == 2 and "no key" in empty.stderr


def test_llmbatch_api_is_the_same_entrypoint() -> None:
    from typer.testing import CliRunner

    from llmbatch.cli import app

    runner = CliRunner()
    helped = runner.invoke(app, ["api", "--help"])
    assert helped.exit_code == 0 and "llmbatch api" in helped.output and "--hash-key" in helped.output
    hashed = runner.invoke(app, ["api", "--hash-key"], input="sk-abc\n")
    assert hashed.exit_code == 0 and hashed.output.strip() == hash_api_key("sk-abc")
    assert "api" in runner.invoke(app, ["--help"]).output


def test_invalid_settings_are_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LLMBATCH_API__KEYS", '{"sk-in-clear": "acme"}')
    assert main([]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: invalid settings") and err.count("\n") == 1 and "hash-key" in err


def test_the_app_is_wired_without_connecting() -> None:
    settings = ApiSettings(api=ApiOptions(keys={hash_api_key("k"): "acme"}))
    app = build_app(settings)
    paths = {getattr(route, "path", "") for route in app.routes}
    assert {
        "/v1/files",
        "/v1/files/{file_id}",
        "/v1/files/{file_id}/content",
        "/v1/batches",
        "/v1/batches/{batch_id}",
        "/v1/batches/{batch_id}/cancel",
    } <= paths
    assert app.state.services.batches.requests_topic == settings.kafka.topics.requests
