"""What the API keeps in object storage, and the ids it hands out.

**Ids.** Uploaded files are ``file-<t><r>`` and batches ``batch_<t><r>``: ``<t>`` is 13 digits
counting *down* with the creation time in milliseconds and ``<r>`` 16 random hex digits. S3 lists keys
in lexicographic order, so a tenant's records list newest first (OpenAI's order) and ``after=<id>``
is S3's ``start_after``: no index to keep in step. A batch's result files have derived ids,
``file-output-<batch_id>`` and ``file-error-<batch_id>`` (see :mod:`llmbatch.api.batches.results`).

**Layout** (in the input bucket, ``LLMBATCH_S3__INPUT_BUCKET``, under the tenant's prefix as every
llmbatch object is)::

    <tenant>/files/<file_id>.jsonl          the uploaded file, byte for byte (a batch's input_uri)
    <tenant>/api/files/<file_id>.json       its record (StoredFile)
    <tenant>/api/batches/<batch_id>.json    a batch created through the API (StoredBatch)
    <tenant>/api/idempotency/<sha256>.json  an Idempotency-Key's create (IdempotentCreate)
    <tenant>/api/file-uses/<file_id>/<batch_id>  an empty marker: a batch was created from the file
    <tenant>/api/active/<batch_id>               an empty marker: a batch that may not have ended yet

A record exists only once its content does (the file is written first, its record last), and goes
first on delete. Ids from a path are checked against their pattern before any key is built.
"""

from __future__ import annotations

import asyncio
import io
import re
import secrets
from collections.abc import Sequence
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmbatch.api.store.storage import ObjectMissing, ObjectStore, delete_under
from llmbatch.schemas.common import API_BATCH_PREFIX, Endpoint, ExpiresAfter, Metadata

_COUNTDOWN_FROM = 10**13 - 1  # ms: enough until the year 2286
FILE_PREFIX = "file-"
BATCH_PREFIX = API_BATCH_PREFIX
_ID_TAIL = r"[0-9]{13}[0-9a-f]{16}"
FILE_ID = re.compile(rf"^{FILE_PREFIX}{_ID_TAIL}$")
BATCH_ID = re.compile(rf"^{BATCH_PREFIX}{_ID_TAIL}$")
JSON_TYPE = "application/json"
_READ_AHEAD = 16

R = TypeVar("R", bound="Record")


def new_id(prefix: str, now_s: float) -> str:
    """A fresh id that sorts before every id made earlier (newest first)."""
    countdown = _COUNTDOWN_FROM - int(now_s * 1000)
    return f"{prefix}{countdown:013d}{secrets.token_hex(8)}"


def made_ms(record_id: str, prefix: str) -> int:
    """When :func:`new_id` made ``record_id`` (unix ms)."""
    return _COUNTDOWN_FROM - int(record_id[len(prefix) : len(prefix) + 13])


def after_ms(prefix: str, ms: int) -> str:
    """A listing cursor past every id :func:`new_id` made in millisecond ``ms`` and later (not an id:
    ``g`` sorts after every hex digit of their tails)."""
    return f"{prefix}{_COUNTDOWN_FROM - ms:013d}g"


def made_at(record_id: str, prefix: str) -> float:
    """When :func:`new_id` made ``record_id`` (seconds; ms precision)."""
    countdown = int(record_id[len(prefix) : len(prefix) + 13])
    return (_COUNTDOWN_FROM - countdown) / 1000


class Record(BaseModel):
    """Base of stored records: strict about what it reads back, tolerant of added fields."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: str
    tenant: str
    created_at: float


class StoredFile(Record):
    """An uploaded batch input file: what OpenAI shows, and what a batch created from it needs."""

    filename: str
    bytes: int = Field(ge=0)
    purpose: Literal["batch"] = "batch"
    sha256: str
    endpoint: Endpoint = Field(description="The url of every line.")
    model: str = Field(description="The body.model of every line.")
    requests: int = Field(ge=1, description="Request lines.")
    expires_at: float | None = Field(
        default=None, description="When it expires (unix s; the collector then deletes it); None: never."
    )


class StoredBatch(Record):
    """A batch created through the API (what its Kafka request said, plus the API's own facts)."""

    input_file_id: str
    endpoint: Endpoint
    model: str
    completion_window: str
    expires_at: float
    metadata: Metadata = Field(default_factory=dict)
    total: int = Field(ge=0, description="Request lines of the input file.")
    input_uri: str
    cancel_requested_at: float | None = None
    priority: int = Field(default=5, ge=0, le=9)
    event_id: str | None = Field(default=None, description="ce_id of its batch.requested event.")
    event_source: str | None = Field(default=None, description="ce_source of that event.")
    republished_at: float | None = Field(
        default=None, description="When the API last published its event again (see BatchService)."
    )
    output_expires_after: ExpiresAfter | None = Field(
        default=None, description="What the create asked of its result files' retention."
    )
    idempotency_key_sha256: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description="The SHA-256 of the Idempotency-Key it was created with (its claim goes with it).",
    )
    via_kafka: bool = Field(
        default=False,
        description="A view of a batch the tenant published straight to Kafka (never stored: the API did "
        "not create it, and it has no input file of the API).",
    )


class IdempotentCreate(BaseModel):
    """What an ``Idempotency-Key`` of a tenant stands for: the batch its first create made (in full,
    with its event's id and source, so a repeat can finish that create) and what was asked."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    request_sha256: str = Field(description="SHA-256 of the create's parameters (a repeat must match).")
    batch: StoredBatch


class Layout:
    """Bucket and key names of the API's objects (pure)."""

    def __init__(self, bucket: str) -> None:
        self.bucket = bucket

    def content_folder(self, tenant: str) -> str:
        """Where the tenant's uploaded files are (what its storage quota counts)."""
        return f"{tenant}/files/"

    def content_key(self, tenant: str, file_id: str) -> str:
        return f"{self.content_folder(tenant)}{file_id}.jsonl"

    def content_uri(self, tenant: str, file_id: str) -> str:
        return f"s3://{self.bucket}/{self.content_key(tenant, file_id)}"

    def folder(self, tenant: str, kind: Literal["files", "batches"]) -> str:
        return f"{tenant}/api/{kind}/"

    def record_key(self, tenant: str, kind: Literal["files", "batches"], record_id: str) -> str:
        return f"{self.folder(tenant, kind)}{record_id}.json"

    def uses_folder(self, tenant: str, file_id: str) -> str:
        """Where the markers of the batches created from a file are kept."""
        return f"{tenant}/api/file-uses/{file_id}/"

    def active_folder(self, tenant: str) -> str:
        """Where the markers of the tenant's batches that may not have ended yet are kept."""
        return f"{tenant}/api/active/"

    def idempotency_key(self, tenant: str, key_sha256: str) -> str:
        """Where a tenant's ``Idempotency-Key`` (by its SHA-256) is kept."""
        return f"{tenant}/api/idempotency/{key_sha256}.json"


class RecordStore:
    """JSON records of one kind per tenant, in object storage, listed newest first."""

    def __init__(self, objects: ObjectStore, layout: Layout) -> None:
        self.objects = objects
        self.layout = layout

    async def put(self, kind: Literal["files", "batches"], record: Record) -> None:
        data = record.model_dump_json().encode()
        key = self.layout.record_key(record.tenant, kind, record.id)
        await self.objects.put(self.layout.bucket, key, io.BytesIO(data), len(data), content_type=JSON_TYPE)

    async def get(
        self, kind: Literal["files", "batches"], model: type[R], tenant: str, record_id: str
    ) -> R | None:
        """The tenant's record, or ``None`` (unknown id, another tenant's, or unreadable)."""
        pattern = FILE_ID if kind == "files" else BATCH_ID
        if not pattern.fullmatch(record_id):
            return None
        try:
            raw = await self.objects.get(self.layout.bucket, self.layout.record_key(tenant, kind, record_id))
        except ObjectMissing:
            return None
        try:
            record = model.model_validate_json(raw)
        except ValidationError:
            return None
        return record if record.tenant == tenant and record.id == record_id else None

    async def delete(self, kind: Literal["files", "batches"], tenant: str, record_id: str) -> None:
        await self.objects.delete(self.layout.bucket, self.layout.record_key(tenant, kind, record_id))

    async def ids(
        self, kind: Literal["files", "batches"], tenant: str, *, after: str | None, limit: int
    ) -> list[str]:
        """Up to ``limit`` record ids of the tenant, newest first, those after ``after``."""
        folder = self.layout.folder(tenant, kind)
        start = self.layout.record_key(tenant, kind, after) if after else None
        keys = await self.objects.list_keys(self.layout.bucket, folder, start_after=start, limit=limit)
        pattern = FILE_ID if kind == "files" else BATCH_ID
        found = [key[len(folder) :].removesuffix(".json") for key in keys if key.endswith(".json")]
        return [record_id for record_id in found if pattern.fullmatch(record_id)]

    async def ids_oldest_first(
        self, kind: Literal["files", "batches"], tenant: str, *, after: str | None
    ) -> list[str]:
        """Every record id of the tenant after ``after``, oldest first (S3 lists keys one way only:
        all ids are read, then reversed)."""
        ids = list(reversed(await self.ids(kind, tenant, after=None, limit=1_000_000)))
        if after is not None:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        return ids

    async def add_use(self, tenant: str, file_id: str, batch_id: str) -> None:
        """Mark ``file_id`` as the input of ``batch_id`` (written before the file's record is read, so a
        delete that lists the uses after removing that record sees every create that found it)."""
        if FILE_ID.fullmatch(file_id) and BATCH_ID.fullmatch(batch_id):
            key = self.layout.uses_folder(tenant, file_id) + batch_id
            await self.objects.put(self.layout.bucket, key, io.BytesIO(b""), 0, content_type=JSON_TYPE)

    async def uses(self, tenant: str, file_id: str, *, limit: int = 10_000) -> list[str]:
        """The ids of up to ``limit`` batches created from ``file_id`` (newest first)."""
        folder = self.layout.uses_folder(tenant, file_id)
        keys = await self.objects.list_keys(self.layout.bucket, folder, limit=limit)
        return [key[len(folder) :] for key in keys if BATCH_ID.fullmatch(key[len(folder) :])]

    async def drop_uses(self, tenant: str, file_id: str) -> None:
        """Remove the marks of the batches created from ``file_id`` (the file is gone)."""
        if FILE_ID.fullmatch(file_id):
            await delete_under(self.objects, self.layout.bucket, self.layout.uses_folder(tenant, file_id))

    async def drop_use(self, tenant: str, file_id: str, batch_id: str) -> None:
        """Remove the mark that ``batch_id`` was created from ``file_id``."""
        if FILE_ID.fullmatch(file_id) and BATCH_ID.fullmatch(batch_id):
            await self.objects.delete(self.layout.bucket, self.layout.uses_folder(tenant, file_id) + batch_id)

    async def add_active(self, tenant: str, batch_id: str) -> None:
        """Mark ``batch_id`` as one of the tenant's batches that may not have ended yet."""
        if BATCH_ID.fullmatch(batch_id):
            key = self.layout.active_folder(tenant) + batch_id
            await self.objects.put(self.layout.bucket, key, io.BytesIO(b""), 0, content_type=JSON_TYPE)

    async def active(self, tenant: str, *, limit: int) -> list[str]:
        """The ids of up to ``limit`` batches marked active (newest first)."""
        folder = self.layout.active_folder(tenant)
        keys = await self.objects.list_keys(self.layout.bucket, folder, limit=limit)
        return [key[len(folder) :] for key in keys if BATCH_ID.fullmatch(key[len(folder) :])]

    async def drop_active(self, tenant: str, batch_id: str) -> None:
        """Remove the active mark of ``batch_id`` (it ended, or its create failed)."""
        if BATCH_ID.fullmatch(batch_id):
            await self.objects.delete(self.layout.bucket, self.layout.active_folder(tenant) + batch_id)

    async def page(
        self, kind: Literal["files", "batches"], model: type[R], tenant: str, *, after: str | None, limit: int
    ) -> tuple[list[R], bool]:
        """Up to ``limit`` records after ``after`` (newest first) and whether more follow."""
        ids = await self.ids(kind, tenant, after=after, limit=limit + 1)
        return await self.get_many(kind, model, tenant, ids[:limit]), len(ids) > limit

    async def get_many(
        self, kind: Literal["files", "batches"], model: type[R], tenant: str, record_ids: Sequence[str]
    ) -> list[R]:
        """The tenant's records of ``record_ids`` that exist, in order (a few read at once)."""
        records: list[R | None] = []
        for start in range(0, len(record_ids), _READ_AHEAD):  # bounded concurrency
            chunk = record_ids[start : start + _READ_AHEAD]
            records.extend(await asyncio.gather(*(self.get(kind, model, tenant, i) for i in chunk)))
        return [r for r in records if r is not None]
