"""Object storage as the API needs it: a small async protocol, and its MinIO/S3 implementation.

The services of the API (:mod:`llmbatch.api.files.files`, :mod:`llmbatch.api.batches.batches`,
:mod:`llmbatch.api.batches.results`) only know :class:`ObjectStore`; unit tests give them an in-memory one.
:class:`MinioObjectStore` wraps the synchronous ``minio`` client the producer uses
(:func:`llmbatch.adapters.storage.make_client`), one worker thread per call, and streams objects chunk by
chunk (memory stays flat whatever their size).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import IO, Any, Protocol

from llmbatch.adapters import storage
from llmbatch.schemas.errors import LLMBatchError
from llmbatch.settings import S3Settings

CHUNK_BYTES = 1 << 16
_MISSING_CODES = frozenset({"NoSuchKey", "NoSuchObject", "ResourceNotFound"})


class ObjectMissing(LLMBatchError, LookupError):
    """The object does not exist."""


class ObjectStore(Protocol):
    """What the API does with object storage. Keys are listed in lexicographic order (as S3 does)."""

    async def put(self, bucket: str, key: str, data: IO[bytes], length: int, *, content_type: str) -> None:
        """Write ``length`` bytes read from ``data`` (a stream) as one object."""
        ...

    async def put_new(self, bucket: str, key: str, data: bytes, *, content_type: str) -> bool:
        """Write a small object only if none has ``key`` (atomic: S3's conditional write,
        ``If-None-Match: *``); ``False`` when one exists, which is left as it is."""
        ...

    async def get(self, bucket: str, key: str) -> bytes:
        """A small object whole (records, manifests). Raises :class:`ObjectMissing`."""
        ...

    async def size(self, bucket: str, key: str) -> int:
        """The object's size in bytes. Raises :class:`ObjectMissing`."""
        ...

    def stream(self, bucket: str, key: str, *, chunk_bytes: int = CHUNK_BYTES) -> AsyncIterator[bytes]:
        """The object's bytes in chunks. Raises :class:`ObjectMissing` (on the first ``__anext__``)."""
        ...

    async def list_keys(
        self, bucket: str, prefix: str, *, start_after: str | None = None, limit: int
    ) -> list[str]:
        """Up to ``limit`` keys under ``prefix`` after ``start_after``, in key order."""
        ...

    async def total_size(self, bucket: str, prefix: str) -> int:
        """The bytes of every object under ``prefix`` (one listing; no object is read)."""
        ...

    async def delete(self, bucket: str, key: str) -> None:
        """Remove the object (no error when it is already gone)."""
        ...


async def delete_under(
    objects: ObjectStore,
    bucket: str,
    prefix: str,
    *,
    spare: Callable[[str], bool] | None = None,
    at_once: int = 16,
    page: int = 1000,
) -> int:
    """Delete every object under ``prefix`` but those ``spare`` keeps, a listing page at a time and
    ``at_once`` deletes together (memory stays flat); returns how many were deleted."""
    deleted = 0
    start: str | None = None
    while keys := await objects.list_keys(bucket, prefix, start_after=start, limit=page):
        start = keys[-1]
        doomed = [k for k in keys if spare is None or not spare(k)]
        for first in range(0, len(doomed), at_once):
            await asyncio.gather(*(objects.delete(bucket, k) for k in doomed[first : first + at_once]))
        deleted += len(doomed)
    return deleted


class MinioObjectStore:
    """:class:`ObjectStore` over a ``minio.Minio`` client (blocking calls run in worker threads).

    Failures become :class:`llmbatch.adapters.errors.StorageError` (retriable when the service is
    unreachable),
    except a missing object: :class:`ObjectMissing`.
    """

    def __init__(self, s3: S3Settings, client: Any = None, *, timeout_s: float = 10.0) -> None:
        self._s3 = s3
        self._client = client if client is not None else storage.make_client(s3, timeout_s=timeout_s)

    def _error(self, exc: Exception, what: str) -> Exception:
        from minio.error import S3Error

        if isinstance(exc, S3Error) and exc.code in _MISSING_CODES:
            return ObjectMissing(what)
        return storage.describe_error(exc, what, self._s3.endpoint)

    async def put(self, bucket: str, key: str, data: IO[bytes], length: int, *, content_type: str) -> None:
        def run() -> None:
            try:
                self._client.put_object(
                    bucket, key, data, length, content_type=content_type, part_size=storage.PART_SIZE
                )
            except Exception as exc:
                raise self._error(exc, f"writing s3://{bucket}/{key}") from exc

        await asyncio.to_thread(run)

    async def put_new(self, bucket: str, key: str, data: bytes, *, content_type: str) -> bool:
        from minio.error import S3Error

        def run() -> bool:
            try:
                # minio-py's put_object sends no If-None-Match (it makes unknown headers user metadata):
                # the client's signed request method does
                self._client._execute(
                    "PUT",
                    bucket,
                    key,
                    body=data,
                    headers={"If-None-Match": "*", "Content-Type": content_type},
                )
            except S3Error as exc:
                if exc.code == "PreconditionFailed":
                    return False
                raise self._error(exc, f"writing s3://{bucket}/{key}") from exc
            except Exception as exc:
                raise self._error(exc, f"writing s3://{bucket}/{key}") from exc
            return True

        return await asyncio.to_thread(run)

    async def get(self, bucket: str, key: str) -> bytes:
        def run() -> bytes:
            try:
                response = self._client.get_object(bucket, key)
                try:
                    return bytes(response.read())
                finally:
                    response.close()
                    response.release_conn()
            except Exception as exc:
                raise self._error(exc, f"reading s3://{bucket}/{key}") from exc

        return await asyncio.to_thread(run)

    async def size(self, bucket: str, key: str) -> int:
        def run() -> int:
            try:
                return int(self._client.stat_object(bucket, key).size or 0)
            except Exception as exc:
                raise self._error(exc, f"reading s3://{bucket}/{key}") from exc

        return await asyncio.to_thread(run)

    async def stream(self, bucket: str, key: str, *, chunk_bytes: int = CHUNK_BYTES) -> AsyncIterator[bytes]:
        what = f"reading s3://{bucket}/{key}"
        try:
            response = await asyncio.to_thread(self._client.get_object, bucket, key)
        except Exception as exc:
            raise self._error(exc, what) from exc
        try:
            chunks = response.stream(chunk_bytes)
            while True:
                try:
                    chunk = await asyncio.to_thread(next, chunks, None)
                except Exception as exc:
                    raise self._error(exc, what) from exc
                if chunk is None:
                    return
                yield bytes(chunk)
        finally:
            response.close()
            response.release_conn()

    async def list_keys(
        self, bucket: str, prefix: str, *, start_after: str | None = None, limit: int
    ) -> list[str]:
        def run() -> list[str]:
            keys: list[str] = []
            try:
                for obj in self._client.list_objects(
                    bucket, prefix=prefix, recursive=True, start_after=start_after
                ):
                    keys.append(str(obj.object_name))
                    if len(keys) >= limit:
                        break
            except Exception as exc:
                raise self._error(exc, f"listing s3://{bucket}/{prefix}") from exc
            return keys

        return await asyncio.to_thread(run)

    async def total_size(self, bucket: str, prefix: str) -> int:
        def run() -> int:
            try:
                return sum(
                    int(obj.size or 0)
                    for obj in self._client.list_objects(bucket, prefix=prefix, recursive=True)
                )
            except Exception as exc:
                raise self._error(exc, f"listing s3://{bucket}/{prefix}") from exc

        return await asyncio.to_thread(run)

    async def delete(self, bucket: str, key: str) -> None:
        def run() -> None:
            try:
                self._client.remove_object(bucket, key)
            except Exception as exc:
                error = self._error(exc, f"deleting s3://{bucket}/{key}")
                if not isinstance(error, ObjectMissing):
                    raise error from exc

        await asyncio.to_thread(run)
