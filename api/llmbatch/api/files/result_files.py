"""A batch's result files through the Files API: ``output_file_id`` / ``error_file_id`` are read-only
logical files over its result shards (:mod:`llmbatch.api.batches.results`), found one by one and listed
by ``GET /v1/files?purpose=batch_output``, expired with the batch's results."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence

from llmbatch.api.batches import results
from llmbatch.api.batches.batch_reader import BatchReader, Snapshot
from llmbatch.api.batches.expiry import Expiry, expired
from llmbatch.api.batches.status import ERROR_PREFIX, OUTPUT_PREFIX, error_file_id, output_file_id
from llmbatch.api.errors import InvalidRequest, NotFound
from llmbatch.api.files.views import missing, not_found, result_object
from llmbatch.api.objects import FileObject, ListPage
from llmbatch.api.store.records import BATCH_ID, RecordStore, StoredBatch
from llmbatch.api.store.storage import ObjectMissing, ObjectStore

_RESULT_SCAN = 50  # batches read at once when listing result files


class ResultFiles:
    """The result files of a tenant's batches: one by its id, or a page of them."""

    def __init__(
        self, objects: ObjectStore, records: RecordStore, batches: BatchReader, expiry: Expiry
    ) -> None:
        self.objects = objects
        self.records = records
        self.batches = batches
        self.expiry = expiry

    async def page(self, tenant: str, *, after: str | None, limit: int, order: str) -> ListPage[FileObject]:
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
        found: list[FileObject] = []
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

    async def _batch_ids(self, tenant: str, *, order: str, after: str | None) -> AsyncIterator[list[str]]:
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

    async def _results_of_ids(self, tenant: str, batch_ids: Sequence[str]) -> list[FileObject]:
        """The result files of those batches that have ended with some, in order."""
        stored = [
            s
            for s in await asyncio.gather(
                *(self.records.get("batches", StoredBatch, tenant, i) for i in batch_ids)
            )
            if s is not None
        ]
        out: list[FileObject] = []
        for snapshot in await self.batches.many(stored):
            for kind in ("output", "error"):
                try:
                    out.append(result_object(await self.describe(snapshot, kind)))
                except NotFound:  # no such file (not ended, no such lines, expired, or a shard is gone)
                    continue
        return out

    async def get(self, tenant: str, file_id: str) -> results.ResultFile:
        """The result file ``file_id`` of one of the tenant's batches; 404 (``expired`` past its expiry)."""
        kind: results.Kind = "output" if file_id.startswith(OUTPUT_PREFIX) else "error"
        batch_id = file_id.removeprefix(OUTPUT_PREFIX if kind == "output" else ERROR_PREFIX)
        try:
            snapshot = await self.batches.one(tenant, batch_id)
        except NotFound:
            raise await not_found(self.expiry, "batch", tenant, batch_id, file_id) from None
        return await self.describe(snapshot, kind)

    async def describe(self, snapshot: Snapshot, kind: results.Kind) -> results.ResultFile:
        """The batch's output or error file; :class:`NotFound` until it ended with such lines."""
        batch = snapshot.batch()
        file_id = batch.output_file_id if kind == "output" else batch.error_file_id
        if file_id is None:
            ids = output_file_id if kind == "output" else error_file_id
            raise missing(ids(snapshot.stored.id))
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
            raise missing(file_id) from None
        return dataclasses.replace(found, expires_at=expires_at)
