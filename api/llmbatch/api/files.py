"""Files through the API: uploads validated line by line and kept in MinIO, and result files.

An upload (``purpose=batch``) is read from the spooled multipart part in 1 MiB chunks, validated by
:func:`llmbatch.api.upload.validate_batch_file` in a worker thread, then written to
``<tenant>/files/<file_id>.jsonl`` of the input bucket byte for byte, and its record last
(:mod:`llmbatch.api.records`). A batch's ``output_file_id`` / ``error_file_id`` are read-only logical files
over its result shards (:mod:`llmbatch.api.results`), listed by ``GET /v1/files?purpose=batch_output``.
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import IO, Literal

from llmbatch.adapters.errors import InvalidInput
from llmbatch.adapters.storage import INPUT_CONTENT_TYPE
from llmbatch.api import results
from llmbatch.api.batch_reader import BatchReader, Snapshot
from llmbatch.api.errors import ApiError, Conflict, InvalidRequest, NotFound, QuotaExceeded, from_exception
from llmbatch.api.expiry import Expiry, expired
from llmbatch.api.objects import TERMINAL_STATUSES, FileDeleted, FileObject, ListPage
from llmbatch.api.records import (
    BATCH_ID,
    FILE_ID,
    FILE_PREFIX,
    Layout,
    RecordStore,
    StoredBatch,
    StoredFile,
    new_id,
)
from llmbatch.api.status import ERROR_PREFIX, OUTPUT_PREFIX, error_file_id, output_file_id
from llmbatch.api.storage import ObjectMissing, ObjectStore
from llmbatch.api.upload import ValidatedFile, validate_batch_file
from llmbatch.schemas.common import ExpiresAfter
from llmbatch.settings.retention import RetentionSettings
from llmbatch.settings.tenants import limit_of

READ_BYTES = 1 << 20
_READ_AHEAD = 16
_RESULT_SCAN = 50  # batches read at once when listing result files
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
        return _file_object(stored)

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
            return _result_object(await self._result(tenant, file_id))
        return _file_object(await self._stored(tenant, file_id))

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
            return await self._list_results(tenant, after=after, limit=limit, order=order)
        if purpose is None and (after is None or FILE_ID.fullmatch(after)):
            uploads = await self.list(tenant, after=after, limit=limit, order=order, purpose="batch")
            if uploads.has_more:
                return uploads
            rest = await self._list_results(
                tenant, after=None, limit=limit - len(uploads.data) or 1, order=order
            )
            items = [*uploads.data, *rest.data][:limit]
            more = rest.has_more or len(uploads.data) + len(rest.data) > limit
            return ListPage[FileObject].of(items, has_more=more, ids=[f.id for f in items])
        if purpose is None and after is not None and after.startswith((OUTPUT_PREFIX, ERROR_PREFIX)):
            return await self._list_results(tenant, after=after, limit=limit, order=order)
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
        objects = [_file_object(s) for s in stored if not self.expiry.is_past(s.expires_at)]
        return ListPage[FileObject].of(objects, has_more=has_more, ids=[o.id for o in objects])

    async def _list_results(
        self, tenant: str, *, after: str | None, limit: int, order: str
    ) -> ListPage[FileObject]:
        """The result files of the tenant's ended batches (``purpose=batch_output``), in the order of
        their batches' creation, a batch's output file before its error file."""
        after_batch, after_kind = None, None
        if after is not None:
            after_kind = "output" if after.startswith(OUTPUT_PREFIX) else "error"
            after_batch = after.removeprefix(OUTPUT_PREFIX if after_kind == "output" else ERROR_PREFIX)
            if not after.startswith((OUTPUT_PREFIX, ERROR_PREFIX)) or not BATCH_ID.fullmatch(after_batch):
                raise InvalidRequest(
                    f"after must be a result file id from an earlier page of purpose "
                    f"batch_output (got {after[:80]!r})",
                    param="after",
                )
        found: builtins.list[FileObject] = []
        if after_kind == "output":  # the rest of that batch: its error file
            found += [
                f
                for f in await self._results_of_ids(tenant, [after_batch or ""])
                if f.id.startswith(ERROR_PREFIX)
            ]
        async for chunk in self._batch_ids(tenant, order=order, after=after_batch):
            found += await self._results_of_ids(tenant, chunk)
            if len(found) > limit:
                break
        page = found[:limit]
        return ListPage[FileObject].of(page, has_more=len(found) > limit, ids=[o.id for o in page])

    async def _batch_ids(
        self, tenant: str, *, order: str, after: str | None
    ) -> AsyncIterator[builtins.list[str]]:
        """The tenant's batch ids after ``after``, newest first (``desc``) or oldest first, in chunks."""
        if order == "asc":
            ids = await self.records.ids_oldest_first("batches", tenant, after=after)
            for start in range(0, len(ids), _RESULT_SCAN):
                yield ids[start : start + _RESULT_SCAN]
            return
        cursor = after
        while ids := await self.records.ids("batches", tenant, after=cursor, limit=_RESULT_SCAN):
            yield ids
            cursor = ids[-1]

    async def _results_of_ids(self, tenant: str, batch_ids: Sequence[str]) -> builtins.list[FileObject]:
        """The result files of those batches that have ended with some, in order."""
        stored = [
            s
            for s in await asyncio.gather(
                *(self.records.get("batches", StoredBatch, tenant, i) for i in batch_ids)
            )
            if s is not None
        ]
        out: builtins.list[FileObject] = []
        for snapshot in await self.batches.many(stored):
            for kind in ("output", "error"):
                try:
                    out.append(_result_object(await self._describe(snapshot, kind)))
                except NotFound:  # no such file (not ended, no such lines, expired, or a shard is gone)
                    continue
        return out

    async def delete(self, tenant: str, file_id: str) -> FileDeleted:
        if file_id.startswith((OUTPUT_PREFIX, ERROR_PREFIX)):
            await self._result(tenant, file_id)  # 404 unless it is the tenant's
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
            result = await self._result(tenant, file_id)
            return _result_object(result), results.concatenate(self.objects, result.uris)
        stored = await self._stored(tenant, file_id)
        key = self.layout.content_key(tenant, stored.id)
        try:
            await self.objects.size(self.layout.bucket, key)
        except ObjectMissing:
            raise _missing(file_id) from None
        return _file_object(stored), self.objects.stream(self.layout.bucket, key)

    async def _stored(self, tenant: str, file_id: str) -> StoredFile:
        """The tenant's upload; 404 ``expired`` past its expiry (removed yet or not), else 404."""
        stored = await self.records.get("files", StoredFile, tenant, file_id)
        if stored is None:
            raise await self._not_found("file", tenant, file_id, file_id)
        if self.expiry.is_past(stored.expires_at):
            raise expired("File", file_id, stored.expires_at or 0.0, "file_id")
        return stored

    async def _not_found(
        self, kind: Literal["batch", "file"], tenant: str, record_id: str, file_id: str
    ) -> NotFound:
        """The 404 of a file not found: ``expired`` when the collector removed it (or its batch)."""
        return await self.expiry.gone_or(_missing(file_id), kind, tenant, record_id, "file_id")

    async def _result(self, tenant: str, file_id: str) -> results.ResultFile:
        kind: results.Kind = "output" if file_id.startswith(OUTPUT_PREFIX) else "error"
        batch_id = file_id.removeprefix(OUTPUT_PREFIX if kind == "output" else ERROR_PREFIX)
        try:
            snapshot = await self.batches.one(tenant, batch_id)
        except NotFound:
            raise await self._not_found("batch", tenant, batch_id, file_id) from None
        return await self._describe(snapshot, kind)

    async def _describe(self, snapshot: Snapshot, kind: results.Kind) -> results.ResultFile:
        """The batch's output or error file; :class:`NotFound` until it ended with such lines."""
        batch = snapshot.batch()
        file_id = batch.output_file_id if kind == "output" else batch.error_file_id
        if file_id is None:
            ids = output_file_id if kind == "output" else error_file_id
            raise _missing(ids(snapshot.stored.id))
        job = snapshot.job
        uris = results.shard_uris(
            kind,
            job_uris=(job.output_uris if kind == "output" else job.error_uris) if job is not None else None,
            manifest=snapshot.manifest,
        )
        ended = next(
            (
                t
                for t in (batch.completed_at, batch.failed_at, batch.expired_at, batch.cancelled_at)
                if t is not None
            ),
            batch.created_at,
        )
        expires_at = await self.expiry.results_expire_at(
            snapshot.stored.tenant, snapshot.stored.id, results.lifecycles(uris)
        )
        if self.expiry.is_past(expires_at):
            raise expired("File", file_id, expires_at or 0.0, "file_id")
        try:
            found = await results.describe(self.objects, snapshot.stored.id, kind, uris, float(ended))
        except ObjectMissing:
            raise _missing(file_id) from None
        return dataclasses.replace(found, expires_at=expires_at)


def _missing(file_id: str) -> NotFound:
    return NotFound(f"No such File object: {file_id}", param="file_id")


def _file_object(stored: StoredFile) -> FileObject:
    return FileObject(
        id=stored.id,
        bytes=stored.bytes,
        created_at=int(stored.created_at),
        filename=stored.filename,
        purpose="batch",
        expires_at=None if stored.expires_at is None else int(stored.expires_at),
    )


def _result_object(result: results.ResultFile) -> FileObject:
    return FileObject(
        id=f"{OUTPUT_PREFIX if result.kind == 'output' else ERROR_PREFIX}{result.batch_id}",
        bytes=result.size,
        created_at=int(result.created_at),
        filename=f"{result.batch_id}_{result.kind}.jsonl",
        purpose="batch_output",
        expires_at=None if result.expires_at is None else int(result.expires_at),
    )
