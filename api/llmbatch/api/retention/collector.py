"""The collector: deletes what expired (result files, manifests, uploaded inputs, records and state).

Each pass claims expired members of the retention index (:mod:`llmbatch.dispatcher.state.retention`)
for a lease, deletes, and settles them; several replicas can run passes at once (a member is held by
one claim at a time, and every step of a deletion can be done again, so a pass that dies mid-way is
finished by the next claim). What a running batch needs is never deleted:

- a batch's lifecycle goes only after one atomic look at its state in Redis
  (``retention_retire.lua``): a lifecycle an operator reopened is left alone (its new end dates it
  again), and a newer lifecycle of the same batch id keeps its state and its own result folder;
- an upload a batch may still read (one created from it that has not ended) waits
  (:meth:`llmbatch.api.files.files.FileService.remove`); it is tried again ``in_use_retry_s`` later.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Protocol

from llmbatch.adapters.storage import split_uri
from llmbatch.api.batches.batch_reader import BatchReader
from llmbatch.api.errors import Conflict
from llmbatch.api.files.files import FileService
from llmbatch.api.store.records import BATCH_ID, Layout, RecordStore, StoredBatch, StoredFile
from llmbatch.api.store.state import StateReader
from llmbatch.api.store.storage import ObjectStore, delete_under
from llmbatch.dispatcher.domain.retention import Expiring, parse_member
from llmbatch.dispatcher.state.retention import Claim, Retired
from llmbatch.schemas.job import output_prefix
from llmbatch.settings.retention import RetentionSettings

log = logging.getLogger(__name__)
_AT_ONCE = 8  # members deleted at the same time


class CollectIndex(Protocol):
    """The retention index as the collector uses it
    (:class:`~llmbatch.dispatcher.state.retention.RetentionIndex`)."""

    async def claim(self, now: float, *, lease_s: float, limit: int) -> list[Claim]: ...

    async def done(self, claim: Claim) -> bool: ...

    async def defer(self, claim: Claim, until: float) -> bool: ...

    async def gone(self, claim: Claim, item: Expiring, expired_at: float, forget_after_s: int) -> bool: ...

    async def retire_batch(
        self, claim: Claim, item: Expiring, now: float, forget_after_s: int
    ) -> Retired: ...


@dataclass
class Report:
    """What a collection removed and left."""

    batches: int = 0
    """Lifecycles of batches whose results and state were removed."""
    files: int = 0
    """Uploaded files removed."""
    result_objects: int = 0
    """Result shards and manifests deleted."""
    in_use: int = 0
    """Expired uploads left for later: a batch that has not ended may still read them."""
    reopened: int = 0
    """Expired lifecycles left alone: an operator reopened them (their end dates them again)."""
    lost: int = 0
    """Claims another collector took over (their lease ran out)."""
    invalid: int = 0
    """Index members that name nothing this service makes (dropped)."""
    failed: int = 0
    """Members whose removal failed (S3 or Redis refused a step): taken again after their lease."""
    first_error: str = ""
    """Why the first of them failed."""

    def add(self, other: Report) -> None:
        for name, value in asdict(other).items():
            if name == "first_error":
                self.first_error = self.first_error or other.first_error
            else:
                setattr(self, name, getattr(self, name) + value)

    @property
    def removed_anything(self) -> bool:
        return bool(self.batches or self.files or self.result_objects or self.invalid)


class Collector:
    """Deletes expired things (see the module docstring)."""

    def __init__(
        self,
        index: CollectIndex,
        objects: ObjectStore,
        files: FileService,
        *,
        results_bucket: str,
        settings: RetentionSettings,
        lease_s: float = 600.0,
        in_use_retry_s: float = 3600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.index = index
        self.objects = objects
        self.files = files
        self.records: RecordStore = files.records
        self.results_bucket = results_bucket
        self.settings = settings
        self.lease_s = lease_s
        self.in_use_retry_s = in_use_retry_s
        self.clock = clock

    @classmethod
    def over(
        cls,
        index: CollectIndex,
        objects: ObjectStore,
        state: StateReader,
        *,
        input_bucket: str,
        results_bucket: str,
        settings: RetentionSettings,
        fallback_after_s: float,
        clock: Callable[[], float] = time.time,
    ) -> Collector:
        """A collector over the API's ports (the files it removes are read as the API reads them)."""
        records = RecordStore(objects, Layout(input_bucket))
        reader = BatchReader(
            records,
            state,
            objects,
            results_bucket=results_bucket,
            fallback_after_s=fallback_after_s,
            clock=clock,
        )
        files = FileService(objects, records, reader, max_upload_bytes=0, max_file_requests=0, clock=clock)
        return cls(index, objects, files, results_bucket=results_bucket, settings=settings, clock=clock)

    async def collect(self, *, limit: int = 100, max_passes: int = 1000) -> Report:
        """Passes of up to ``limit`` members until none has expired (at most ``max_passes``)."""
        report = Report()
        for _ in range(max_passes):
            claims = await self.index.claim(self.clock(), lease_s=self.lease_s, limit=limit)
            # the batches first: one that was an upload's last reader is gone before the upload is looked at
            batches = [c for c in claims if c.member.startswith("b|")]
            for group in (batches, [c for c in claims if not c.member.startswith("b|")]):
                for start in range(0, len(group), _AT_ONCE):
                    for one in await asyncio.gather(*map(self._one, group[start : start + _AT_ONCE])):
                        report.add(one)
            if len(claims) < limit:
                break
        return report

    async def _one(self, claim: Claim) -> Report:
        """One claimed member removed (or left, saying why). A failure is this member's alone: the pass
        goes on with the others, and the member is taken again once its lease ends."""
        try:
            return await self._remove(claim)
        except Exception as exc:
            return Report(failed=1, first_error=f"{claim.member[:200]}: {str(exc)[:500]}")

    async def _remove(self, claim: Claim) -> Report:
        item = parse_member(claim.member)
        if item is None:
            log.warning("dropping a retention entry this service did not make: %r", claim.member[:200])
            await self.index.done(claim)
            return Report(invalid=1)
        if item.kind == "file":
            return await self._file(claim, item)
        return await self._batch(claim, item)

    async def _file(self, claim: Claim, item: Expiring) -> Report:
        stored = await self.records.get("files", StoredFile, item.tenant, item.id)
        if stored is None:  # deleted by its tenant (or its upload failed after dating it)
            await self.objects.delete(
                self.records.layout.bucket, self.records.layout.content_key(item.tenant, item.id)
            )
            await self.index.done(claim)
            return Report()
        now = self.clock()
        if stored.expires_at is None or stored.expires_at > now:  # not this record's date (never expected)
            await self.index.done(claim)
            return Report()
        try:
            await self.files.remove(stored)
        except Conflict:
            await self.index.defer(claim, now + self.in_use_retry_s)
            return Report(in_use=1)
        settled = await self.index.gone(claim, item, stored.expires_at, self.settings.forget_after_s)
        return Report(files=1, lost=0 if settled else 1)

    async def _batch(self, claim: Claim, item: Expiring) -> Report:
        verdict = await self.index.retire_batch(claim, item, self.clock(), self.settings.forget_after_s)
        if verdict == "lost":
            return Report(lost=1)
        if verdict == "running":
            return Report(reopened=1)
        deleted = await self._delete_results(item)
        if verdict == "retired":
            await self._delete_api_records(item)
        settled = await self.index.done(claim)
        return Report(batches=1, result_objects=deleted, lost=0 if settled else 1)

    async def _delete_results(self, item: Expiring) -> int:
        """Delete the lifecycle's folder of results (shards and manifest); for a batch of before
        lifecycles, the objects right in the batch's folder. Returns how many went."""
        _, folder = split_uri(
            output_prefix(self.results_bucket, item.tenant, item.id, item.lifecycle or None)
        )

        def other_lifecycles(key: str) -> bool:  # a batch of before lifecycles: its own objects only
            return not item.lifecycle and "/" in key[len(folder) :]

        return await delete_under(
            self.objects, self.results_bucket, folder, spare=other_lifecycles, at_once=_AT_ONCE * 4
        )

    async def _delete_api_records(self, item: Expiring) -> None:
        """A batch the API created: its record, its marks and its Idempotency-Key's claim go with it."""
        if not BATCH_ID.fullmatch(item.id):
            return
        stored = await self.records.get("batches", StoredBatch, item.tenant, item.id)
        if stored is None:
            return
        await self.records.drop_use(item.tenant, stored.input_file_id, item.id)
        await self.records.drop_active(item.tenant, item.id)
        if stored.idempotency_key_sha256 is not None:  # a repeat of its create would make it again
            layout = self.records.layout
            await self.objects.delete(
                layout.bucket, layout.idempotency_key(item.tenant, stored.idempotency_key_sha256)
            )
        await self.records.delete("batches", item.tenant, item.id)


async def collect_forever(collector: Collector, every_s: float) -> None:
    """Collect every ``every_s`` until cancelled. A pass that cannot run, or leaves members it failed
    to remove, is logged once per change (it failing, it working again), never raised: the API serves
    on."""
    failing = False
    while True:
        try:
            report = await collector.collect()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not failing:
                log.warning("the retention collector cannot run: %s (retrying every %.0f s)", exc, every_s)
            failing = True
        else:
            if report.failed and not failing:
                log.warning(
                    "the retention collector could not remove %d expired things, first %s (they are tried "
                    "again)",
                    report.failed,
                    report.first_error,
                )
            elif failing and not report.failed:
                log.info("the retention collector runs again")
            failing = bool(report.failed)
            if report.removed_anything:
                log.info("retention: expired files and results removed", extra={"report": asdict(report)})
        await asyncio.sleep(every_s)
