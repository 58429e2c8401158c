"""Webhooks: a tenant's endpoints, the events they receive, and how a delivery is signed.

Deliveries follow the Standard Webhooks convention (https://www.standardwebhooks.com), as OpenAI's
batch webhooks do, so their verifiers work unchanged (the ``openai`` SDK's ``client.webhooks.unwrap``,
the ``standardwebhooks`` library):

- headers ``webhook-id`` (the Kafka event's id: a receiver dedupes by it), ``webhook-timestamp``
  (unix seconds of the attempt) and ``webhook-signature`` (``v1,<base64 HMAC-SHA256>`` of
  ``<id>.<timestamp>.<body>`` under the endpoint's secret);
- the body is OpenAI's event object: ``{"id", "object": "event", "created_at", "type", "data": {"id":
  <batch id>}}`` with ``type`` one of :data:`WEBHOOK_TYPES`.

An endpoint's secret (``whsec_<base64 of 32 bytes>``) is derived from the deployment's signing key, the
endpoint's id and its secret version (:func:`endpoint_secret`): nothing secret is stored, and rotating
bumps the version. Pure: no I/O.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
from typing import Annotated, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field

from llmbatch.schemas.common import Tenant
from llmbatch.schemas.events import EventType

WEBHOOK_TYPES: dict[EventType, str] = {
    EventType.COMPLETED: "batch.completed",
    EventType.FAILED: "batch.failed",
    EventType.CANCELLED: "batch.cancelled",
    EventType.EXPIRED: "batch.expired",
    EventType.ACCEPTED: "batch.accepted",  # ours: OpenAI sends terminal states only
}
"""The Kafka event types a webhook can carry -> the ``type`` of its delivery."""
WebhookType = Literal["batch.completed", "batch.failed", "batch.cancelled", "batch.expired", "batch.accepted"]
TERMINAL_WEBHOOK_TYPES: tuple[WebhookType, ...] = (
    "batch.completed",
    "batch.failed",
    "batch.cancelled",
    "batch.expired",
)
"""What an endpoint receives when it names no events (OpenAI's batch webhook events)."""
ENDPOINT_ID = re.compile(r"whep_[0-9a-f]{24}")
SECRET_PREFIX = "whsec_"  # noqa: S105 (the prefix of every secret, not one)
MAX_URL_LENGTH = 2048


class WebhookEndpoint(BaseModel):
    """A tenant's webhook endpoint as stored (no secret: see :func:`endpoint_secret`)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: Annotated[str, Field(pattern=ENDPOINT_ID.pattern)]
    tenant: Tenant
    url: Annotated[str, Field(min_length=1, max_length=MAX_URL_LENGTH)]
    events: tuple[WebhookType, ...] = TERMINAL_WEBHOOK_TYPES
    created_at: int = Field(ge=0, description="Unix seconds.")
    updated_at: int = Field(default=0, ge=0, description="Unix seconds of the last change (0: never).")
    secret_version: int = Field(default=1, ge=1)
    previous_secret_until: int = Field(
        default=0, ge=0, description="Unix seconds until which the version before signs too (a rotation)."
    )
    name: Annotated[str, Field(max_length=512)] = ""

    def secret_versions(self, now: float) -> tuple[int, ...]:
        """The secret versions a delivery at ``now`` is signed with (the previous one too for 24 hours
        after a rotation that asked to keep it)."""
        if now < self.previous_secret_until and self.secret_version > 1:
            return (self.secret_version, self.secret_version - 1)
        return (self.secret_version,)


def endpoint_secret(signing_key: bytes, endpoint_id: str, version: int) -> str:
    """The endpoint's secret, ``whsec_`` and the base64 of 32 bytes, as Standard Webhooks writes one."""
    raw = hmac.new(signing_key, f"llmbatch-webhook:{endpoint_id}:{version}".encode(), hashlib.sha256)
    return SECRET_PREFIX + base64.b64encode(raw.digest()).decode()


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """One ``v1,<base64 HMAC-SHA256>`` signature of an attempt."""
    key = base64.b64decode(secret.removeprefix(SECRET_PREFIX))
    signed = f"{msg_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


def secret_hint(secret: str) -> str:
    """What an endpoint shows of its secret (OpenAI's ``signing_secret_hint``)."""
    return f"{SECRET_PREFIX}...{secret[-4:]}"


def event_body(event_id: str, webhook_type: str, created_at: int, batch_id: str) -> bytes:
    """The delivery's body: OpenAI's webhook event object for a batch."""
    return orjson.dumps(
        {
            "id": event_id,
            "object": "event",
            "created_at": created_at,
            "type": webhook_type,
            "data": {"id": batch_id},
        }
    )


def headers(secret: str | tuple[str, ...], msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """Every header of one attempt but the transport's own; several secrets sign it each (during a
    rotation: Standard Webhooks' space-separated signatures, any of which verifies)."""
    secrets = (secret,) if isinstance(secret, str) else secret
    return {
        "content-type": "application/json",
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": " ".join(sign(s, msg_id, timestamp, body) for s in secrets),
        "user-agent": "llmbatch-webhooks/1",
    }


def signed_attempt(
    signing_key: bytes,
    endpoint: WebhookEndpoint,
    event_id: str,
    webhook_type: str,
    created_at: int,
    batch_id: str,
    now: float,
) -> tuple[dict[str, str], bytes]:
    """The headers and body of one attempt to ``endpoint`` at ``now``, signed with each of its secrets
    in use then (:meth:`WebhookEndpoint.secret_versions`)."""
    secrets = tuple(endpoint_secret(signing_key, endpoint.id, v) for v in endpoint.secret_versions(now))
    body = event_body(event_id, webhook_type, created_at, batch_id)
    return headers(secrets, event_id, int(now), body), body
