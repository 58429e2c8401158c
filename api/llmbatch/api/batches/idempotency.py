"""Idempotent creates: a ``POST /v1/batches`` with an ``Idempotency-Key`` header makes one batch, however
often it is sent (a client retrying after a lost answer, as the ``openai`` SDK does on timeouts and 5xx).

The first create claims the key with an S3 conditional write (``If-None-Match: *``, atomic: of two
concurrent creates one wins) of an :class:`~llmbatch.api.store.records.IdempotentCreate` holding its whole
batch record. A repeat, concurrent or later, finds that claim and answers with the same batch, finishing
what the first may not have (its record, its event: the same event id and source, which the dispatcher drops
when it has it already). A repeat with other parameters is refused: 409 ``idempotency_key_reused``.
Claims are kept with the tenant's records (``<tenant>/api/idempotency/<sha256 of the key>.json``).
"""

from __future__ import annotations

import hashlib
import re

import orjson
from pydantic import ValidationError

from llmbatch.api.errors import Conflict, InvalidRequest
from llmbatch.api.objects import BatchCreate
from llmbatch.api.store.records import JSON_TYPE, IdempotentCreate, Layout
from llmbatch.api.store.storage import ObjectMissing, ObjectStore

HEADER = "Idempotency-Key"
_KEY = re.compile(r"^[\x21-\x7e]{1,255}$")  # visible ASCII, as Stripe and the openai SDK make them


def key_digest(key: str) -> str:
    """The SHA-256 (hex) a key is stored by; :class:`InvalidRequest` naming the header if malformed."""
    if not _KEY.fullmatch(key):
        raise InvalidRequest(
            f"{HEADER} must be 1-255 visible ASCII characters (no spaces), e.g. a UUID", param=HEADER
        )
    return hashlib.sha256(key.encode()).hexdigest()


def request_digest(body: BatchCreate) -> str:
    """What a repeat must ask for again: the create's parameters, key order aside (a create without
    ``priority`` digests as it did before that field existed: keys claimed then still match)."""
    asked = body.model_dump(mode="json", exclude={"priority"} if body.priority is None else None)
    return hashlib.sha256(orjson.dumps(asked, option=orjson.OPT_SORT_KEYS)).hexdigest()


def reused(claim: IdempotentCreate) -> Conflict:
    return Conflict(
        f"this {HEADER} was used for another request (it created {claim.batch.id}): use a new key for a "
        "new batch, or send the same parameters to get that batch",
        code="idempotency_key_reused",
    )


class IdempotencyStore:
    """The tenants' claimed keys, in object storage."""

    def __init__(self, objects: ObjectStore, layout: Layout) -> None:
        self.objects = objects
        self.layout = layout

    async def get(self, tenant: str, digest: str) -> IdempotentCreate | None:
        try:
            raw = await self.objects.get(self.layout.bucket, self.layout.idempotency_key(tenant, digest))
        except ObjectMissing:
            return None
        try:
            claim = IdempotentCreate.model_validate_json(raw)
        except ValidationError:
            return None
        return claim if claim.batch.tenant == tenant else None

    async def claim(self, tenant: str, digest: str, create: IdempotentCreate) -> bool:
        """Claim the key for ``create``; ``False`` if it was claimed already (that claim stays)."""
        data = create.model_dump_json().encode()
        key = self.layout.idempotency_key(tenant, digest)
        return await self.objects.put_new(self.layout.bucket, key, data, content_type=JSON_TYPE)
