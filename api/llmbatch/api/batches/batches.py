"""Batches through the API: create and cancel become the producer's events, reads map state.

``POST /v1/batches`` publishes the same ``llmbatch.batch.requested.v1`` event the producer SDK does
(a :class:`llmbatch.schemas.BatchRequest` built and checked by the schemas' own validators, wrapped by
:meth:`llmbatch.schemas.Envelope.new`, published with ``acks=all`` keyed by the batch id), naming the
uploaded file as its ``input_uri`` and its lines' model; ``POST /v1/batches/{id}/cancel`` publishes
``llmbatch.batch.cancel_requested.v1``. The API keeps a record of each batch it created
(:class:`~llmbatch.api.store.records.StoredBatch`): it is written *before* the event, so a batch never runs
without the API knowing it (if publishing fails the record is removed again and the call answers 503). A
record whose event never got out (the API stopped in between) has its event published again when the
batch is read and the dispatcher has not heard of it after ``republish_after_s``.

Reads go through :class:`llmbatch.api.batches.batch_reader.BatchReader` (the record with the dispatcher's
state, else the manifest).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol

from pydantic import ValidationError

from llmbatch.adapters.kafka import Published
from llmbatch.api.batches import idempotency, listing
from llmbatch.api.batches.batch_reader import KAFKA_BATCH_ID, BatchReader, Snapshot
from llmbatch.api.batches.expiry import Expiry
from llmbatch.api.batches.status import to_batch
from llmbatch.api.errors import (
    ApiError,
    Conflict,
    InvalidRequest,
    NotFound,
    from_exception,
)
from llmbatch.api.objects import TERMINAL_STATUSES, Batch, BatchCreate, ListPage
from llmbatch.api.store.records import (
    BATCH_ID,
    BATCH_PREFIX,
    IdempotentCreate,
    Layout,
    StoredBatch,
    StoredFile,
    after_ms,
    made_ms,
    new_id,
)
from llmbatch.api.tenancy import tenant_limits
from llmbatch.api.tenancy.quota import ActiveBatches
from llmbatch.schemas import (
    BatchRequest,
    CancelRequest,
    Envelope,
    SchemaError,
    check_submittable,
    parse_duration,
)
from llmbatch.settings.retention import RetentionSettings

MAX_BATCH_PAGE = 100
# pages a list reads at most to fill one (a run of listed Kafka batches whose records expired)
LIST_ROUNDS = 10
log = logging.getLogger(__name__)


class EventPublisher(Protocol):
    """Publishes one event and waits for Kafka's acknowledgement
    (:class:`llmbatch.adapters.kafka.Publisher`)."""

    async def publish(self, topic: str, envelope: Envelope[Any]) -> Published: ...


class BatchService:
    """Create, read, list and cancel a tenant's batches."""

    def __init__(
        self,
        reader: BatchReader,
        layout: Layout,
        publisher: EventPublisher,
        *,
        requests_topic: str,
        source: str,
        default_window: str = "24h",
        priority: int = 5,
        republish_after_s: float = 120.0,
        max_active: int = 0,
        token_limits: Mapping[str, int] | None = None,
        storage_limits: Mapping[str, int] | None = None,
        expiry: Expiry | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.reader = reader
        self.expiry = expiry or Expiry(None, RetentionSettings(), clock=clock)
        self.token_limits = dict(token_limits or {})
        self.storage_limits = dict(storage_limits or {})
        self.active = ActiveBatches(
            reader.records,
            reader.state,
            limit=max_active,
            unknown_after_s=reader.fallback_after_s,
            clock=clock,
        )
        self.idempotency = idempotency.IdempotencyStore(reader.objects, layout)
        self.republish_after_s = republish_after_s
        self.records = reader.records
        self.layout = layout
        self.publisher = publisher
        self.requests_topic = requests_topic
        self.source = source
        self.default_window = default_window
        self.priority = priority
        self.clock = clock

    async def create(self, tenant: str, body: BatchCreate, *, idempotency_key: str | None = None) -> Batch:
        """Publish ``batch.requested`` for the tenant's uploaded file; the new batch is ``validating``.
        With ``idempotency_key``, one batch per key (:mod:`llmbatch.api.batches.idempotency`)."""
        if idempotency_key is None:
            stored, envelope = await self._new_batch(tenant, body)
            await self._admit(stored)
            await self.records.put("batches", stored)
            try:
                await self.publisher.publish(self.requests_topic, envelope)
            except Exception as exc:
                await self._forget(stored)
                raise from_exception(exc) from exc
            return to_batch(stored, None)
        digest, asked = idempotency.key_digest(idempotency_key), idempotency.request_digest(body)
        claim = await self.idempotency.get(tenant, digest)
        if claim is None:
            stored, _ = await self._new_batch(tenant, body)
            stored = stored.model_copy(update={"idempotency_key_sha256": digest})
            await self._admit(stored)
            mine = IdempotentCreate(request_sha256=asked, batch=stored)
            claim = mine if await self.idempotency.claim(tenant, digest, mine) else None
            if claim is None:  # a concurrent create won: this batch will not exist
                await self.active.forget(tenant, stored.id)
            claim = claim or await self.idempotency.get(tenant, digest)
            if claim is None:
                raise Conflict(
                    f"a create with this {idempotency.HEADER} is in progress: retry",
                    code="idempotency_key_in_use",
                )
        if claim.request_sha256 != asked:
            raise idempotency.reused(claim)
        return await self._finish(claim.batch)

    async def _finish(self, stored: StoredBatch) -> Batch:
        """Make sure a claimed create's batch has its record and, while the dispatcher has not heard
        of it, its event (the same one each time). A failed publish keeps both: a repeat finishes."""
        await self.records.put("batches", stored)  # the same content each time
        snapshot = (await self.reader.many([stored]))[0]
        if snapshot.job is None and snapshot.manifest is None and self.clock() < stored.expires_at:
            try:
                await self.publisher.publish(self.requests_topic, self._request_event(stored))
            except Exception as exc:
                raise from_exception(exc) from exc
        return snapshot.batch()

    async def _new_batch(self, tenant: str, body: BatchCreate) -> tuple[StoredBatch, Envelope[BatchRequest]]:
        """A new batch of the tenant's file, checked, and its ``batch.requested`` event."""
        window = body.completion_window or self.default_window
        try:
            window_s = parse_duration(window).total_seconds()
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="completion_window") from None
        now = self.clock()
        batch_id = new_id(BATCH_PREFIX, now)
        try:  # before the file is read: see FileService.delete
            await self.records.add_use(tenant, body.input_file_id, batch_id)
        except Exception as exc:
            raise from_exception(exc) from exc
        file = await self.records.get("files", StoredFile, tenant, body.input_file_id)
        if file is None:
            raise NotFound(f"No such File object: {body.input_file_id}", param="input_file_id")
        if file.endpoint != body.endpoint:
            raise InvalidRequest(
                f"the lines of {file.id} target {file.endpoint.value}: create the batch with endpoint "
                f"{file.endpoint.value!r} (or upload a file for {body.endpoint.value})",
                param="endpoint",
            )
        await tenant_limits.check_tokens(self.reader.state, self.token_limits, tenant, file.bytes)
        await tenant_limits.check_storage(self.reader.state, self.storage_limits, tenant)
        input_uri = self.layout.content_uri(tenant, file.id)
        priority = self.priority if body.priority is None else body.priority
        try:
            request = BatchRequest(
                batch_id=batch_id,
                model=file.model,
                endpoint=body.endpoint,
                input_uri=input_uri,
                completion_window=window,
                priority=priority,
                metadata=dict(body.metadata or {}),
                tenant=tenant,
                output_expires_after=body.output_expires_after,
            )
            check_submittable(request)
        except ValidationError as exc:
            raise from_exception(SchemaError.from_validation_error(exc)) from None
        except SchemaError as exc:
            raise from_exception(exc) from None
        envelope = Envelope.new(request, source=self.source, time=datetime.fromtimestamp(now, UTC))
        stored = StoredBatch(
            id=batch_id,
            tenant=tenant,
            created_at=now,
            input_file_id=file.id,
            endpoint=body.endpoint,
            model=file.model,
            completion_window=window,
            expires_at=now + window_s,
            metadata=dict(body.metadata or {}),
            total=file.requests,
            input_uri=input_uri,
            priority=priority,
            event_id=envelope.id,
            event_source=envelope.source,
            output_expires_after=body.output_expires_after,
        )
        return stored, envelope

    async def _admit(self, stored: StoredBatch) -> None:
        """Count the batch against its tenant's active-batch quota (429 when over it)."""
        try:
            await self.active.admit(stored.tenant, stored.id)
        except ApiError:
            raise
        except Exception as exc:
            raise from_exception(exc) from exc

    async def _forget(self, stored: StoredBatch) -> None:
        try:
            await self.active.forget(stored.tenant, stored.id)
            await self.records.delete("batches", stored.tenant, stored.id)
        except Exception:  # the publish error is the one to report; an orphan record only reads validating
            log.warning("could not remove the record of unpublished batch %s", stored.id, exc_info=True)

    async def get(self, tenant: str, batch_id: str) -> Batch:
        try:
            snapshot = await self.reader.one(tenant, batch_id)
        except NotFound as missing:
            raise await self.expiry.gone_or(missing, "batch", tenant, batch_id, "batch_id") from None
        await self._publish_lost([snapshot])
        return snapshot.batch()

    async def _publish_lost(self, snapshots: Sequence[Snapshot]) -> None:
        """Publish again the event of each batch the dispatcher has not heard of long after its create.

        The record is written before the event: an API that stops in between (or whose publish failed
        and whose clean-up failed too) leaves a batch that would read ``validating`` for ever. The copy
        carries the record's event id and key, so if the first one did get out the dispatcher drops
        the copy as a redelivery; at most one copy per ``republish_after_s`` and batch, and none once
        the batch's completion window is over."""
        now = self.clock()
        for snapshot in snapshots:
            stored = snapshot.stored
            last = max(stored.created_at, stored.republished_at or 0.0)
            known = snapshot.job is not None or snapshot.manifest is not None or stored.via_kafka
            # past its completion window it would only run late (and, once the dispatcher's 7 days of
            # event ids are over, a batch it has forgotten would run again)
            if known or now - last < self.republish_after_s or now >= stored.expires_at:
                continue
            try:
                await self.publisher.publish(self.requests_topic, self._request_event(stored))
                if stored.cancel_requested_at is not None:
                    # its cancel found no batch (ignored): send it again, after the request (same key,
                    # same partition: the dispatcher reads them in this order)
                    cancel = self._cancel_event(stored.id, stored.tenant)
                    await self.publisher.publish(self.requests_topic, cancel)
                await self.records.put("batches", stored.model_copy(update={"republished_at": now}))
            except Exception:  # the next read tries again; reading must not fail for it
                log.warning("could not publish batch %s again", stored.id, exc_info=True)
                continue
            log.warning(
                "batch %s: the dispatcher had not heard of it %.0f s after its create; its event "
                "was published again",
                stored.id,
                now - stored.created_at,
            )

    def _cancel_event(self, batch_id: str, tenant: str) -> Envelope[CancelRequest]:
        request = CancelRequest(
            batch_id=batch_id,
            tenant=tenant,
            reason="cancelled through the HTTP API",
            requested_by=f"api:{tenant}",
        )
        return Envelope.new(request, source=self.source)

    def _request_event(self, stored: StoredBatch) -> Envelope[BatchRequest]:
        """The batch's ``batch.requested`` event as :meth:`create` built it."""
        request = BatchRequest(
            batch_id=stored.id,
            model=stored.model,
            endpoint=stored.endpoint,
            input_uri=stored.input_uri,
            completion_window=stored.completion_window,
            priority=stored.priority,
            metadata=dict(stored.metadata),
            tenant=stored.tenant,
            output_expires_after=stored.output_expires_after,
        )
        # the record's id and source (another API replica's, maybe): the dispatcher's test of "the
        # same event again"; a new id would be answered as a duplicate batch id
        return Envelope.new(
            request,
            source=stored.event_source or self.source,
            id=stored.event_id,
            time=datetime.fromtimestamp(stored.created_at, UTC),
        )

    async def list(self, tenant: str, *, after: str | None, limit: int) -> ListPage[Batch]:
        """The tenant's batches, the API's and those its services sent to Kafka, newest first
        (``limit`` 1-100, ``after`` a batch id of an earlier page); see :mod:`llmbatch.api.batches.listing`.

        A Kafka batch whose dispatcher record has expired stays in the tenant's index a while longer
        and is left out; the page then reads on (at most :data:`LIST_ROUNDS` times), so that a page
        is not cut short, or empty with more behind it (an SDK's paging stops at an empty page)."""
        if not 1 <= limit <= MAX_BATCH_PAGE:
            raise InvalidRequest(f"limit must be between 1 and {MAX_BATCH_PAGE} (got {limit})", param="limit")
        batches: list[Batch] = []
        window = limit
        for _ in range(LIST_ROUNDS):
            shown, has_more, after = await self._page(tenant, after, limit - len(batches), window)
            batches += shown
            if len(batches) == limit or not has_more:
                break
            window = MAX_BATCH_PAGE  # a run of expired entries: read on in bigger steps
        return ListPage[Batch].of(batches, has_more=has_more, ids=[b.id for b in batches])

    async def _page(
        self, tenant: str, after: str | None, want: int, window: int
    ) -> tuple[Sequence[Batch], bool, str]:
        """Up to ``want`` batches from the next ``window`` entries after ``after``; whether entries
        follow the last one taken; that entry's id (the next read's cursor)."""
        api_after, kafka_after = await self._cursors(tenant, after)
        api_ids = await self.records.ids("batches", tenant, after=api_after, limit=window + 1)
        kafka = await self.reader.state.listed(tenant, after=kafka_after, limit=window + 1)
        entries = listing.merge(api_ids, kafka)
        read = entries[:window]
        mine = [e.batch_id for e in read if not e.via_kafka]
        stored = await self.records.get_many("batches", StoredBatch, tenant, mine)
        snapshots = await self.reader.many(stored)
        await self._publish_lost(snapshots)
        shown = {s.stored.id: s for s in snapshots}
        shown.update(await self.reader.sent_to_kafka(tenant, [e.batch_id for e in read if e.via_kafka]))
        batches: list[Batch] = []
        taken = 0
        for taken, entry in enumerate(read, 1):  # noqa: B007 (the count read, after the loop)
            if entry.batch_id in shown:
                batches.append(shown[entry.batch_id].batch())
                if len(batches) == want:
                    break
        last = read[taken - 1].batch_id if read else (after or "")
        return batches, len(entries) > taken, last

    async def _cursors(
        self, tenant: str, after: str | None
    ) -> tuple[str | None, tuple[int, str | None] | None]:
        """Where the API's records and the Kafka batches go on after ``after``."""
        if after is None:
            return None, None
        if BATCH_ID.fullmatch(after):
            return after, (made_ms(after, BATCH_PREFIX), None)
        ms = await self.reader.state.listed_at(tenant, after) if KAFKA_BATCH_ID.fullmatch(after) else None
        if ms is None:
            raise InvalidRequest(
                f"after must be a batch id from an earlier page (got {after[:80]!r})", param="after"
            )
        return after_ms(BATCH_PREFIX, ms), (ms, after)

    async def cancel(self, tenant: str, batch_id: str) -> Batch:
        """Publish ``cancel_requested``; the batch reads ``cancelling`` until the dispatcher ends it."""
        snapshot = await self.reader.one(tenant, batch_id)
        batch = snapshot.batch()
        if batch.status in {"cancelling", "cancelled"}:
            return batch
        if batch.status in TERMINAL_STATUSES:
            raise Conflict(
                f"batch {batch_id} is already {batch.status}: only a batch that has not ended can be "
                "cancelled",
                code="batch_not_cancellable",
            )
        try:
            await self.publisher.publish(self.requests_topic, self._cancel_event(batch_id, tenant))
        except Exception as exc:
            raise from_exception(exc) from exc
        stored = snapshot.stored.model_copy(update={"cancel_requested_at": self.clock()})
        try:
            if not stored.via_kafka:  # the API keeps records of its own batches only
                await self.records.put("batches", stored)
        except Exception:  # the cancel is out: the dispatcher's record will say cancelling soon
            log.warning("could not record the cancel of batch %s", batch_id, exc_info=True)
        return to_batch(stored, snapshot.job, snapshot.manifest)
