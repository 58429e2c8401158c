"""``/v1/webhooks``: a tenant's webhook endpoints (create, list, get, delete, rotate the secret).

An endpoint receives the tenant's batch events, whichever way the batch came in (Kafka or this API),
signed as Standard Webhooks (:mod:`llmbatch.schemas.webhooks`); the dispatcher delivers
(:mod:`llmbatch.dispatcher.webhooks`). The secret is in the answer of a create and a rotate only.
Off (404 naming the setting) until ``LLMBATCH_WEBHOOKS__SIGNING_KEY`` is set.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Annotated, Literal, Protocol

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from llmbatch.api.caller import Tenant
from llmbatch.api.errors import ApiError, Conflict, InvalidRequest, NotFound, from_exception
from llmbatch.api.objects import ListPage
from llmbatch.dispatcher.errors import StateStoreUnavailable, classify
from llmbatch.dispatcher.webhooks import targets
from llmbatch.schemas.webhooks import (
    ENDPOINT_ID,
    MAX_URL_LENGTH,
    TERMINAL_WEBHOOK_TYPES,
    WebhookEndpoint,
    WebhookType,
    endpoint_secret,
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
    """Body of ``POST /v1/webhooks``."""

    model_config = ConfigDict(extra="forbid")

    url: Annotated[str, Field(min_length=1, max_length=MAX_URL_LENGTH)]
    events: list[WebhookType] = Field(default_factory=lambda: list(TERMINAL_WEBHOOK_TYPES), min_length=1)
    description: Annotated[str, Field(max_length=512)] = ""


class WebhookObject(BaseModel):
    """An endpoint as the API shows it (``secret`` only in a create's or a rotate's answer)."""

    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    url: str
    events: list[str]
    description: str
    created_at: int
    secret: str | None = None

    @classmethod
    def of(cls, endpoint: WebhookEndpoint, secret: str | None = None) -> WebhookObject:
        return cls(
            id=endpoint.id,
            url=endpoint.url,
            events=list(endpoint.events),
            description=endpoint.description,
            created_at=endpoint.created_at,
            secret=secret,
        )


class WebhookDeleted(BaseModel):
    id: str
    object: Literal["webhook_endpoint.deleted"] = "webhook_endpoint.deleted"
    deleted: bool = True


Resolver = Callable[[targets.Target, Sequence[IpNetwork]], Awaitable[object]]


class WebhookService:
    """The endpoints of each tenant."""

    def __init__(
        self,
        store: EndpointStore | None,
        settings: WebhookSettings,
        *,
        resolve: Resolver = targets.resolve,
        clock: Callable[[], float] = time.time,
    ) -> None:
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
            endpoint = WebhookEndpoint(
                id=f"whep_{secrets.token_hex(12)}",
                tenant=tenant,
                url=body.url,
                events=tuple(dict.fromkeys(body.events)),
                created_at=int(self.clock()),
                description=body.description,
            )
            await store.put_endpoint(endpoint)
        except Conflict:
            raise
        except Exception as exc:
            raise _backend(exc) from exc
        return WebhookObject.of(endpoint, self._secret(endpoint))

    async def list(self, tenant: str) -> ListPage[WebhookObject]:
        store = self._on()
        try:
            found = await store.endpoints(tenant)
        except Exception as exc:
            raise _backend(exc) from exc
        return ListPage[WebhookObject].of(
            [WebhookObject.of(e) for e in found], has_more=False, ids=[e.id for e in found]
        )

    async def get(self, tenant: str, endpoint_id: str) -> WebhookObject:
        return WebhookObject.of(await self._find(tenant, endpoint_id))

    async def delete(self, tenant: str, endpoint_id: str) -> WebhookDeleted:
        store = self._on()
        await self._find(tenant, endpoint_id)
        try:
            await store.delete_endpoint(tenant, endpoint_id)
        except Exception as exc:
            raise _backend(exc) from exc
        return WebhookDeleted(id=endpoint_id)

    async def rotate(self, tenant: str, endpoint_id: str) -> WebhookObject:
        """A new secret (the old one signs nothing from now on)."""
        store = self._on()
        endpoint = await self._find(tenant, endpoint_id)
        rotated = endpoint.model_copy(update={"secret_version": endpoint.secret_version + 1})
        try:
            await store.put_endpoint(rotated)
        except Exception as exc:
            raise _backend(exc) from exc
        return WebhookObject.of(rotated, self._secret(rotated))

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

    async def _check_target(self, url: str) -> None:
        try:
            target = targets.check_url(url, allow_http=self.settings.allow_http)
            await self.resolve(target, self.settings.networks())
        except (targets.TargetRefused, targets.TargetUnresolved) as exc:
            raise InvalidRequest(f"url: {exc}", param="url", code=exc.code) from exc

    def _secret(self, endpoint: WebhookEndpoint) -> str:
        return endpoint_secret(self.settings.key_bytes(), endpoint.id, endpoint.secret_version)


def _backend(exc: Exception) -> ApiError:
    return from_exception(classify(exc, default=StateStoreUnavailable))


def add_routes(app: FastAPI, service: WebhookService) -> None:
    """The ``/v1/webhooks`` routes."""

    @app.post("/v1/webhooks")
    async def create_webhook(body: WebhookCreate, who: Tenant) -> WebhookObject:
        return await service.create(who, body)

    @app.get("/v1/webhooks")
    async def list_webhooks(who: Tenant) -> ListPage[WebhookObject]:
        return await service.list(who)

    @app.get("/v1/webhooks/{endpoint_id}")
    async def get_webhook(endpoint_id: str, who: Tenant) -> WebhookObject:
        return await service.get(who, endpoint_id)

    @app.delete("/v1/webhooks/{endpoint_id}")
    async def delete_webhook(endpoint_id: str, who: Tenant) -> WebhookDeleted:
        return await service.delete(who, endpoint_id)

    @app.post("/v1/webhooks/{endpoint_id}/rotate")
    async def rotate_webhook(endpoint_id: str, who: Tenant) -> WebhookObject:
        return await service.rotate(who, endpoint_id)
