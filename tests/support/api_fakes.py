"""In-memory ports for the HTTP API's unit tests: object storage, a Kafka publisher that keeps the
wire records it would send, and a dispatcher whose Redis hashes are written by the dispatcher's own
field builders (``intake_fields``, ``terminal_fields``), so the API reads what the real one writes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import IO, Any

from llmbatch.adapters.errors import BrokerUnavailable
from llmbatch.adapters.kafka import Published
from llmbatch.api.store.storage import CHUNK_BYTES, ObjectMissing
from llmbatch.api.tenancy.usage import UsageSource
from llmbatch.dispatcher.domain.batch_record import BatchRecord
from llmbatch.dispatcher.domain.dlt import OriginalRecord
from llmbatch.dispatcher.domain.events import Outcome, terminal_fields
from llmbatch.dispatcher.domain.keys import BatchKey, batch_key, split_batch_key
from llmbatch.dispatcher.domain.retention import Expiring
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.intake.commands import intake_fields
from llmbatch.dispatcher.state.retention import Claim, Retired
from llmbatch.schemas import REQUEST_EVENT_TYPES, BatchRequest, Envelope, decode, encode
from llmbatch.schemas.common import API_BATCH_PREFIX
from llmbatch.schemas.webhooks import WebhookEndpoint
from llmbatch.settings.retention import RetentionSettings
from llmbatch.settings.webhooks import WebhookSettings
from tests.support.clock import Clock


class MemoryObjectStore:
    """:class:`llmbatch.api.store.storage.ObjectStore` in a dict; remembers the keys ``get`` was asked for
    (``reads``) and the largest streamed read. ``failing`` (operation name -> error) makes every call of
    that operation raise, as a store that went away does; tests that need a race subclass it."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], bytes] = {}
        self.largest_read = 0
        self.reads: list[str] = []
        self.failing: dict[str, Exception] = {}

    def _fail(self, operation: str) -> None:
        if (error := self.failing.get(operation)) is not None:
            raise error

    async def put(self, bucket: str, key: str, data: IO[bytes], length: int, *, content_type: str) -> None:
        self._fail("put")
        parts, left = [], length
        while left > 0:
            block = data.read(min(left, CHUNK_BYTES))
            if not block:
                raise ValueError(f"stream ended {left} bytes short of {length}")
            parts.append(block)
            left -= len(block)
        self.objects[(bucket, key)] = b"".join(parts)

    async def put_new(self, bucket: str, key: str, data: bytes, *, content_type: str) -> bool:
        self._fail("put_new")
        if (bucket, key) in self.objects:
            return False
        self.objects[(bucket, key)] = data
        return True

    async def get(self, bucket: str, key: str) -> bytes:
        self._fail("get")
        self.reads.append(key)
        try:
            return self.objects[(bucket, key)]
        except KeyError:
            raise ObjectMissing(key) from None

    async def size(self, bucket: str, key: str) -> int:
        return len(await self.get(bucket, key))

    async def stream(self, bucket: str, key: str, *, chunk_bytes: int = CHUNK_BYTES) -> AsyncIterator[bytes]:
        data = await self.get(bucket, key)
        for start in range(0, len(data), chunk_bytes):
            self.largest_read = max(self.largest_read, min(chunk_bytes, len(data) - start))
            await asyncio.sleep(0)
            yield data[start : start + chunk_bytes]

    async def list_keys(
        self, bucket: str, prefix: str, *, start_after: str | None = None, limit: int
    ) -> list[str]:
        self._fail("list_keys")
        keys = sorted(k for b, k in self.objects if b == bucket and k.startswith(prefix))
        if start_after is not None:
            keys = [k for k in keys if k > start_after]
        return keys[:limit]

    async def total_size(self, bucket: str, prefix: str) -> int:
        return sum(len(v) for (b, k), v in self.objects.items() if b == bucket and k.startswith(prefix))

    async def delete(self, bucket: str, key: str) -> None:
        self._fail("delete")
        self.objects.pop((bucket, key), None)

    def keys(self, bucket: str) -> list[str]:
        return sorted(k for b, k in self.objects if b == bucket)


@dataclass
class RecordingPublisher:
    """Encodes each event as the Kafka producer would, decodes it back as the dispatcher does, and
    keeps both; ``fail`` makes the next publishes raise :class:`BrokerUnavailable`."""

    records: list[tuple[str, bytes, bytes, list[tuple[str, bytes]]]] = field(default_factory=list)
    fail: bool = False

    async def publish(self, topic: str, envelope: Envelope[Any]) -> Published:
        if self.fail:
            raise BrokerUnavailable("Kafka at 127.0.0.1:1 is unreachable")
        key, value, headers = encode(envelope)
        self.records.append((topic, key, value, headers))
        return Published(topic, 0, len(self.records) - 1)

    def events(self) -> list[Envelope[Any]]:
        """What the dispatcher would decode from the requests topic."""
        return [decode(k, v, h, expect=REQUEST_EVENT_TYPES) for _, k, v, h in self.records]


class MemoryDispatcher:
    """The dispatcher's Redis as :class:`llmbatch.api.store.state.RedisStateReader` reads it, moved along by
    tests; ``down`` makes reads of batch records raise it, as a Redis that went away does."""

    def __init__(self) -> None:
        self.down: Exception | None = None
        self.hashes: dict[str, dict[str, str]] = {}
        self.progress: dict[str, dict[str, str]] = {}
        self.listings: dict[str, dict[str, int]] = {}  # tenant -> batch id -> accepted ms (from Kafka)
        self.tokens: dict[str, int] = {}  # tenant -> enqueued tokens (the quota counter)
        self.stored: dict[str, int] = {}  # tenant -> the bytes it keeps, as the tracker leader measured

    def _find(self, key: BatchKey) -> str | None:
        """The id of the batch ``key`` names: batch ids are scoped by tenant (the tests' ids are unique
        across tenants, so hashes are kept by id, and a key of another tenant finds nothing)."""
        tenant, batch_id = split_batch_key(key)
        found = self.hashes.get(batch_id)
        return batch_id if found is not None and found.get("tenant", "default") == tenant else None

    async def get_many(self, batch_keys: Sequence[BatchKey]) -> list[BatchRecord | None]:
        if self.down is not None:
            raise self.down
        found = [self._find(k) for k in batch_keys]
        return [
            BatchRecord.from_hash(k, self.hashes[b]) if b is not None else None
            for k, b in zip(batch_keys, found, strict=True)
        ]

    async def read_progress_many(self, batch_keys: Sequence[BatchKey]) -> list[dict[str, str]]:
        found = [self._find(k) for k in batch_keys]
        return [dict(self.progress.get(b, {})) if b is not None else {} for b in found]

    async def listed(
        self, tenant: str, *, after: tuple[int, str | None] | None, limit: int
    ) -> list[tuple[str, int]]:
        ordered = sorted(self.listings.get(tenant, {}).items(), key=lambda e: (e[1], e[0]), reverse=True)
        if after is not None:
            ms, last = after
            ordered = [(b, t) for b, t in ordered if t < ms or (t == ms and (last is None or b < last))]
        return ordered[:limit]

    async def listed_at(self, tenant: str, batch_id: str) -> int | None:
        return self.listings.get(tenant, {}).get(batch_id)

    async def enqueued_tokens(self, tenant: str) -> int:
        return self.tokens.get(tenant, 0)

    async def stored_bytes_many(self, tenants: Sequence[str]) -> list[int | None]:
        return [self.stored.get(t) for t in tenants]

    def _set(self, batch_id: str, state: State, now: float, **fields: object) -> None:
        current = self.hashes[batch_id]
        current.update({k: str(v) for k, v in fields.items()})
        current["version"] = str(int(current.get("version", "0")) + 1)
        if current.get("state") != state.value:
            current["state"], current["state_at"] = state.value, repr(now)

    def record(self, batch_id: str) -> BatchRecord:
        fields = self.hashes[batch_id]
        return BatchRecord.from_hash(batch_key(fields.get("tenant"), batch_id), fields)

    def take_in(
        self, record: tuple[str, bytes, bytes, list[tuple[str, bytes]]], now: float, offset: int = 0
    ) -> str:
        """Accept a published ``batch.requested`` record (state ``queued``), as intake does."""
        topic, key, value, headers = record
        envelope = decode(key, value, headers, expect=REQUEST_EVENT_TYPES)
        request = envelope.data
        assert isinstance(request, BatchRequest)
        origin = OriginalRecord(topic, 0, offset, key, value, tuple(headers), int(now * 1000), 0)
        fields = intake_fields(request, origin, envelope.source, envelope.id, None, now)
        deadline = request.effective_deadline(datetime.fromtimestamp(now, tz=UTC)).timestamp()
        self.hashes[request.batch_id] = {
            **fields,
            "state": State.QUEUED.value,
            "state_at": repr(now),
            "version": "1",
            "generation": "0",
            "deadline": repr(deadline),
        }
        if not request.batch_id.startswith(API_BATCH_PREFIX):  # as intake lists it for GET /v1/batches
            self.listings.setdefault(request.tenant or "default", {})[request.batch_id] = int(now * 1000)
        return request.batch_id

    def expire(self, batch_id: str) -> None:
        """The batch's record reached its TTL (``finished_ttl_s``) and is gone; its list entry stays."""
        del self.hashes[batch_id]
        self.progress.pop(batch_id, None)

    def reject(self, batch_id: str, now: float, code: str, message: str) -> None:
        """Record a request refused at intake (``dead_lettered``), as intake does."""
        self.hashes[batch_id] = {
            "batch_id": batch_id,
            "state": State.DEAD_LETTERED.value,
            "state_at": repr(now),
            "version": "1",
            "rejected_at": repr(now),
            "dlt_reason": code,
            "error_code": code,
            "error_message": message,
        }

    def run(
        self,
        batch_id: str,
        now: float,
        *,
        completed: int = 0,
        failed: int = 0,
        total: int = 0,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
    ) -> None:
        """The batch's first attempt is running and reported progress."""
        self._set(
            batch_id, State.SUBMITTED, now, attempt=1, submitted_at=repr(now), submission_id=f"{batch_id}-a1"
        )
        self._set(
            batch_id,
            State.RUNNING,
            now,
            running_at=repr(now),
            started_at=repr(now),
            attempt_started_at=repr(now),
        )
        self.progress[batch_id] = {
            "total": str(total),
            "completed": str(completed),
            "failed": str(failed),
            "prompt_tokens": str(prompt_tokens),
            "completion_tokens": str(completion_tokens),
            "heartbeat_at": repr(now),
        }

    def ask_cancel(self, batch_id: str, now: float) -> None:
        """A cancel of a running batch recorded (the tracker stops its job next)."""
        state = State(self.hashes[batch_id]["state"])
        self._set(
            batch_id, state, now, cancel_requested="1", cancel_reason="test", cancel_requested_at=repr(now)
        )

    def finalize(self, batch_id: str, now: float) -> None:
        self._set(batch_id, State.FINALIZING, now, confirmed="1", job_ended_at=repr(now))

    def finish(self, batch_id: str, outcome: Outcome) -> None:
        """End the batch with ``outcome`` (what the tracker records with the terminal transition)."""
        fields = terminal_fields(self.record(batch_id), outcome)
        self._set(batch_id, outcome.state, outcome.finished_at, **fields)
        self.progress.pop(batch_id, None)


# --- the app over these fakes ---------------------------------------------------------------------

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
INPUT_BUCKET = "llmbatch-input"
RESULTS_BUCKET = "llmbatch-results"
REQUESTS_TOPIC = "llm.batch.requests.v1"
KEYS = {"acme": "sk-acme-0123456789", "globex": "sk-globex-9876543210"}
"""Tenant -> its API key (the app is configured with their hashes only)."""
T0 = 1_780_000_000.0


@dataclass
class ApiHarness:
    """The real app (real services) over in-memory ports, and a TestClient to call it."""

    app: Any
    client: Any
    objects: MemoryObjectStore
    publisher: RecordingPublisher
    dispatcher: MemoryDispatcher
    clock: Clock
    endpoints: MemoryEndpoints
    dates: MemoryDates | None = None

    @staticmethod
    def auth(tenant: str = "acme") -> dict[str, str]:
        return {"Authorization": f"Bearer {KEYS[tenant]}"}

    def upload(self, data: bytes, tenant: str = "acme", filename: str = "in.jsonl") -> Any:
        return self.client.post(
            "/v1/files",
            headers=self.auth(tenant),
            data={"purpose": "batch"},
            files={"file": (filename, data, "application/jsonl")},
        )

    def accept_all(self) -> list[str]:
        """The dispatcher takes in every ``batch.requested`` published so far (not yet taken in)."""
        taken = []
        for offset, record in enumerate(self.publisher.records):
            envelope = decode(record[1], record[2], record[3], expect=REQUEST_EVENT_TYPES)
            data = envelope.data
            if isinstance(data, BatchRequest) and data.batch_id not in self.dispatcher.hashes:
                taken.append(self.dispatcher.take_in(record, self.clock.now, offset))
        return taken

    def write_shard(self, uri: str, data: bytes) -> None:
        bucket, _, key = uri.removeprefix("s3://").partition("/")
        self.objects.objects[(bucket, key)] = data


class MemoryEndpoints:
    """Webhook endpoints as :class:`~llmbatch.dispatcher.webhooks.store.WebhookStore` keeps them."""

    def __init__(self) -> None:
        self.by_tenant: dict[str, dict[str, WebhookEndpoint]] = {}

    async def endpoints(self, tenant: str) -> list[WebhookEndpoint]:
        return sorted(self.by_tenant.get(tenant, {}).values(), key=lambda e: (e.created_at, e.id))

    async def endpoint(self, tenant: str, endpoint_id: str) -> WebhookEndpoint | None:
        return self.by_tenant.get(tenant, {}).get(endpoint_id)

    async def count(self, tenant: str) -> int:
        return len(self.by_tenant.get(tenant, {}))

    async def put_endpoint(self, endpoint: WebhookEndpoint) -> None:
        self.by_tenant.setdefault(endpoint.tenant, {})[endpoint.id] = endpoint

    async def delete_endpoint(self, tenant: str, endpoint_id: str) -> bool:
        return self.by_tenant.get(tenant, {}).pop(endpoint_id, None) is not None


class MemoryDates:
    """The dates of the retention index, as the API writes and reads them (the collector's claims are
    tested on a real Redis: tests/integration/test_retention.py)."""

    def __init__(self) -> None:
        self.due: dict[str, float] = {}
        self.gone_names: dict[str, float] = {}

    async def schedule(self, member: str, due: float) -> None:
        self.due[member] = due

    async def due_of(self, members: Sequence[str]) -> list[float | None]:
        return [self.due.get(m) for m in members]

    async def gone_at(self, name: str) -> float | None:
        return self.gone_names.get(name)

    async def claim(self, now: float, *, lease_s: float, limit: int) -> list[Claim]:
        raise NotImplementedError("the in-memory dates do not collect")

    async def done(self, claim: Claim) -> bool:
        raise NotImplementedError("the in-memory dates do not collect")

    async def defer(self, claim: Claim, until: float) -> bool:
        raise NotImplementedError("the in-memory dates do not collect")

    async def gone(self, claim: Claim, item: Expiring, expired_at: float, forget_after_s: int) -> bool:
        raise NotImplementedError("the in-memory dates do not collect")

    async def retire_batch(self, claim: Claim, item: Expiring, now: float, forget_after_s: int) -> Retired:
        raise NotImplementedError("the in-memory dates do not collect")


WEBHOOK_KEY = "w" * 40


def make_api(
    *,
    webhooks: WebhookSettings | None = None,
    usage: UsageSource | None = None,
    token_limits: dict[str, int] | None = None,
    storage_limits: dict[str, int] | None = None,
    retention: RetentionSettings | None = None,
    objects: MemoryObjectStore | None = None,
    **options: Any,
) -> ApiHarness:
    """The app over in-memory ports; ``objects``: its object store (a fresh one when None); ``webhooks``:
    its webhook settings (off when None); ``usage``: where ``GET /v1/usage`` reads (none: no usage
    recorded); ``retention``: files expire by it (none: never), dated in :class:`MemoryDates` (its
    collector off)."""
    from fastapi.testclient import TestClient

    from llmbatch.api.http.app import build_services, create_app
    from llmbatch.api.settings import ApiOptions
    from llmbatch.api.store.state import RedisStateReader
    from llmbatch.api.tenancy.auth import hash_api_key

    settings = ApiOptions(
        keys={hash_api_key(key): tenant for tenant, key in KEYS.items()}, source="urn:test:api", **options
    )
    objects = MemoryObjectStore() if objects is None else objects
    publisher, dispatcher = RecordingPublisher(), MemoryDispatcher()
    endpoints = MemoryEndpoints()
    dates = None if retention is None else MemoryDates()
    clock = Clock(T0)
    services = build_services(
        settings,
        objects=objects,
        state=RedisStateReader(dispatcher),
        publisher=publisher,
        input_bucket=INPUT_BUCKET,
        results_bucket=RESULTS_BUCKET,
        requests_topic=REQUESTS_TOPIC,
        webhook_settings=webhooks,
        endpoints=endpoints,
        usage=usage,
        token_limits=token_limits,
        storage_limits=storage_limits,
        retention=None if retention is None else retention.model_copy(update={"collect_every_s": 0}),
        retention_index=dates,
        clock=clock,
        monotonic=clock,
    )
    app = create_app(services)
    return ApiHarness(app, TestClient(app), objects, publisher, dispatcher, clock, endpoints, dates)


def chat_line(
    custom_id: str, *, model: str | None = MODEL, url: str = "/v1/chat/completions", **body: Any
) -> dict[str, Any]:
    content: dict[str, Any] = {"messages": [{"role": "user", "content": f"Say {custom_id}"}], **body}
    if model is not None:
        content["model"] = model
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": content}


def jsonl(*rows: dict[str, Any] | bytes) -> bytes:
    import json

    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)
