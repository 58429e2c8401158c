"""Signed tenant claims: header ``llmbatch-tenant-sig`` on ``batch.requested`` and ``cancel_requested``.

A request names its tenant in its data; on its own that is only a claim any producer can make. A
producer that holds its tenant's key (``LLMBATCH_TENANTS__KEYS``, one entry per tenant it may act
for) adds the HMAC-SHA256, under that key, of the event's ``ce_type``, ``ce_source``, ``ce_id``, the
tenant and the SHA-256 of the record's value (the exact bytes on the topic). A dispatcher that holds
the tenants' keys dead-letters, as ``invalid_event`` naming this header, every request or cancel whose
signature is missing or does not verify under the key of the tenant it names, and answers it with a
``rejected`` event. So a producer can act only for the tenants whose keys it was given: the value is
covered, so neither the tenant, the batch id, the input nor any other field can be changed, and the
event's id and source are covered, so a signature copied onto another event does not verify. A
replayed dead letter keeps the original value and headers, so its signature still verifies.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from typing import Any

import orjson

from llmbatch.schemas.cloudevents import Envelope

TENANT_SIG = "llmbatch-tenant-sig"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def tenant_signature(
    key: bytes, *, event_type: str, source: str, event_id: str, tenant: str, value: bytes
) -> str:
    """The hex HMAC-SHA256 under ``key`` of the event's type, source, id, tenant and value."""
    message = orjson.dumps(
        ["llmbatch-tenant-v1", event_type, source, event_id, tenant, hashlib.sha256(value).hexdigest()]
    )
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def verify_tenant_signature(
    key: bytes,
    signature: str | None,
    *,
    event_type: str,
    source: str,
    event_id: str,
    tenant: str,
    value: bytes,
) -> bool:
    """Whether ``signature`` is the tenant signature of this event under ``key``."""
    if signature is None or not _HEX64.fullmatch(signature):
        return False
    expected = tenant_signature(
        key, event_type=event_type, source=source, event_id=event_id, tenant=tenant, value=value
    )
    return hmac.compare_digest(signature, expected)


class TenantSigner:
    """Signs the events of the tenants whose keys it holds (a producer's, or the HTTP API's)."""

    def __init__(self, keys: Mapping[str, bytes]) -> None:
        self._keys = dict(keys)

    def __bool__(self) -> bool:
        return bool(self._keys)

    def header(
        self, *, tenant: str | None, event_type: str, source: str, event_id: str, value: bytes
    ) -> tuple[str, bytes] | None:
        """The ``llmbatch-tenant-sig`` header for this event, or ``None`` when the event names no
        tenant or this signer has no key for it (a dispatcher holding tenant keys refuses it)."""
        if tenant is None or (key := self._keys.get(tenant)) is None:
            return None
        signature = tenant_signature(
            key, event_type=event_type, source=source, event_id=event_id, tenant=tenant, value=value
        )
        return TENANT_SIG, signature.encode()

    def sign(self, envelope: Envelope[Any], value: bytes) -> tuple[str, bytes] | None:
        """:meth:`header` for an encoded event (``value``: the record value :func:`encode` made)."""
        tenant = getattr(envelope.data, "tenant", None)
        return self.header(
            tenant=tenant if isinstance(tenant, str) else None,
            event_type=envelope.type.value,
            source=envelope.source,
            event_id=envelope.id,
            value=value,
        )
