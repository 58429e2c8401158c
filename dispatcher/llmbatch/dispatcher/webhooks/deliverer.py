"""The deliverer: claims due deliveries and makes one signed attempt each.

Any number of dispatcher replicas run one; a claim (:meth:`WebhookStore.claim`) keeps two from trying
the same delivery at once, and a replica that dies mid-attempt loses its claim after
``LLMBATCH_WEBHOOKS__LEASE_S``. A 2xx answer delivers; anything else (another status, no answer, a
refused or unresolved address) is retried after ``retry_s[n]`` and dead after the last wait. An
endpoint's failing and its recovery are each logged once (per replica).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Protocol

from llmbatch.dispatcher.errors import DispatcherError
from llmbatch.dispatcher.webhooks import targets
from llmbatch.dispatcher.webhooks.sender import Attempt, Sender
from llmbatch.dispatcher.webhooks.store import Delivery, Outcome, WebhookStore
from llmbatch.schemas import webhooks
from llmbatch.settings.webhooks import WebhookSettings

log = logging.getLogger(__name__)
IDLE_POLL_S = 1.0
MAX_FAILING_REMEMBERED = 10_000  # endpoints whose failing this replica logged (bounded memory)


class DeliveryCounter(Protocol):
    def webhook_delivery(self, outcome: str) -> None: ...


class Deliverer:
    """Claims and attempts deliveries until stopped (:meth:`run`)."""

    def __init__(
        self,
        store: WebhookStore,
        settings: WebhookSettings,
        sender: Sender,
        *,
        counter: DeliveryCounter | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.settings = settings
        self.sender = sender
        self.counter = counter
        self.clock = clock
        self.wake = asyncio.Event()
        self._key = settings.key_bytes()
        self._networks = settings.networks()
        self._failing: dict[str, str] = {}  # endpoint id -> what failed (logged once)
        self._down = False

    async def run(self) -> None:
        while True:
            try:
                done = await self.tick()
                if self._down:
                    self._down = False
                    log.info("webhook deliveries go on: Redis answers again")
            except DispatcherError as exc:
                self._outage(exc)
                done = 0
            except Exception as exc:
                self._outage(exc)
                done = 0
            if done == 0:
                self.wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), IDLE_POLL_S)

    def _outage(self, exc: BaseException) -> None:
        if not self._down:
            self._down = True
            log.warning("webhook deliveries wait: %s: %s", type(exc).__name__, exc)

    async def tick(self) -> int:
        """Claim what is due (up to ``concurrency``) and attempt it all; returns how many."""
        now_ms = int(self.clock() * 1000)
        lease_ms = int(self.settings.lease_s * 1000)
        claimed = await self.store.claim(now_ms, lease_ms, self.settings.concurrency)
        await asyncio.gather(*(self._one(d, did, token) for d, did, token in claimed))
        return len(claimed)

    async def _one(self, delivery: Delivery | None, did: str, token: int) -> None:
        endpoint = None if delivery is None else await self.store.endpoint(delivery.tenant, delivery.endpoint)
        if delivery is None or endpoint is None:  # garbled, or its endpoint was deleted
            await self._settle(did, token, "dropped")
            return
        attempt = await self._attempt(delivery, endpoint)
        if attempt.ok:
            await self._settle(did, token, "delivered", status=attempt.status)
            if self._failing.pop(endpoint.id, None) is not None:
                log.info("webhook endpoint %s of %s delivers again", endpoint.id, endpoint.tenant)
            return
        if endpoint.id not in self._failing and len(self._failing) < MAX_FAILING_REMEMBERED:
            self._failing[endpoint.id] = attempt.describe()
            log.warning(
                "webhook endpoint %s of %s fails: %s (retried on its schedule)",
                endpoint.id,
                endpoint.tenant,
                attempt.describe(),
            )
        waits = self.settings.retry_s
        if delivery.attempts < len(waits):
            next_ms = int((self.clock() + waits[delivery.attempts]) * 1000)
            await self._settle(did, token, "retry", next_ms=next_ms, attempt=attempt)
        else:
            await self._settle(did, token, "dead", attempt=attempt)
            log.warning(
                "webhook delivery %s of event %s to endpoint %s of %s is dead after %d attempts: %s",
                did,
                delivery.event_id,
                endpoint.id,
                endpoint.tenant,
                delivery.attempts + 1,
                attempt.describe(),
            )

    async def _attempt(self, delivery: Delivery, endpoint: webhooks.WebhookEndpoint) -> Attempt:
        try:
            target = targets.check_url(endpoint.url, allow_http=self.settings.allow_http)
            address = await targets.resolve(target, self._networks)
        except (targets.TargetRefused, targets.TargetUnresolved) as exc:
            return Attempt(None, str(exc))
        sent, body = webhooks.signed_attempt(
            self._key,
            endpoint,
            delivery.event_id,
            delivery.type,
            delivery.created_at,
            delivery.batch_id,
            self.clock(),
        )
        return await self.sender.send(target, address, sent, body, self.settings.timeout_s)

    async def _settle(
        self,
        did: str,
        token: int,
        outcome: Outcome,
        *,
        next_ms: int = 0,
        status: int | None = None,
        attempt: Attempt | None = None,
    ) -> None:
        applied = await self.store.settle(
            did,
            token,
            outcome,
            now_ms=int(self.clock() * 1000),
            next_ms=next_ms,
            status=attempt.status if attempt is not None else status,
            error=attempt.error if attempt is not None else "",
            dead_ttl_s=self.settings.dead_ttl_s,
        )
        if applied and self.counter is not None:
            self.counter.webhook_delivery("retried" if outcome == "retry" else outcome)
