"""Object storage through the ``minio`` SDK: content-addressed input uploads and result downloads.

The SDK is synchronous; async callers run these functions in a worker thread
(``asyncio.to_thread``). Every failure becomes a :class:`~llmbatch.adapters.errors.StorageError` naming the
bucket/key and the setting to check.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from llmbatch.adapters.errors import StorageError
from llmbatch.settings import S3Settings

PART_SIZE = 16 << 20
"""Multipart part size: files above it are uploaded in parts (minio does the multipart upload)."""
INPUT_CONTENT_TYPE = "application/jsonl"


def split_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> ``(bucket, key)``."""
    if not uri.startswith("s3://") or "/" not in uri[5:]:
        raise StorageError(f"{uri!r} is not an s3://bucket/key URI", retriable=False)
    bucket, _, key = uri[5:].partition("/")
    return bucket, key


def http_client(s3: S3Settings, *, connect_s: float, read_s: float, retries: int) -> Any:
    """A ``urllib3.PoolManager`` for ``s3``'s endpoint: bounded timeouts and retries (5xx answers
    retried too), an https endpoint verified against ``s3.ca_file`` when set."""
    import urllib3

    return urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=connect_s, read=read_s),
        retries=urllib3.Retry(
            total=retries,
            connect=retries,
            read=retries,
            backoff_factor=0.2,
            status_forcelist=(500, 502, 503, 504),
        ),
        maxsize=8,
        ca_certs=str(s3.ca_file) if s3.ca_file and s3.secure else None,
    )


def make_client(s3: S3Settings, *, timeout_s: float = 10.0, retries: int = 2) -> Any:
    """A ``minio.Minio`` client with short connect timeouts and bounded retries."""
    from minio import Minio

    http = http_client(s3, connect_s=timeout_s, read_s=max(timeout_s, 60.0), retries=retries)
    return Minio(
        s3.host,
        access_key=s3.access_key.get_secret_value() or None,
        secret_key=s3.secret_key.get_secret_value() or None,
        secure=s3.secure,
        region=s3.region,
        http_client=http,
    )


def describe_error(exc: Exception, what: str, endpoint: str) -> StorageError:
    """The :class:`StorageError` for a failed ``minio`` call: names the object and the setting to check."""
    from minio.error import S3Error

    if isinstance(exc, S3Error):
        code = exc.code or "error"
        if code == "NoSuchBucket":
            return StorageError(
                f"{what}: bucket {exc.bucket_name!r} does not exist at {endpoint}; create it or set "
                "LLMBATCH_S3__INPUT_BUCKET / LLMBATCH_S3__RESULTS_BUCKET",
                retriable=False,
            )
        if code in {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"}:
            return StorageError(
                f"{what}: {code} at {endpoint}; check LLMBATCH_S3__ACCESS_KEY / LLMBATCH_S3__SECRET_KEY",
                retriable=False,
            )
        if code in {"NoSuchKey", "NoSuchObject"}:
            return StorageError(f"{what}: object not found", retriable=False)
        return StorageError(f"{what}: {code}: {exc.message}")
    return StorageError(f"{what}: object storage at {endpoint} is unreachable ({type(exc).__name__}: {exc})")


def sha256_file(path: Path, chunk: int = 1 << 20) -> tuple[str, int]:
    """``(hex sha256, size)`` of a file, read in chunks."""
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
            size += len(block)
    return digest.hexdigest(), size


def input_key(tenant: str, sha256_hex: str) -> str:
    """Content-addressed key of an input file: re-uploading the same bytes hits the same key."""
    return f"{tenant}/inputs/{sha256_hex}.jsonl"


def upload_input(
    client: Any, s3: S3Settings, path: Path, *, tenant: str, sha256_hex: str | None = None
) -> str:
    """Upload a validated JSONL file to the input bucket; return its ``s3://`` URI.

    The key is the content hash, so an identical file is uploaded once: when the object already
    exists with the same size and hash metadata, nothing is sent.
    """
    from minio.error import S3Error

    digest, size = sha256_file(path) if sha256_hex is None else (sha256_hex, path.stat().st_size)
    bucket, key = s3.input_bucket, input_key(tenant, digest)
    uri = f"s3://{bucket}/{key}"
    try:
        try:
            stat = client.stat_object(bucket, key)
            meta = {k.lower(): v for k, v in (stat.metadata or {}).items()}
            if stat.size == size and meta.get("x-amz-meta-sha256") == digest:
                return uri
        except S3Error as exc:
            if exc.code not in {"NoSuchKey", "NoSuchObject", "ResourceNotFound"}:
                raise
        client.fput_object(
            bucket,
            key,
            str(path),
            content_type=INPUT_CONTENT_TYPE,
            metadata={"sha256": digest},
            part_size=PART_SIZE,
        )
    except Exception as exc:
        raise describe_error(exc, f"uploading {path.name} to {uri}", s3.endpoint) from exc
    return uri


def ensure_buckets(client: Any, s3: S3Settings) -> None:
    """Create the input and results buckets when missing (local stacks and tests)."""
    for bucket in (s3.input_bucket, s3.results_bucket):
        try:
            if not client.bucket_exists(bucket):
                client.make_bucket(bucket)
        except Exception as exc:
            from minio.error import S3Error

            if isinstance(exc, S3Error) and exc.code in {"BucketAlreadyOwnedByYou", "BucketAlreadyExists"}:
                continue
            raise describe_error(exc, f"creating bucket {bucket!r}", s3.endpoint) from exc


def folder_sizes(client: Any, s3: S3Settings, bucket: str) -> dict[str, int]:
    """Bytes under each top-level folder of ``bucket`` (``<tenant>/`` in llmbatch's layout), from one
    listing of the whole bucket (no object is read); objects outside any folder are left out."""
    sizes: dict[str, int] = {}
    try:
        for obj in client.list_objects(bucket, recursive=True):
            top, sep, _ = str(obj.object_name).partition("/")
            if sep:
                sizes[top] = sizes.get(top, 0) + int(obj.size or 0)
    except Exception as exc:
        raise describe_error(exc, f"listing s3://{bucket}/", s3.endpoint) from exc
    return sizes


def get_bytes(client: Any, s3: S3Settings, uri: str) -> bytes:
    """Read a whole (small) object, e.g. a manifest."""
    bucket, key = split_uri(uri)
    try:
        response = client.get_object(bucket, key)
        try:
            return bytes(response.read())
        finally:
            response.close()
            response.release_conn()
    except Exception as exc:
        raise describe_error(exc, f"reading {uri}", s3.endpoint) from exc


def latest_manifest(client: Any, s3: S3Settings, batch_prefix: str, name: str) -> str | None:
    """The newest ``<batch_prefix>[<lifecycle>/]<name>`` (a batch id used again is a new lifecycle
    with a folder of its own), or ``None`` when there is none."""
    bucket, key = split_uri(batch_prefix)
    found: list[tuple[Any, str]] = []
    try:
        for obj in client.list_objects(bucket, prefix=key, recursive=True):
            rest = str(obj.object_name)[len(key) :]
            if rest == name or (rest.endswith("/" + name) and rest.count("/") == 1):
                found.append((obj.last_modified, str(obj.object_name)))
    except Exception as exc:
        raise describe_error(exc, f"listing {batch_prefix}", s3.endpoint) from exc
    return f"s3://{bucket}/{max(found)[1]}" if found else None


def iter_lines(client: Any, s3: S3Settings, uri: str, chunk: int = 1 << 16) -> Iterator[bytes]:
    """Stream the non-blank lines of an object without loading it whole."""
    bucket, key = split_uri(uri)
    try:
        response = client.get_object(bucket, key)
    except Exception as exc:
        raise describe_error(exc, f"reading {uri}", s3.endpoint) from exc
    try:
        pending = b""
        for block in response.stream(chunk):
            pending += block
            *complete, pending = pending.split(b"\n")
            for line in complete:
                if line.strip():
                    yield line
        if pending.strip():
            yield pending
    except StorageError:
        raise
    except Exception as exc:
        raise describe_error(exc, f"reading {uri}", s3.endpoint) from exc
    finally:
        response.close()
        response.release_conn()


def put_bytes(client: Any, s3: S3Settings, uri: str, data: bytes | IO[bytes], length: int) -> None:
    """Write a small object (tests and tools)."""
    import io

    bucket, key = split_uri(uri)
    stream = io.BytesIO(data) if isinstance(data, bytes) else data
    try:
        client.put_object(bucket, key, stream, length)
    except Exception as exc:
        raise describe_error(exc, f"writing {uri}", s3.endpoint) from exc
