"""The webhooks' Redis: the tenants' endpoints and the durable delivery queue.

Keys: :class:`~llmbatch.dispatcher.domain.keys.Keys` (``<p>:webhook:*``); scripts: ``webhook_*.lua``.
A delivery is queued once per (endpoint, event) by :meth:`WebhookStore.enqueue`, claimed for one
attempt at a time by any number of deliverers (:meth:`claim`, a lease), and settled by the one that
holds the claim (:meth:`settle`): delivered, retried later, dead, or dropped with its endpoint. What
Redis holds is hostile: a record that does not read back is skipped and logged, never raised.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, cast

from pydantic import ValidationError

from llmbatch.dispatcher.domain.keys import Keys
from llmbatch.dispatcher.state.lua import load
from llmbatch.dispatcher.state.store_indexes import reply_text
from llmbatch.schemas.webhooks import WebhookEndpoint

if TYPE_CHECKING:
    from redis.asyncio import Redis

log = logging.getLogger(__name__)
Outcome = Literal["delivered", "retry", "dead", "dropped"]
DONE_TTL_S = 8 * 86400  # longer than the results topic is read back after a restart (7 days)


def delivery_id(tenant: str, endpoint_id: str, event_id: str) -> str:
    """One delivery's id: the same event to the same endpoint is one delivery."""
    digest = hashlib.sha256(f"{tenant}\x00{endpoint_id}\x00{event_id}".encode()).hexdigest()
    return f"whd_{digest[:32]}"


@dataclass(frozen=True, slots=True)
class Delivery:
    """One event for one endpoint."""

    tenant: str
    endpoint: str
    event_id: str
    type: str
    created_at: int
    batch_id: str
    attempts: int = 0

    @property
    def id(self) -> str:
        return delivery_id(self.tenant, self.endpoint, self.event_id)

    @classmethod
    def from_hash(cls, fields: dict[str, str]) -> Delivery | None:
        try:
            return cls(
                tenant=fields["tenant"],
                endpoint=fields["endpoint"],
                event_id=fields["event_id"],
                type=fields["type"],
                created_at=int(fields["created_at"]),
                batch_id=fields["batch_id"],
                attempts=int(fields.get("attempts") or 0),
            )
        except (KeyError, ValueError):
            return None


class WebhookStore:
    """The endpoints and the delivery queue of one key prefix."""

    def __init__(self, client: Redis, keys: Keys) -> None:
        self.client = client
        self.keys = keys
        self._enqueue = client.register_script(load("webhook_enqueue"))
        self._claim = client.register_script(load("webhook_claim"))
        self._settle = client.register_script(load("webhook_settle"))

    # -- endpoints -------------------------------------------------------------------------------
    async def endpoints(self, tenant: str) -> list[WebhookEndpoint]:
        """The tenant's endpoints, oldest first (one that does not read back is skipped)."""
        raw: dict[bytes | str, bytes | str] = await self.client.hgetall(self.keys.webhook_endpoints(tenant))
        found = [e for k, v in raw.items() if (e := _endpoint(tenant, k, v)) is not None]
        return sorted(found, key=lambda e: (e.created_at, e.id))

    async def endpoint(self, tenant: str, endpoint_id: str) -> WebhookEndpoint | None:
        raw = await self.client.hget(self.keys.webhook_endpoints(tenant), endpoint_id)
        return None if raw is None else _endpoint(tenant, endpoint_id.encode(), raw)

    async def count(self, tenant: str) -> int:
        return int(await self.client.hlen(self.keys.webhook_endpoints(tenant)))

    async def put_endpoint(self, endpoint: WebhookEndpoint) -> None:
        key = self.keys.webhook_endpoints(endpoint.tenant)
        await self.client.hset(key, endpoint.id, endpoint.model_dump_json())

    async def delete_endpoint(self, tenant: str, endpoint_id: str) -> bool:
        return bool(await self.client.hdel(self.keys.webhook_endpoints(tenant), endpoint_id))

    # -- deliveries ------------------------------------------------------------------------------
    async def enqueue(self, deliveries: Sequence[Delivery], now_ms: int) -> int:
        """Queue each delivery once (due now); returns how many were new."""
        if not deliveries:
            return 0
        keys: list[str] = [self.keys.webhook_due]
        args: list[str | int] = [now_ms]
        for d in deliveries:
            keys += [self.keys.webhook_delivery(d.id), self.keys.webhook_done(d.id)]
            args += [d.id, d.tenant, d.endpoint, d.event_id, d.type, d.created_at, d.batch_id]
        return int(await self._enqueue(keys=keys, args=args))

    async def claim(self, now_ms: int, lease_ms: int, limit: int) -> list[tuple[Delivery | None, str, int]]:
        """Up to ``limit`` due deliveries, each ``(delivery, id, claim token)`` (None: its hash is gone
        or garbled; settle it as dropped)."""
        flat = await self._claim(keys=[self.keys.webhook_due], args=[now_ms, lease_ms, limit])
        pairs = [(reply_text(flat[i]), int(flat[i + 1])) for i in range(0, len(flat), 2)]
        if not pairs:
            return []
        async with self.client.pipeline(transaction=False) as pipe:
            for did, _ in pairs:
                pipe.hgetall(self.keys.webhook_delivery(did))
            hashes = await pipe.execute()
        return [
            (Delivery.from_hash({reply_text(k): reply_text(v) for k, v in h.items()}), did, token)
            for (did, token), h in zip(pairs, hashes, strict=True)
        ]

    async def settle(
        self,
        delivery: str,
        token: int,
        outcome: Outcome,
        *,
        now_ms: int,
        next_ms: int = 0,
        status: int | None = None,
        error: str = "",
        dead_ttl_s: int = 7 * 86400,
    ) -> bool:
        """Record the claimed attempt's end; False when the claim was lost (nothing recorded)."""
        keys = [
            self.keys.webhook_due,
            self.keys.webhook_dead,
            self.keys.webhook_delivery(delivery),
            self.keys.webhook_done(delivery),
        ]
        status_text = "" if status is None else str(status)
        args: list[str | int] = [
            delivery,
            token,
            outcome,
            now_ms,
            next_ms,
            status_text,
            error[:500],
            DONE_TTL_S,
            dead_ttl_s,
        ]
        return bool(await self._settle(keys=keys, args=args))

    async def dead(self, limit: int = 100) -> list[dict[str, str]]:
        """The newest dead deliveries (their hashes), newest first."""
        ids = cast("list[bytes | str]", await self.client.zrevrange(self.keys.webhook_dead, 0, limit - 1))
        async with self.client.pipeline(transaction=False) as pipe:
            for did in ids:
                pipe.hgetall(self.keys.webhook_delivery(reply_text(did)))
            hashes = await pipe.execute()
        return [{reply_text(k): reply_text(v) for k, v in h.items()} for h in hashes if h]

    async def depth(self) -> int:
        """Deliveries waiting (due now or later, claimed included)."""
        return int(await self.client.zcard(self.keys.webhook_due))


def _endpoint(tenant: str, key: bytes | str, raw: bytes | str) -> WebhookEndpoint | None:
    try:
        endpoint = WebhookEndpoint.model_validate_json(raw)
    except ValidationError as exc:
        log.warning(
            "webhook endpoint %r of %s does not read back: %s", reply_text(key)[:64], tenant, exc.errors()[:1]
        )
        return None
    if endpoint.tenant != tenant or endpoint.id != reply_text(key):
        log.warning("webhook endpoint %r of %s names another tenant or id", reply_text(key)[:64], tenant)
        return None
    return endpoint
