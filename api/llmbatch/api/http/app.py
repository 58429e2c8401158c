"""The FastAPI application: OpenAI's Files and Batches endpoints over :mod:`llmbatch.api.files.files` and
:mod:`llmbatch.api.batches.batches`.

:func:`create_app` takes the ready services (:func:`build_services` makes them from their ports:
object storage, the dispatcher's state, a Kafka publisher), so the transport stays here at the edge
and tests drive the real app with in-memory ports. Every error answers in OpenAI's shape
(:mod:`llmbatch.api.errors`), including FastAPI's own validation errors (400 with ``param``), unknown routes
and bodies over the limits (413, checked from ``Content-Length`` and while the body streams in).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Protocol

import orjson
from fastapi import FastAPI, Header, Query, Request
from fastapi.exceptions import HTTPException, RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmbatch.adapters.errors import ProducerError
from llmbatch.api.batches.batch_reader import BatchReader
from llmbatch.api.batches.batches import BatchService, EventPublisher
from llmbatch.api.batches.expiry import Expiry, ExpiryIndex
from llmbatch.api.errors import ApiError, InternalError, InvalidRequest, PayloadTooLarge, from_exception
from llmbatch.api.files.files import FileService
from llmbatch.api.objects import Batch, BatchCreate, FileDeleted, FileObject, ListPage
from llmbatch.api.retention.collector import CollectIndex, Collector, collect_forever
from llmbatch.api.settings import ApiOptions
from llmbatch.api.store.records import Layout, RecordStore
from llmbatch.api.store.state import StateReader
from llmbatch.api.store.storage import ObjectStore
from llmbatch.api.tenancy.auth import Authenticator, RateLimiter
from llmbatch.api.tenancy.caller import Tenant
from llmbatch.api.tenancy.usage import UsageService, UsageSource
from llmbatch.api.tenancy.usage import add_routes as add_usage_routes
from llmbatch.api.webhooks.webhooks import EndpointStore, WebhookService, add_routes
from llmbatch.dispatcher.errors import DispatcherError
from llmbatch.schemas.common import MAX_EXPIRES_AFTER_S, MIN_EXPIRES_AFTER_S, ExpiresAfter
from llmbatch.settings.retention import RetentionSettings
from llmbatch.settings.webhooks import WebhookSettings

log = logging.getLogger(__name__)
FORM_FIELDS = frozenset({"file", "purpose"})
EXPIRES_FIELDS = frozenset({"expires_after[anchor]", "expires_after[seconds]"})
MULTIPART_SLACK = 1 << 20
"""Bytes a multipart body may carry beyond the file itself (boundaries, headers, the purpose)."""


class RetentionIndex(ExpiryIndex, CollectIndex, Protocol):
    """The retention index as the API uses it
    (:class:`llmbatch.dispatcher.state.retention.RetentionIndex`)."""


@dataclass(frozen=True)
class Services:
    """What the routes call."""

    files: FileService
    batches: BatchService
    auth: Authenticator
    limiter: RateLimiter
    max_upload_bytes: int
    max_json_bytes: int
    webhooks: WebhookService
    usage: UsageService
    collector: Collector | None = None
    collect_every_s: float = 0.0


def build_services(
    options: ApiOptions,
    *,
    objects: ObjectStore,
    state: StateReader,
    publisher: EventPublisher,
    input_bucket: str,
    results_bucket: str,
    requests_topic: str,
    webhook_settings: WebhookSettings | None = None,
    endpoints: EndpointStore | None = None,
    usage: UsageSource | None = None,
    token_limits: Mapping[str, int] | None = None,
    storage_limits: Mapping[str, int] | None = None,
    retention: RetentionSettings | None = None,
    retention_index: RetentionIndex | None = None,
    clock: Callable[[], float] = time.time,
    monotonic: Callable[[], float] = time.monotonic,
) -> Services:
    """Wire the services from their ports (real ones in :mod:`llmbatch.api.__main__`, fakes in tests).
    Without ``retention_index`` nothing expires and nothing is collected."""
    records = RecordStore(objects, Layout(input_bucket))
    retention = retention or RetentionSettings()
    expiry = Expiry(retention_index, retention, clock=clock)
    reader = BatchReader(
        records,
        state,
        objects,
        results_bucket=results_bucket,
        fallback_after_s=options.state_fallback_after_s,
        clock=clock,
    )
    files = FileService(
        objects,
        records,
        reader,
        max_upload_bytes=options.max_upload_bytes,
        max_file_requests=options.max_file_requests,
        storage_limits=storage_limits,
        expiry=expiry,
        clock=clock,
    )
    collector = None
    if retention_index is not None:
        collector = Collector.over(
            retention_index,
            objects,
            state,
            input_bucket=input_bucket,
            results_bucket=results_bucket,
            settings=retention,
            fallback_after_s=options.state_fallback_after_s,
            clock=clock,
        )
    return Services(
        files=files,
        batches=BatchService(
            reader,
            records.layout,
            publisher,
            requests_topic=requests_topic,
            source=options.source,
            default_window=options.default_completion_window,
            priority=options.priority,
            republish_after_s=options.republish_after_s,
            max_active=options.max_active_batches,
            token_limits=token_limits,
            storage_limits=storage_limits,
            expiry=expiry,
            clock=clock,
        ),
        auth=Authenticator(options.keys),
        limiter=RateLimiter(options.rate_per_s, options.rate_burst, clock=monotonic),
        max_upload_bytes=options.max_upload_bytes,
        max_json_bytes=options.max_json_bytes,
        webhooks=WebhookService(endpoints, webhook_settings or WebhookSettings(), clock=clock),
        usage=UsageService(usage, objects, (input_bucket, results_bucket), clock=clock),
        collector=collector,
        collect_every_s=retention.collect_every_s,
    )


class BodyLimit:
    """Refuses bodies over the limit (413): at once by ``Content-Length``, else while they stream in.
    ``POST /v1/files`` may carry an upload; every other body is JSON."""

    def __init__(self, app: ASGIApp, *, upload_bytes: int, json_bytes: int) -> None:
        self.app = app
        self.upload_bytes = upload_bytes + MULTIPART_SLACK
        self.json_bytes = json_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.upload_bytes if scope["path"] == "/v1/files" else self.json_bytes
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _answer(PayloadTooLarge(f"the request body is over {limit} bytes"))(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # an HTTPException passes through FastAPI's body reading as is
                    raise HTTPException(413, f"the request body is over {limit} bytes")
            return message

        await self.app(scope, limited, send)


def _expires_after(anchor: object, seconds: object) -> ExpiresAfter | None:
    """OpenAI's ``expires_after`` of an upload, from its two form fields (both or neither)."""
    if anchor is None and seconds is None:
        return None
    if not isinstance(anchor, str) or not isinstance(seconds, str):
        raise InvalidRequest(
            "expires_after needs both expires_after[anchor] ('created_at') and expires_after[seconds]",
            param="expires_after",
        )
    text = seconds.strip()
    if not re.fullmatch(r"[0-9]{1,12}", text):
        raise InvalidRequest(
            f"expires_after[seconds] must be a whole number of seconds, {MIN_EXPIRES_AFTER_S}-"
            f"{MAX_EXPIRES_AFTER_S} (got {seconds[:40]!r})",
            param="expires_after.seconds",
        )
    try:
        return ExpiresAfter.model_validate({"anchor": anchor, "seconds": int(text)})
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"]) or "anchor"
        raise InvalidRequest(
            f"expires_after.{where}: {error['msg']} (anchor 'created_at', seconds {MIN_EXPIRES_AFTER_S}-"
            f"{MAX_EXPIRES_AFTER_S})",
            param=f"expires_after.{where}",
        ) from None


def _param_of(loc: Sequence[int | str]) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or None


def create_app(services: Services, *, on_close: Sequence[Callable[[], Awaitable[None]]] = ()) -> FastAPI:
    """The ASGI app over ``services``; ``on_close`` runs at shutdown (closing connections)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        collecting = None
        if services.collector is not None and services.collect_every_s > 0:
            collecting = asyncio.create_task(collect_forever(services.collector, services.collect_every_s))
        try:
            yield
        finally:
            if collecting is not None:
                collecting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await collecting
            for close in on_close:
                try:
                    await close()
                except Exception:
                    log.warning("error while closing a connection", exc_info=True)

    app = FastAPI(
        title="llmbatch OpenAI-compatible API", version="1", lifespan=lifespan, docs_url=None, redoc_url=None
    )
    app.add_middleware(BodyLimit, upload_bytes=services.max_upload_bytes, json_bytes=services.max_json_bytes)
    app.state.services = services
    _handlers(app)

    @app.get("/livez", include_in_schema=False)
    async def livez() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/files")
    async def create_file(request: Request, who: Tenant) -> FileObject:
        async with request.form(max_files=1, max_fields=8, max_part_size=64 << 10) as form:
            for name in form:
                if name not in FORM_FIELDS and name not in EXPIRES_FIELDS:
                    raise InvalidRequest(
                        f"unknown parameter {name[:40]!r}; send 'file', 'purpose' and optionally "
                        "'expires_after[anchor]' and 'expires_after[seconds]'",
                        param=name[:40],
                    )
            expires_after = _expires_after(
                form.get("expires_after[anchor]"), form.get("expires_after[seconds]")
            )
            purpose, upload = form.get("purpose"), form.get("file")
            if not isinstance(purpose, str) or not purpose:
                raise InvalidRequest("purpose is required: send purpose=batch", param="purpose")
            if not isinstance(upload, UploadFile):
                raise InvalidRequest(
                    "file is required: send the JSONL file as the multipart part 'file'", param="file"
                )
            return await services.files.upload(
                who,
                filename=upload.filename,
                purpose=purpose,
                source=upload.file,
                expires_after=expires_after,
            )

    @app.get("/v1/files")
    async def list_files(
        who: Tenant,
        after: str | None = None,
        limit: Annotated[int, Query()] = 10_000,
        order: str = "desc",
        purpose: str | None = None,
    ) -> ListPage[FileObject]:
        return await services.files.list(who, after=after, limit=limit, order=order, purpose=purpose)

    @app.get("/v1/files/{file_id}")
    async def get_file(file_id: str, who: Tenant) -> FileObject:
        return await services.files.get(who, file_id)

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str, who: Tenant) -> FileDeleted:
        return await services.files.delete(who, file_id)

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str, who: Tenant) -> Response:
        described, chunks = await services.files.content(who, file_id)
        headers = {"Content-Disposition": f'attachment; filename="{described.filename}"'}
        return StreamingResponse(chunks, media_type="application/octet-stream", headers=headers)

    @app.post("/v1/batches")
    async def create_batch(
        body: BatchCreate,
        who: Tenant,
        idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
    ) -> Batch:
        return await services.batches.create(who, body, idempotency_key=idempotency_key)

    @app.get("/v1/batches")
    async def list_batches(who: Tenant, after: str | None = None, limit: int = 20) -> ListPage[Batch]:
        return await services.batches.list(who, after=after, limit=limit)

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str, who: Tenant) -> Batch:
        return await services.batches.get(who, batch_id)

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str, who: Tenant) -> Batch:
        return await services.batches.cancel(who, batch_id)

    add_routes(app, services.webhooks)
    add_usage_routes(app, services.usage)

    return app


def _handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> Response:
        if exc.status == 503:  # an outage: one line, the cause's detail included
            log.warning("%s: %s (%s)", type(exc).__name__, exc.message, exc.__cause__)
        elif exc.status >= 500:
            log.error("%s: %s", type(exc).__name__, exc.message, exc_info=exc.__cause__ or exc)
        return _answer(exc)

    async def backend_error(_: Request, exc: Exception) -> Response:
        error = from_exception(exc)
        log.warning("%s answered %d: %s", type(exc).__name__, error.status, exc)  # the detail stays here
        return _answer(error)

    # errors of the reused code (object storage, Kafka, Redis), wherever a service let them through
    app.add_exception_handler(ProducerError, backend_error)
    app.add_exception_handler(DispatcherError, backend_error)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = _param_of(first.get("loc", ()))
        message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        if first.get("type") == "json_invalid":
            param, message = None, "the body is not valid JSON"
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        return _answer(InvalidRequest(f"{param + ': ' if param else ''}{message}{more}", param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        error: ApiError
        if exc.status_code == 404:
            error = ApiError(f"Unknown request URL: {request.method} {request.url.path}", status=404)
        elif exc.status_code == 413:
            error = PayloadTooLarge(str(exc.detail))
        else:
            error = ApiError(str(exc.detail), status=exc.status_code)
        return _answer(error, exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> Response:
        log.exception("unexpected error")
        return _answer(InternalError(f"unexpected {type(exc).__name__}; the server log says more"))


def _answer(error: ApiError, headers: Mapping[str, str] | None = None) -> Response:
    """OpenAI's error body (orjson) with the error's status and headers."""
    return Response(
        orjson.dumps(error.body()),
        status_code=error.status,
        media_type="application/json",
        headers={**error.headers, **(headers or {})},
    )
