"""Reading batches for the API: a tenant's batch records with what is known of their state.

Reads combine the API's record of a batch (:class:`~llmbatch.api.store.records.StoredBatch`) with the
dispatcher's Redis state (:mod:`llmbatch.api.store.state`) and, for a batch Redis does not know that is
older than ``state_fallback_after_s``, its manifest (:mod:`llmbatch.api.batches.results`); the mapping
itself is :func:`llmbatch.api.batches.status.to_batch`. A batch a tenant's service published to Kafka
directly has no API record: it is shown from the dispatcher's (:func:`kafka_view`).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from pydantic import ValidationError

from llmbatch.api.batches import results
from llmbatch.api.batches.status import to_batch
from llmbatch.api.errors import NotFound
from llmbatch.api.objects import Batch
from llmbatch.api.store.records import BATCH_PREFIX, RecordStore, StoredBatch
from llmbatch.api.store.state import StateReader
from llmbatch.api.store.storage import ObjectStore
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.ops.jobs import JobDetail
from llmbatch.schemas.common import BATCH_ID_PATTERN, Endpoint
from llmbatch.schemas.job import Manifest

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything known about one batch of the API."""

    stored: StoredBatch
    job: JobDetail | None
    manifest: Manifest | None

    def batch(self) -> Batch:
        return to_batch(self.stored, self.job, self.manifest)


class BatchReader:
    """Loads a tenant's batches with their state (Redis, else the manifest for old ones)."""

    def __init__(
        self,
        records: RecordStore,
        state: StateReader,
        objects: ObjectStore,
        *,
        results_bucket: str,
        fallback_after_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.records = records
        self.state = state
        self.objects = objects
        self.results_bucket = results_bucket
        self.fallback_after_s = fallback_after_s
        self.clock = clock

    async def one(self, tenant: str, batch_id: str) -> Snapshot:
        """The tenant's batch, created through the API or published to Kafka by one of the tenant's
        services; :class:`~llmbatch.api.errors.NotFound` for any other id."""
        stored = await self.records.get("batches", StoredBatch, tenant, batch_id)
        if stored is None:
            sent = await self.sent_to_kafka(tenant, [batch_id])
            if batch_id in sent:
                return sent[batch_id]
            raise NotFound(f"No batch found with id {batch_id!r}", param="batch_id")
        (snapshot,) = await self.many([stored])
        return snapshot

    async def sent_to_kafka(self, tenant: str, batch_ids: Sequence[str]) -> dict[str, Snapshot]:
        """The tenant's batches of ``batch_ids`` that the dispatcher accepted from Kafka, as the API shows
        them (read from Redis; not stored), by id, in one round trip. Ids in the API's own namespace
        (``batch_...``) are the API's alone, and a refused request's record carries no tenant that was
        checked: neither is shown, nor a record the API cannot show (an older one)."""
        wanted = [b for b in batch_ids if KAFKA_BATCH_ID.fullmatch(b) and not b.startswith(BATCH_PREFIX)]
        jobs = await self.state.get_many([(tenant, b) for b in wanted])
        found = {}
        for batch_id, job in zip(wanted, jobs, strict=True):
            if job is None or job.state is State.DEAD_LETTERED or job.tenant != tenant:
                continue
            try:
                found[batch_id] = Snapshot(kafka_view(job), job, None)
            except (ValidationError, ValueError):  # a record the API cannot show: left out of the list
                log.warning("batch %s: its record cannot be shown as an API batch", batch_id, exc_info=True)
        return found

    async def many(self, stored: Sequence[StoredBatch]) -> list[Snapshot]:
        jobs = await self.state.get_many([(s.tenant, s.id) for s in stored])
        now = self.clock()
        out = []
        for record, job in zip(stored, jobs, strict=True):
            manifest = None
            if job is None and now - record.created_at > self.fallback_after_s:
                manifest = await results.find_manifest(
                    self.objects, self.results_bucket, record.tenant, record.id
                )
            out.append(Snapshot(record, job, manifest))
        return out


KAFKA_BATCH_ID = re.compile(BATCH_ID_PATTERN)


def kafka_view(job: JobDetail) -> StoredBatch:
    """What the API shows of a batch published to Kafka: its request as the dispatcher recorded it
    (no input file of the API: ``input_file_id`` is empty; its window from its deadline)."""
    created = (job.accepted_at or job.state_at or datetime.now(UTC)).timestamp()
    expires = job.deadline.timestamp() if job.deadline is not None else created + 86_400
    return StoredBatch(
        id=job.batch_id,
        tenant=job.tenant,
        created_at=created,
        input_file_id="",
        endpoint=Endpoint(job.endpoint or Endpoint.CHAT_COMPLETIONS.value),
        model=job.model,
        completion_window=f"{max(1, round(expires - created))}s",
        expires_at=expires,
        metadata=dict(job.metadata),
        total=job.counts.total,
        input_uri=job.input_uri or "",
        priority=job.priority if job.priority is not None else 5,
        via_kafka=True,
    )
