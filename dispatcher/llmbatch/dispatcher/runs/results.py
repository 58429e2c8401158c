"""Reading what a job left in object storage: its manifest, or (when stopped early) its shards.

The minio SDK is synchronous; every call runs in a worker thread. Errors are classified at this
boundary: a missing object is ``None``; connection trouble is
:class:`~llmbatch.dispatcher.errors.StorageUnavailable` (retriable).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from llmbatch.dispatcher.errors import ManifestInvalid, PermanentError, StorageUnavailable, classify
from llmbatch.schemas.errors import SchemaError
from llmbatch.schemas.job import MANIFEST_NAME, JobSpec, Manifest, parse_manifest
from llmbatch.settings import S3Settings

T = TypeVar("T")
_SHARD_RE = re.compile(r"(output|error)-(?:a\d+-)?\d{5,}\.jsonl")  # a whole file name (fullmatch)
_MISSING = {"NoSuchKey", "NoSuchBucket", "NoSuchObject"}
_REFUSED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"}
# 4xx answers that say nothing about the object: a clock off, throttling, a slow request
_TRANSIENT = {"RequestTimeTooSkewed", "RequestTimeout", "SlowDown", "RequestExpired", "ExpiredToken"}


def _http_status(exc: Exception) -> int | None:
    """The HTTP status of a minio error: an ``S3Error``'s response, a ``ServerError``'s status code, an
    ``InvalidResponseError``'s code."""
    for value in (
        getattr(getattr(exc, "response", None), "status", None),
        getattr(exc, "status_code", None),
        getattr(exc, "_code", None),
    ):
        if isinstance(value, int):
            return value
    return None


def translate_s3_error(exc: Exception, endpoint: str) -> Exception:
    """What a failed minio call means here: a missing object or bucket is :class:`FileNotFoundError`;
    keys the server refuses are :class:`StorageUnavailable` naming the settings to check (every batch
    waits, none is failed, until the operator fixes them); so is a clock too far from S3's
    (``RequestTimeTooSkewed``) and kin; another 4xx answer is a :class:`PermanentError`; a 5xx answer,
    a timeout, throttling or no answer is :class:`StorageUnavailable`."""
    code = getattr(exc, "code", None)
    if code in _MISSING:
        return FileNotFoundError(str(code))
    if code in _REFUSED:
        return StorageUnavailable(
            f"S3 at {endpoint} refused the dispatcher's keys ({code}): check LLMBATCH_S3__ACCESS_KEY, "
            "LLMBATCH_S3__SECRET_KEY and their policy; batches wait until they work"
        )
    if code == "RequestTimeTooSkewed":
        return StorageUnavailable(
            f"S3 at {endpoint} says this host's clock is too far from its own ({code}): sync the "
            "clocks (NTP); batches wait until it works"
        )
    if code in _TRANSIENT:
        return StorageUnavailable(f"S3 at {endpoint}: {code}")
    if type(exc).__name__ in {"S3Error", "ServerError", "InvalidResponseError"}:
        status = _http_status(exc)
        if status is not None and status < 500 and status not in {408, 429}:
            return PermanentError(f"S3 answered {status}: {exc}")
        return StorageUnavailable(f"S3: {exc}")
    return classify(exc, default=StorageUnavailable)


def split_uri(uri: str) -> tuple[str, str]:
    bucket, _, key = uri[5:].partition("/")
    return bucket, key


@dataclass
class Shards:
    output_uris: list[str] = field(default_factory=list)
    error_uris: list[str] = field(default_factory=list)


class ResultStore:
    """Reads manifests and lists result shards under ``s3://<bucket>/<tenant>/<batch_id>/``."""

    def __init__(self, settings: S3Settings, client: Any | None = None) -> None:
        self.settings = settings
        self._client = client

    def _minio(self) -> Any:
        if self._client is None:
            from minio import Minio

            http = None
            if self.settings.ca_file and self.settings.secure:  # an https endpoint signed by that CA
                import urllib3

                http = urllib3.PoolManager(cert_reqs="CERT_REQUIRED", ca_certs=str(self.settings.ca_file))
            self._client = Minio(
                self.settings.host,
                access_key=self.settings.access_key.get_secret_value(),
                secret_key=self.settings.secret_key.get_secret_value(),
                secure=self.settings.secure,
                region=self.settings.region,
                http_client=http,
            )
        return self._client

    async def _run(self, fn: Callable[[], T]) -> T:
        try:
            return await asyncio.to_thread(fn)
        except Exception as exc:
            raise translate_s3_error(exc, self.settings.endpoint) from exc

    async def read_manifest(self, output_prefix: str) -> Manifest | None:
        """The manifest under ``output_prefix``; ``None`` if there is none; ManifestInvalid if unreadable."""
        bucket, key = split_uri(output_prefix + MANIFEST_NAME)

        def get() -> bytes:
            resp = self._minio().get_object(bucket, key)
            try:
                return bytes(resp.read())
            finally:
                resp.close()
                resp.release_conn()

        try:
            raw = await self._run(get)
        except FileNotFoundError:
            return None
        try:
            return parse_manifest(raw)
        except SchemaError as exc:
            raise ManifestInvalid(f"{output_prefix}{MANIFEST_NAME}: {exc}") from exc

    async def object_size(self, uri: str) -> int | None:
        """Size in bytes of the object at ``uri`` (``s3://``); ``None`` when it does not exist."""
        bucket, key = split_uri(uri)
        try:
            stat = await self._run(lambda: self._minio().stat_object(bucket, key))
        except FileNotFoundError:
            return None
        return int(stat.size)

    async def list_shards(self, output_prefix: str) -> Shards:
        """Result shards present under the prefix (for a job stopped before its manifest)."""
        bucket, prefix = split_uri(output_prefix)

        def listing() -> list[str]:
            objects = self._minio().list_objects(bucket, prefix=prefix, recursive=True)
            return [obj.object_name for obj in objects]

        try:
            names = await self._run(listing)
        except FileNotFoundError:
            return Shards()
        shards = Shards()
        for name in sorted(names):
            match = _SHARD_RE.fullmatch(name.rsplit("/", 1)[-1])
            if match:
                (shards.output_uris if match.group(1) == "output" else shards.error_uris).append(
                    f"s3://{bucket}/{name}"
                )
        return shards

    async def put_bytes(self, uri: str, data: bytes, content_type: str = "application/json") -> None:
        import io

        bucket, key = split_uri(uri)
        await self._run(
            lambda: self._minio().put_object(
                bucket, key, io.BytesIO(data), len(data), content_type=content_type
            )
        )

    async def upload_spec(self, spec: JobSpec) -> str:
        """Store a job spec too large for a command line; returns its ``s3://`` URI."""
        uri = f"{spec.output_prefix}specs/a{spec.attempt}.json"
        await self.put_bytes(uri, spec.model_dump_json(exclude_none=True).encode())
        return uri

    async def ping(self) -> bool:
        bucket = self.settings.results_bucket
        return bool(await self._run(lambda: self._minio().bucket_exists(bucket)))
