"""Files through the API: uploads validated line by line and kept in MinIO, read, listed, streamed and
deleted, beside the batches' result files (:mod:`llmbatch.api.files.result_files`).

An upload (``purpose=batch``) is read from the spooled multipart part in 1 MiB chunks, validated by
:func:`llmbatch.api.files.upload.validate_batch_file` in a worker thread, then written to
``<tenant>/files/<file_id>.jsonl`` of the input bucket byte for byte, and its record last
(:mod:`llmbatch.api.store.records`). An upload is not deleted while a batch created from it may still read it.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import IO

from llmbatch.adapters.errors import InvalidInput
from llmbatch.adapters.storage import INPUT_CONTENT_TYPE
from llmbatch.api.batches import results
from llmbatch.api.batches.batch_reader import BatchReader
from llmbatch.api.batches.expiry import Expiry, expired
from llmbatch.api.batches.status import ERROR_PREFIX, OUTPUT_PREFIX
from llmbatch.api.errors import ApiError, Conflict, InvalidRequest, NotFound, QuotaExceeded, from_exception
from llmbatch.api.files.result_files import ResultFiles
from llmbatch.api.files.upload import ValidatedFile, validate_batch_file
from llmbatch.api.files.views import file_object, missing, not_found, result_object
from llmbatch.api.objects import TERMINAL_STATUSES, FileDeleted, FileObject, ListPage
from llmbatch.api.store.records import FILE_ID, FILE_PREFIX, Layout, RecordStore, StoredFile, new_id
from llmbatch.api.store.storage import ObjectMissing, ObjectStore
from llmbatch.schemas.common import ExpiresAfter
from llmbatch.settings.retention import RetentionSettings
from llmbatch.settings.tenants import limit_of

READ_BYTES = 1 << 20
_READ_AHEAD = 16
MAX_FILE_PAGE = 10_000
_UNSAFE = re.compile(r"[\x00-\x1f\x7f]")


def clean_filename(name: str | None) -> str:
    """The name to show: its last path segment, without control characters, at most 255 chars."""
    base = re.split(r"[/\\]", name or "")[-1]
    base = _UNSAFE.sub("", base).strip()[:255]
    return base or "file.jsonl"


class FileService:
    """Upload, read, list, delete and stream a tenant's files."""

    def __init__(
        self,
        objects: ObjectStore,
        records: RecordStore,
        batches: BatchReader,
        *,
        max_upload_bytes: int,
        max_file_requests: int,
        storage_limits: Mapping[str, int] | None = None,
        expiry: Expiry | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.objects = objects
        self.records = records
        self.layout: Layout = records.layout
        self.batches = batches
        self.max_upload_bytes = max_upload_bytes
        self.max_file_requests = max_file_requests
        self.storage_limits = dict(storage_limits or {})
        self.expiry = expiry or Expiry(None, RetentionSettings(), clock=clock)
        self.clock = clock
        self.result_files = ResultFiles(objects, records, batches, self.expiry)

    async def upload(
        self,
        tenant: str,
        *,
        filename: str | None,
        purpose: str,
        source: IO[bytes],
        expires_after: ExpiresAfter | None = None,
    ) -> FileObject:
        """Validate ``source`` (a seekable stream) and store it; raises a 400 naming the bad lines. It
        expires ``expires_after`` after the upload, else after the tenant's retention."""
        if purpose != "batch":
            raise InvalidRequest(
                f"purpose {purpose[:40]!r} is not served here: this API takes batch input files, "
                "purpose 'batch'",
                param="purpose",
            )

        def check() -> ValidatedFile:
            source.seek(0)
            return validate_batch_file(
                iter(lambda: source.read(READ_BYTES), b""),
                max_bytes=self.max_upload_bytes,
                max_requests=self.max_file_requests,
            )

        try:
            valid = await asyncio.to_thread(check)
        except InvalidInput as exc:
            raise from_exception(exc, param="file") from None
        try:
            await self._check_quota(tenant, valid.size)
        except ApiError:
            raise
        except Exception as exc:
            raise from_exception(exc) from exc
        now = self.clock()
        stored = StoredFile(
            id=new_id(FILE_PREFIX, now),
            tenant=tenant,
            created_at=now,
            filename=clean_filename(filename),
            bytes=valid.size,
            sha256=valid.sha256,
            endpoint=valid.endpoint,
            model=valid.model,
            requests=valid.requests,
            expires_at=self.expiry.file_expires_at(tenant, expires_after, now),
        )
        source.seek(0)
        key = self.layout.content_key(tenant, stored.id)
        try:
            await self.expiry.date_file(tenant, stored.id, stored.expires_at)
            await self.objects.put(
                self.layout.bucket, key, source, valid.size, content_type=INPUT_CONTENT_TYPE
            )
            await self.records.put("files", stored)
        except Exception as exc:
            raise from_exception(exc) from exc
        return file_object(stored)

    async def _check_quota(self, tenant: str, size: int) -> None:
        """429 when what the tenant keeps (its uploads and its batches' results) and this file would be
        over its limit (``LLMBATCH_TENANTS__MAX_STORED_BYTES``; counted from one listing of each: uploads
        at the same moment may each pass)."""
        limit = limit_of(self.storage_limits, tenant)
        if not limit:
            return
        uploads = await self.objects.total_size(self.layout.bucket, self.layout.content_folder(tenant))
        kept = await self.objects.total_size(self.batches.results_bucket, f"{tenant}/")
        if uploads + kept + size > limit:
            raise QuotaExceeded(
                f"this file ({size} bytes), the {uploads} bytes of files you uploaded and the {kept} bytes "
                f"of your batches' results are over your storage quota of {limit} bytes "
                "(LLMBATCH_TENANTS__MAX_STORED_BYTES): delete files you no longer need "
                "(DELETE /v1/files/{id}), or wait for results to expire (their expires_at), and upload again",
                param="file",
                code="storage_quota_exceeded",
            )

    async def get(self, tenant: str, file_id: str) -> FileObject:
        if file_id.startswith((OUTPUT_PREFIX, ERROR_PREFIX)):
            return result_object(await self.result_files.get(tenant, file_id))
        return file_object(await self._stored(tenant, file_id))

    async def list(
        self, tenant: str, *, after: str | None, limit: int, order: str, purpose: str | None
    ) -> ListPage[FileObject]:
        """The tenant's files: ``purpose=batch`` its uploads (``order`` by creation: ``desc``, the
        default, or ``asc``), ``purpose=batch_output`` its batches' result files, and without a purpose
        both: the uploads, then the result files (one order for every page)."""
        if not 1 <= limit <= MAX_FILE_PAGE:
            raise InvalidRequest(f"limit must be between 1 and {MAX_FILE_PAGE} (got {limit})", param="limit")
        if order not in {"asc", "desc"}:
            raise InvalidRequest(f"order must be 'asc' or 'desc' (got {order[:20]!r})", param="order")
        if purpose == "batch_output":
            return await self.result_files.page(tenant, after=after, limit=limit, order=order)
        if purpose is None and (after is None or FILE_ID.fullmatch(after)):
            uploads = await self.list(tenant, after=after, limit=limit, order=order, purpose="batch")
            if uploads.has_more:
                return uploads
            rest = await self.result_files.page(
                tenant, after=None, limit=limit - len(uploads.data) or 1, order=order
            )
            items = [*uploads.data, *rest.data][:limit]
            more = rest.has_more or len(uploads.data) + len(rest.data) > limit
            return ListPage[FileObject].of(items, has_more=more, ids=[f.id for f in items])
        if purpose is None and after is not None and after.startswith((OUTPUT_PREFIX, ERROR_PREFIX)):
            return await self.result_files.page(tenant, after=after, limit=limit, order=order)
        if after is not None and not FILE_ID.fullmatch(after):
            raise InvalidRequest(
                f"after must be a file id from an earlier page (got {after[:80]!r})", param="after"
            )
        if purpose is not None and purpose != "batch":
            return ListPage[FileObject].of([], has_more=False, ids=[])
        if order == "desc":
            stored, has_more = await self.records.page("files", StoredFile, tenant, after=after, limit=limit)
        else:
            ids = await self.records.ids_oldest_first("files", tenant, after=after)
            chosen = [await self.records.get("files", StoredFile, tenant, i) for i in ids[:limit]]
            stored, has_more = [s for s in chosen if s is not None], len(ids) > limit
        # an expired file is gone for its tenant, whether the collector has removed it yet or not
        objects = [file_object(s) for s in stored if not self.expiry.is_past(s.expires_at)]
        return ListPage[FileObject].of(objects, has_more=has_more, ids=[o.id for o in objects])

    async def delete(self, tenant: str, file_id: str) -> FileDeleted:
        if file_id.startswith((OUTPUT_PREFIX, ERROR_PREFIX)):
            await self.result_files.get(tenant, file_id)  # 404 unless it is the tenant's
            raise InvalidRequest(f"{file_id} is a batch's result file: it cannot be deleted", param="file_id")
        stored = await self._stored(tenant, file_id)
        try:
            await self.remove(stored)
        except ApiError:
            raise
        except Exception as exc:
            raise from_exception(exc) from exc
        return FileDeleted(id=stored.id)

    async def remove(self, stored: StoredFile) -> None:
        """Remove an upload: its record first (reads stop), its bytes, then the marks of the batches
        made from it. :class:`Conflict` (``file_in_use``), and nothing removed, while a batch may still
        read it. Every step can be done again (a collector that died mid-way)."""
        tenant = stored.tenant
        await self._refuse_in_use(stored)
        await self.records.delete("files", tenant, stored.id)
        try:  # a create that found the record before it went has marked its use by now
            await self._refuse_in_use(stored)
        except Conflict:
            await self.records.put("files", stored)
            raise
        await self.objects.delete(self.layout.bucket, self.layout.content_key(tenant, stored.id))
        await self.records.drop_uses(tenant, stored.id)

    async def _refuse_in_use(self, stored: StoredFile) -> None:
        """A 409 while a batch created from the file may still read it: its dispatcher reads the input
        when the batch starts (and again on a retried attempt), so deleting it then failed the batch."""
        reader = await self.reader_of(stored)
        if reader is not None:
            batch_id, status = reader
            raise Conflict(
                f"{stored.id} is the input of batch {batch_id}, which is {status}: delete the file "
                "once the batch has ended, or cancel the batch first",
                param="file_id",
                code="file_in_use",
            )

    async def reader_of(self, stored: StoredFile) -> tuple[str, str] | None:
        """A batch created from the file that may still read it, and its status; ``None`` when none
        may (what a delete, and the collector, wait for)."""
        ids = await self.records.uses(stored.tenant, stored.id)
        now = self.clock()

        async def running(batch_id: str) -> str | None:
            """The batch's status while it may still read its input, else ``None``."""
            try:
                snapshot = await self.batches.one(stored.tenant, batch_id)
            except NotFound:  # a create that failed after marking the use
                return None
            if snapshot.job is None and snapshot.manifest is None:
                if now >= snapshot.stored.expires_at:
                    return None  # never reached the dispatcher, and is not sent again any more
                if await self.expiry.gone("batch", stored.tenant, batch_id, "batch_id") is not None:
                    return None  # it ended and expired: the collector is removing it
            status = snapshot.batch().status
            return None if status in TERMINAL_STATUSES else status

        for start in range(0, len(ids), _READ_AHEAD):  # bounded concurrency
            chunk = ids[start : start + _READ_AHEAD]
            for batch_id, status in zip(chunk, await asyncio.gather(*map(running, chunk)), strict=True):
                if status is not None:
                    return batch_id, status
        return None

    async def content(self, tenant: str, file_id: str) -> tuple[FileObject, AsyncIterator[bytes]]:
        """The file's description and its bytes as a stream (checked to exist before streaming)."""
        if file_id.startswith((OUTPUT_PREFIX, ERROR_PREFIX)):
            result = await self.result_files.get(tenant, file_id)
            return result_object(result), results.concatenate(self.objects, result.uris)
        stored = await self._stored(tenant, file_id)
        key = self.layout.content_key(tenant, stored.id)
        try:
            await self.objects.size(self.layout.bucket, key)
        except ObjectMissing:
            raise missing(file_id) from None
        return file_object(stored), self.objects.stream(self.layout.bucket, key)

    async def _stored(self, tenant: str, file_id: str) -> StoredFile:
        """The tenant's upload; 404 ``expired`` past its expiry (removed yet or not), else 404."""
        stored = await self.records.get("files", StoredFile, tenant, file_id)
        if stored is None:
            raise await not_found(self.expiry, "file", tenant, file_id, file_id)
        if self.expiry.is_past(stored.expires_at):
            raise expired("File", file_id, stored.expires_at or 0.0, "file_id")
        return stored
