"""``/v1/webhook_endpoints``: a tenant's webhook endpoints, as OpenAI's API has them (the ``openai``
SDK's ``client.webhooks.create / retrieve / update / list / delete / rotate_secret`` work unchanged).

An endpoint receives the tenant's batch events, whichever way the batch came in (Kafka or this API),
signed as Standard Webhooks (:mod:`llmbatch.schemas.webhooks`); the dispatcher delivers
(:mod:`llmbatch.dispatcher.webhooks`). The secret is in the answer of a create and a rotation only.
Off (404 naming the setting) until ``LLMBATCH_WEBHOOKS__SIGNING_KEY`` is set.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Annotated, Literal, Protocol

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from llmbatch.api.errors import ApiError, Conflict, InvalidRequest, NotFound, from_exception
from llmbatch.api.objects import ListPage
from llmbatch.api.tenancy.caller import Tenant
from llmbatch.dispatcher.errors import StateStoreUnavailable, classify
from llmbatch.dispatcher.webhooks import targets
from llmbatch.dispatcher.webhooks.sender import HttpSender, Sender
from llmbatch.schemas.webhooks import (
    ENDPOINT_ID,
    MAX_URL_LENGTH,
    WebhookEndpoint,
    WebhookType,
    endpoint_secret,
    secret_hint,
    signed_attempt,
)
from llmbatch.settings.webhooks import IpNetwork, WebhookSettings


class EndpointStore(Protocol):
    """What the API keeps endpoints in (:class:`~llmbatch.dispatcher.webhooks.store.WebhookStore`)."""

    async def endpoints(self, tenant: str) -> list[WebhookEndpoint]: ...

    async def endpoint(self, tenant: str, endpoint_id: str) -> WebhookEndpoint | None: ...

    async def count(self, tenant: str) -> int: ...

    async def put_endpoint(self, endpoint: WebhookEndpoint) -> None: ...

    async def delete_endpoint(self, tenant: str, endpoint_id: str) -> bool: ...


class WebhookCreate(BaseModel):
    """Body of ``POST /v1/webhook_endpoints`` (OpenAI's)."""

    model_config = ConfigDict(extra="forbid")

    url: Annotated[str, Field(min_length=1, max_length=MAX_URL_LENGTH)]
    event_types: list[WebhookType] = Field(min_length=1)
    name: Annotated[str, Field(max_length=512)] = ""


class WebhookUpdate(BaseModel):
    """Body of ``POST /v1/webhook_endpoints/{id}``: what changes."""

    model_config = ConfigDict(extra="forbid")

    url: Annotated[str, Field(min_length=1, max_length=MAX_URL_LENGTH)] | None = None
    event_types: list[WebhookType] | None = Field(default=None, min_length=1)
    name: Annotated[str, Field(max_length=512)] | None = None


class WebhookRotate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keep_old_secret_active_for_24_hours: bool = False


class WebhookObject(BaseModel):
    """An endpoint as OpenAI shows one (``signing_secret`` only after a create or a rotation)."""

    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    url: str
    event_types: list[str]
    name: str
    created_at: int
    updated_at: int
    signing_secret_hint: str
    signing_secret: str | None = None

    @classmethod
    def of(cls, endpoint: WebhookEndpoint, secret: str, *, shown: bool = False) -> WebhookObject:
        return cls(
            id=endpoint.id,
            url=endpoint.url,
            event_types=list(endpoint.events),
            name=endpoint.name,
            created_at=endpoint.created_at,
            updated_at=endpoint.updated_at or endpoint.created_at,
            signing_secret_hint=secret_hint(secret),
            signing_secret=secret if shown else None,
        )


class WebhookTest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    event_type: WebhookType


class WebhookTestResult(BaseModel):
    object: Literal["webhook_endpoint.test"] = "webhook_endpoint.test"
    webhook_endpoint_id: str
    event_type: str
    status_code: int
    success: Literal[True] = True


class WebhookDeleted(BaseModel):
    id: str
    object: Literal["webhook_endpoint.deleted"] = "webhook_endpoint.deleted"
    deleted: bool = True


KEEP_OLD_S = 86400
Resolver = Callable[[targets.Target, Sequence[IpNetwork]], Awaitable[targets.IpAddress]]


class WebhookService:
    """The endpoints of each tenant."""

    def __init__(
        self,
        store: EndpointStore | None,
        settings: WebhookSettings,
        *,
        resolve: Resolver = targets.resolve,
        sender: Sender | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.sender: Sender = sender or HttpSender(workers=2)
        self.store = store
        self.settings = settings
        self.resolve = resolve
        self.clock = clock

    def _on(self) -> EndpointStore:
        if self.store is None or not self.settings.enabled:
            raise NotFound(
                "webhooks are off on this deployment: its operator sets LLMBATCH_WEBHOOKS__SIGNING_KEY "
                "(on the API and the dispatcher) to turn them on",
                code="webhooks_off",
            )
        return self.store

    async def create(self, tenant: str, body: WebhookCreate) -> WebhookObject:
        store = self._on()
        await self._check_target(body.url)
        try:
            if await store.count(tenant) >= self.settings.max_endpoints:
                raise Conflict(
                    f"a tenant may have {self.settings.max_endpoints} webhook endpoints: delete one first",
                    code="too_many_endpoints",
                )
            now = int(self.clock())
            endpoint = WebhookEndpoint(
                id=f"whep_{secrets.token_hex(12)}",
                tenant=tenant,
                url=body.url,
                events=tuple(dict.fromkeys(body.event_types)),
                created_at=now,
                updated_at=now,
                name=body.name,
            )
            await store.put_endpoint(endpoint)
        except Conflict:
            raise
        except Exception as exc:
            raise _backend(exc) from exc
        return self._shown(endpoint, with_secret=True)

    async def list(self, tenant: str, *, after: str | None, limit: int) -> ListPage[WebhookObject]:
        """Oldest first; ``after`` an id of an earlier page."""
        store = self._on()
        if not 1 <= limit <= 100:
            raise InvalidRequest(f"limit must be between 1 and 100 (got {limit})", param="limit")
        try:
            found = await store.endpoints(tenant)
        except Exception as exc:
            raise _backend(exc) from exc
        ids = [e.id for e in found]
        if after is not None:
            if after not in ids:
                message = f"after must be an endpoint id of an earlier page (got {after[:64]!r})"
                raise InvalidRequest(message, param="after")
            found = found[ids.index(after) + 1 :]
        page = found[:limit]
        return ListPage[WebhookObject].of(
            [self._shown(e) for e in page], has_more=len(found) > limit, ids=[e.id for e in page]
        )

    async def get(self, tenant: str, endpoint_id: str) -> WebhookObject:
        return self._shown(await self._find(tenant, endpoint_id))

    async def update(self, tenant: str, endpoint_id: str, body: WebhookUpdate) -> WebhookObject:
        store = self._on()
        endpoint = await self._find(tenant, endpoint_id)
        changes: dict[str, object] = {}
        if body.url is not None and body.url != endpoint.url:
            await self._check_target(body.url)
            changes["url"] = body.url
        if body.event_types is not None and tuple(dict.fromkeys(body.event_types)) != endpoint.events:
            changes["events"] = tuple(dict.fromkeys(body.event_types))
        if body.name is not None and body.name != endpoint.name:
            changes["name"] = body.name
        if not changes:  # an unchanged update does not advance updated_at (as OpenAI's)
            return self._shown(endpoint)
        changed = endpoint.model_copy(update={**changes, "updated_at": int(self.clock())})
        try:
            await store.put_endpoint(changed)
        except Exception as exc:
            raise _backend(exc) from exc
        return self._shown(changed)

    async def delete(self, tenant: str, endpoint_id: str) -> WebhookDeleted:
        store = self._on()
        await self._find(tenant, endpoint_id)
        try:
            await store.delete_endpoint(tenant, endpoint_id)
        except Exception as exc:
            raise _backend(exc) from exc
        return WebhookDeleted(id=endpoint_id)

    async def rotate(self, tenant: str, endpoint_id: str, body: WebhookRotate) -> WebhookObject:
        """A new secret; the old one signs nothing from now on, or (``keep_old_secret_active_for_24_hours``)
        signs beside the new one for 24 hours."""
        store = self._on()
        endpoint = await self._find(tenant, endpoint_id)
        now = int(self.clock())
        keep_until = now + KEEP_OLD_S if body.keep_old_secret_active_for_24_hours else 0
        rotated = endpoint.model_copy(
            update={
                "secret_version": endpoint.secret_version + 1,
                "previous_secret_until": keep_until,
                "updated_at": now,
            }
        )
        try:
            await store.put_endpoint(rotated)
        except Exception as exc:
            raise _backend(exc) from exc
        return self._shown(rotated, with_secret=True)

    async def _find(self, tenant: str, endpoint_id: str) -> WebhookEndpoint:
        store = self._on()
        if not ENDPOINT_ID.fullmatch(endpoint_id):
            raise NotFound(f"no webhook endpoint {endpoint_id[:64]!r}: ids look like whep_<24 hex digits>")
        try:
            endpoint = await store.endpoint(tenant, endpoint_id)
        except Exception as exc:
            raise _backend(exc) from exc
        if endpoint is None:
            raise NotFound(f"no webhook endpoint {endpoint_id}")
        return endpoint

    async def _check_target(self, url: str) -> tuple[targets.Target, targets.IpAddress]:
        """``url``'s target and the address to connect to, or a 400 naming why it may not be one."""
        try:
            target = targets.check_url(url, allow_http=self.settings.allow_http)
            return target, await self.resolve(target, self.settings.networks())
        except (targets.TargetRefused, targets.TargetUnresolved) as exc:
            raise InvalidRequest(f"url: {exc}", param="url", code=exc.code) from exc

    async def test(self, tenant: str, endpoint_id: str, body: WebhookTest) -> WebhookTestResult:
        """One signed test delivery now (a batch id of ``batch_test``), answered with the endpoint's
        status; an endpoint that does not answer is a 400 naming why (nothing is queued or retried)."""
        endpoint = await self._find(tenant, endpoint_id)
        target, address = await self._check_target(endpoint.url)
        now = int(self.clock())
        event_id = f"evt_test_{secrets.token_hex(12)}"
        sent, body_bytes = signed_attempt(
            self.settings.key_bytes(), endpoint, event_id, body.event_type, now, "batch_test", now
        )
        attempt = await self.sender.send(target, address, sent, body_bytes, self.settings.timeout_s)
        if attempt.status is None:
            raise InvalidRequest(
                f"the endpoint did not answer: {attempt.error}", param="url", code="webhook_test_failed"
            )
        return WebhookTestResult(
            webhook_endpoint_id=endpoint.id, event_type=body.event_type, status_code=attempt.status
        )

    def _shown(self, endpoint: WebhookEndpoint, *, with_secret: bool = False) -> WebhookObject:
        secret = endpoint_secret(self.settings.key_bytes(), endpoint.id, endpoint.secret_version)
        return WebhookObject.of(endpoint, secret, shown=with_secret)


def _backend(exc: Exception) -> ApiError:
    return from_exception(classify(exc, default=StateStoreUnavailable))


def add_routes(app: FastAPI, service: WebhookService) -> None:
    """The ``/v1/webhook_endpoints`` routes (OpenAI's paths)."""

    @app.post("/v1/webhook_endpoints", response_model_exclude_none=True)
    async def create_webhook(body: WebhookCreate, who: Tenant) -> WebhookObject:
        return await service.create(who, body)

    @app.get("/v1/webhook_endpoints", response_model_exclude_none=True)
    async def list_webhooks(
        who: Tenant, after: str | None = None, limit: int = 20
    ) -> ListPage[WebhookObject]:
        return await service.list(who, after=after, limit=limit)

    @app.get("/v1/webhook_endpoints/{endpoint_id}", response_model_exclude_none=True)
    async def get_webhook(endpoint_id: str, who: Tenant) -> WebhookObject:
        return await service.get(who, endpoint_id)

    @app.post("/v1/webhook_endpoints/{endpoint_id}", response_model_exclude_none=True)
    async def update_webhook(endpoint_id: str, body: WebhookUpdate, who: Tenant) -> WebhookObject:
        return await service.update(who, endpoint_id, body)

    @app.delete("/v1/webhook_endpoints/{endpoint_id}", response_model_exclude_none=True)
    async def delete_webhook(endpoint_id: str, who: Tenant) -> WebhookDeleted:
        return await service.delete(who, endpoint_id)

    @app.post("/v1/webhook_endpoints/{endpoint_id}/test", response_model_exclude_none=True)
    async def test_webhook(endpoint_id: str, body: WebhookTest, who: Tenant) -> WebhookTestResult:
        return await service.test(who, endpoint_id, body)

    @app.post("/v1/webhook_endpoints/{endpoint_id}/rotate_secret", response_model_exclude_none=True)
    async def rotate_webhook(
        endpoint_id: str, who: Tenant, body: WebhookRotate | None = None
    ) -> WebhookObject:
        return await service.rotate(who, endpoint_id, body or WebhookRotate())
