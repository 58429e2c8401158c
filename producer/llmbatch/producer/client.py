"""Async SDK for upstream services: submit, cancel, follow and wait for batches, read results.

Example::

    async with BatchClient(LLMBatchSettings()) as client:
        handle = await client.submit(file="requests.jsonl", model="HuggingFaceTB/SmolLM2-135M-Instruct")
        done = await handle.wait(timeout=3600)
        async for line in client.iter_results(done):
            print(line.custom_id, line.ok)

Nothing is uploaded or published until every line validated; uploads are content-addressed (the
same file is stored once); events are published with ``acks=all`` and the batch id as key.
"""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from llmbatch.adapters import storage
from llmbatch.adapters.errors import InvalidInput, ProducerError, WaitTimeout
from llmbatch.adapters.kafka import Published, Publisher, follow_events
from llmbatch.producer.inputs import PreparedFile, prepare_file, prepare_requests, write_jsonl
from llmbatch.producer.request_checks import (
    build_request,
    check_fields,
    check_request,
    fits_inline,
    invalid_input,
)
from llmbatch.producer.results import ResultReader, ResultSource
from llmbatch.schemas import (
    RESULT_EVENT_TYPES,
    BatchInputLine,
    BatchOutputLine,
    BatchRejected,
    BatchRequest,
    CancelRequest,
    Endpoint,
    Envelope,
    InlineLimits,
    Manifest,
    SchemaError,
    TerminalEventData,
    utcnow,
)
from llmbatch.schemas.compat import TIMEOUT_ERRORS
from llmbatch.schemas.tenant_auth import TenantSigner
from llmbatch.settings import LLMBatchSettings

Answer = TerminalEventData | BatchRejected
"""What ends a wait: the batch's terminal event, or the ``rejected`` answer to a request."""


def is_answer(envelope: Envelope[Any], request_id: str | None = None) -> bool:
    """Whether ``envelope`` ends a wait for its batch: a terminal event, or a ``rejected`` event that
    answers ``request_id`` (the ``ce_id`` of our own request) or, without one, after which no
    terminal event will follow (:attr:`BatchRejected.is_final`)."""
    if envelope.is_terminal:
        return True
    data = envelope.data
    if not isinstance(data, BatchRejected):
        return False
    return data.request_id == request_id if request_id is not None else data.is_final


def default_source() -> str:
    """``ce_source`` of events this process publishes: ``urn:llmbatch:producer:<hostname>``."""
    return f"urn:llmbatch:producer:{socket.gethostname() or 'unknown'}"


def new_batch_id() -> str:
    """A fresh batch id (``batch_<32 hex>``) for callers without their own idempotency key."""
    return f"batch_{uuid.uuid4().hex}"


class ClientOptions(BaseModel):
    """Behaviour of :class:`BatchClient` (connection settings come from ``LLMBatchSettings``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str = Field(default_factory=default_source, min_length=1, description="ce_source of our events.")
    connect_timeout_s: float = Field(default=10.0, gt=0, description="Connecting to Kafka/MinIO.")
    publish_timeout_s: float = Field(default=30.0, gt=0, description="Waiting for acks=all.")
    inline_limits: InlineLimits = Field(default_factory=InlineLimits)
    spill_to_storage: bool = Field(
        default=True,
        description="Upload inline requests over the inline limits as a file instead of failing.",
    )
    enable_idempotence: bool = Field(default=False, description="Kafka idempotent producer.")
    follow_skew_s: float = Field(
        default=300.0, ge=0, description="Start following events this long before submission (clock skew)."
    )


@dataclass(slots=True)
class BatchHandle:
    """What :meth:`BatchClient.submit` returns: the batch's identity and shortcuts to follow it."""

    batch_id: str
    tenant: str
    model: str
    endpoint: Endpoint
    submitted_at: datetime
    event_id: str
    request_count: int
    input_uri: str | None = None
    skipped_lines: int = 0
    published: Published | None = None
    client: BatchClient | None = field(default=None, repr=False, compare=False)

    def _need_client(self) -> BatchClient:
        if self.client is None:
            raise ProducerError("this handle is detached from its client")
        return self.client

    async def wait(self, timeout: float | None = None) -> Envelope[Answer]:
        """Wait for this batch's terminal event, or the ``rejected`` answer to this very request
        (see :meth:`BatchClient.wait`)."""
        client = self._need_client()
        return await client.wait(
            self.batch_id,
            timeout,
            since=client.follow_start(self.submitted_at),
            request_id=self.event_id,
            tenant=self.tenant,
        )

    def events(self, *, stop_at_terminal: bool = True) -> AsyncGenerator[Envelope[Any], None]:
        """This batch's events since submission."""
        client = self._need_client()
        return client.events(
            self.batch_id,
            since=client.follow_start(self.submitted_at),
            stop_at_terminal=stop_at_terminal,
            tenant=self.tenant,
        )

    async def cancel(self, reason: str | None = None) -> Published:
        """Ask the dispatcher to cancel this batch."""
        return await self._need_client().cancel(self.batch_id, tenant=self.tenant, reason=reason)


class BatchClient:
    """Async client for one llmbatch deployment. Use as ``async with``, or call :meth:`close`."""

    def __init__(
        self, settings: LLMBatchSettings | None = None, *, options: ClientOptions | None = None
    ) -> None:
        self.settings = settings if settings is not None else LLMBatchSettings()
        self.options = options or ClientOptions()
        self._publisher = Publisher(
            self.settings.kafka,
            connect_timeout_s=self.options.connect_timeout_s,
            publish_timeout_s=self.options.publish_timeout_s,
            enable_idempotence=self.options.enable_idempotence,
            signer=TenantSigner(self.settings.tenants.key_bytes()),
        )
        self._s3: Any = None

    async def __aenter__(self) -> BatchClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Flush and close the Kafka producer."""
        await self._publisher.stop()

    @property
    def s3(self) -> Any:
        """The ``minio.Minio`` client (created on first use)."""
        if self._s3 is None:
            self._s3 = storage.make_client(self.settings.s3, timeout_s=self.options.connect_timeout_s)
        return self._s3

    def follow_start(self, submitted_at: datetime) -> datetime:
        """Where following a batch submitted at ``submitted_at`` starts (minus the skew margin)."""
        return submitted_at - timedelta(seconds=self.options.follow_skew_s)

    # ---------------------------------------------------------------------------- submit

    async def submit(
        self,
        requests: Iterable[BatchInputLine | Mapping[str, Any]] | None = None,
        *,
        file: str | Path | None = None,
        model: str,
        endpoint: Endpoint | str = Endpoint.CHAT_COMPLETIONS,
        batch_id: str | None = None,
        metadata: Mapping[str, str] | None = None,
        priority: int = 5,
        tenant: str = "default",
        completion_window: str | None = None,
        deadline: datetime | None = None,
        skip_invalid: bool = False,
        traceparent: str | None = None,
    ) -> BatchHandle:
        """Validate, upload (file inputs) and publish one batch; return its handle.

        Give either ``requests`` (input lines as models or dicts; sent inline when within the inline
        limits, else uploaded as a file) or ``file`` (a local JSONL file, uploaded to the input
        bucket under its content hash). Every line is validated first: if any is invalid,
        :class:`InvalidInput` lists them and nothing is uploaded or published, unless
        ``skip_invalid`` is true (then invalid lines are dropped and counted in
        ``handle.skipped_lines``).

        Raises:
            InvalidInput: a line or batch field violates the contract (not retriable).
            InputFileError: ``file`` cannot be read.
            StorageError / BrokerUnavailable / PublishFailed: infrastructure failed.
        """
        if (requests is None) == (file is None):
            raise InvalidInput("give exactly one of requests (inline lines) or file (a JSONL path)")
        try:
            endpoint = Endpoint(endpoint)
        except ValueError:
            raise InvalidInput(
                f"unknown endpoint {endpoint!r}; use one of {', '.join(e.value for e in Endpoint)}"
            ) from None
        batch_id = batch_id or new_batch_id()
        fields: dict[str, Any] = {
            "batch_id": batch_id,
            "model": model,
            "endpoint": endpoint,
            "metadata": dict(metadata or {}),
            "priority": priority,
            "tenant": tenant,
            "completion_window": completion_window,
            "deadline": deadline,
        }
        check_fields(fields)
        prepared: PreparedFile | None = None
        skipped = 0
        try:
            if file is not None:
                prepared = await asyncio.to_thread(
                    prepare_file, file, endpoint=endpoint, model=model, skip_invalid=skip_invalid
                )
                skipped, count = prepared.skipped, prepared.valid
            else:
                assert requests is not None
                lines, report = prepare_requests(
                    requests, endpoint=endpoint, model=model, skip_invalid=skip_invalid
                )
                skipped, count = report.invalid, len(lines)
                request = build_request({**fields, "requests": lines})
                if fits_inline(request, self.options.inline_limits):
                    return await self._publish_batch(request, count, skipped, traceparent)
                if not self.options.spill_to_storage:
                    check_request(request, self.options.inline_limits)  # raises limit_exceeded
                prepared = await asyncio.to_thread(write_jsonl, lines)
            uri = f"s3://{self.settings.s3.input_bucket}/{storage.input_key(tenant, prepared.sha256)}"
            request = build_request({**fields, "input_uri": uri})
            check_request(request, self.options.inline_limits)
            await self._publisher.start()  # an unreachable broker fails before anything is uploaded
            await asyncio.to_thread(
                storage.upload_input,
                self.s3,
                self.settings.s3,
                prepared.path,
                tenant=tenant,
                sha256_hex=prepared.sha256,
            )
            return await self._publish_batch(request, count, skipped, traceparent)
        except SchemaError as exc:
            raise InvalidInput(str(exc), [exc]) from None
        finally:
            if prepared is not None:
                prepared.cleanup()

    async def _publish_batch(
        self, request: BatchRequest, count: int, skipped: int, traceparent: str | None
    ) -> BatchHandle:
        check_request(request, self.options.inline_limits)
        envelope = Envelope.new(request, source=self.options.source, traceparent=traceparent)
        published = await self._publisher.publish(self.settings.kafka.topics.requests, envelope)
        return BatchHandle(
            batch_id=request.batch_id,
            tenant=request.tenant,
            model=request.model,
            endpoint=request.endpoint,
            submitted_at=envelope.time,
            event_id=envelope.id,
            request_count=count,
            input_uri=request.input_uri,
            skipped_lines=skipped,
            published=published,
            client=self,
        )

    async def submit_request(self, request: BatchRequest, *, traceparent: str | None = None) -> Published:
        """Publish a ready-made :class:`BatchRequest` (its ``input_uri`` must already exist)."""
        check_request(request, self.options.inline_limits)
        envelope = Envelope.new(request, source=self.options.source, traceparent=traceparent)
        return await self._publisher.publish(self.settings.kafka.topics.requests, envelope)

    async def cancel(
        self,
        batch_id: str,
        *,
        tenant: str = "default",
        reason: str | None = None,
        requested_by: str | None = None,
    ) -> Published:
        """Publish ``cancel_requested`` for ``batch_id`` of ``tenant``; partial results are kept."""
        with invalid_input():
            request = CancelRequest(
                batch_id=batch_id, tenant=tenant, reason=reason, requested_by=requested_by
            )
        envelope = Envelope.new(request, source=self.options.source)
        return await self._publisher.publish(self.settings.kafka.topics.requests, envelope)

    # ---------------------------------------------------------------------------- follow

    def events(
        self,
        batch_id: str | None = None,
        *,
        since: datetime | None = None,
        from_end: bool = False,
        stop_at_terminal: bool = True,
        tenant: str | None = None,
    ) -> AsyncGenerator[Envelope[Any], None]:
        """Follow the results topic from ``since`` (or the end / the beginning), filtered by batch id
        and, when given, by tenant (batch ids are scoped by tenant: two tenants' batches may share one).

        Ends after the batch's terminal event when ``batch_id`` is given and ``stop_at_terminal``;
        otherwise runs until the caller stops iterating.
        """
        return follow_events(
            self.settings.kafka,
            self.settings.kafka.topics.results,
            batch_id=batch_id,
            tenant=tenant,
            since=since,
            from_end=from_end,
            stop_at_terminal=stop_at_terminal,
            expect=RESULT_EVENT_TYPES,
            connect_timeout_s=self.options.connect_timeout_s,
        )

    async def wait(
        self,
        batch_id: str,
        timeout: float | None = None,
        *,
        since: datetime | None = None,
        request_id: str | None = None,
        tenant: str | None = None,
    ) -> Envelope[Answer]:
        """Return the answer about ``batch_id`` of ``tenant`` (default: any tenant's batch of that
        id; from ``since``; default: the last 24 hours): its
        terminal event, or a ``llmbatch.batch.rejected.v1`` event (data :class:`BatchRejected`:
        the reason, and where the dead letter is) that answers ``request_id`` (the ``event_id`` of
        the request you published; :meth:`BatchHandle.wait` passes it) or, without ``request_id``,
        one after which no terminal event will follow (see :func:`is_answer`).

        Raises:
            WaitTimeout: no answer within ``timeout`` seconds (retriable).
        """
        start = since if since is not None else utcnow() - timedelta(hours=24)

        async def first_terminal() -> Envelope[Answer]:
            async with aclosing(self.events(batch_id, since=start, tenant=tenant)) as stream:
                async for envelope in stream:
                    if is_answer(envelope, request_id):
                        return envelope
            raise ProducerError(f"event stream of {batch_id} ended without a terminal event")

        try:
            return await asyncio.wait_for(first_terminal(), timeout)
        except TIMEOUT_ERRORS:
            raise WaitTimeout(f"batch {batch_id} did not finish within {timeout:g}s") from None

    # ---------------------------------------------------------------------------- results

    @property
    def results(self) -> ResultReader:
        """The results reader on this client's S3 (manifests, output and error lines)."""
        return ResultReader(self.s3, self.settings.s3)

    async def manifest(self, batch_id: str, *, tenant: str = "default") -> Manifest:
        """:meth:`ResultReader.manifest`: ``manifest.json`` of a finished batch (its latest lifecycle)."""
        return await self.results.manifest(batch_id, tenant=tenant)

    def iter_results(self, source: ResultSource, *, errors: bool = False) -> AsyncIterator[BatchOutputLine]:
        """:meth:`ResultReader.iter_results`: the output (or error) lines of a finished batch."""
        return self.results.iter_results(source, errors=errors)

    async def results_by_custom_id(
        self, source: ResultSource, *, errors: bool = False
    ) -> dict[str, BatchOutputLine]:
        """All output (or error) lines of a batch keyed by ``custom_id``."""
        return {line.custom_id: line async for line in self.iter_results(source, errors=errors)}

    async def ensure_buckets(self) -> None:
        """Create the input and results buckets if missing (local stacks, tests)."""
        await asyncio.to_thread(storage.ensure_buckets, self.s3, self.settings.s3)
