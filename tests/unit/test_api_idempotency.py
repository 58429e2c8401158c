"""``POST /v1/batches`` with an ``Idempotency-Key``: one batch per key and tenant, however often and
however concurrently it is sent; a repeat finishes a create that failed half-way; another request
under the same key is refused. Over the in-memory object store (its put_new is atomic, as S3's
conditional write; tests/integration/test_minio_server.py shows MinIO's)."""

from __future__ import annotations

import hashlib
from typing import Any, Final

import openai
import orjson
import pytest

from llmbatch.api.batches.idempotency import request_digest
from llmbatch.api.objects import BatchCreate
from llmbatch.api.store.records import IdempotentCreate
from llmbatch.schemas import BatchRequest
from llmbatch.schemas.common import Endpoint
from tests.support.api_fakes import (
    INPUT_BUCKET,
    KEYS,
    ApiHarness,
    MemoryObjectStore,
    chat_line,
    jsonl,
    make_api,
)

pytestmark = pytest.mark.unit
CHAT: Final = "/v1/chat/completions"


def uploaded(api: ApiHarness, tenant: str = "acme") -> str:
    answer = api.upload(jsonl(*(chat_line(f"r{i}") for i in range(3))), tenant=tenant)
    assert answer.status_code == 200, answer.text
    return str(answer.json()["id"])


def create(api: ApiHarness, key: str | None, tenant: str = "acme", **body: Any) -> Any:
    headers: dict[str, Any] = {**api.auth(tenant)}
    if key is not None:
        headers["Idempotency-Key"] = key.encode()  # as a client may send it: bytes, UTF-8
    return api.client.post("/v1/batches", headers=headers, json={"endpoint": CHAT, **body})


def batch_records(api: ApiHarness, tenant: str = "acme") -> list[str]:
    return [k for k in api.objects.keys(INPUT_BUCKET) if k.startswith(f"{tenant}/api/batches/")]


def test_the_same_key_makes_one_batch_and_sends_the_same_event() -> None:
    api = make_api()
    file_id = uploaded(api)
    first = create(api, "key-1", input_file_id=file_id, metadata={"a": "1"})
    again = create(api, "key-1", input_file_id=file_id, metadata={"a": "1"})
    assert first.status_code == again.status_code == 200, again.text
    assert again.json()["id"] == first.json()["id"] and len(batch_records(api)) == 1
    one, two = api.publisher.events()  # not yet taken in: the repeat sends it again, unchanged
    assert isinstance(one.data, BatchRequest) and one.data.batch_id == first.json()["id"]
    assert (two.id, two.source, two.data) == (one.id, one.source, one.data)
    # once the dispatcher has it, a repeat sends nothing and shows its state
    api.accept_all()
    third = create(api, "key-1", input_file_id=file_id, metadata={"a": "1"})
    assert third.json()["id"] == first.json()["id"] and len(api.publisher.records) == 2
    # without a key, or with another, a new batch
    assert create(api, None, input_file_id=file_id).json()["id"] != first.json()["id"]
    assert create(api, "key-2", input_file_id=file_id).json()["id"] != first.json()["id"]
    assert len(batch_records(api)) == 3


def test_another_request_under_a_used_key_is_refused() -> None:
    api = make_api()
    file_id = uploaded(api)
    batch_id = create(api, "key-1", input_file_id=file_id).json()["id"]
    answer = create(api, "key-1", input_file_id=file_id, metadata={"other": "x"})
    assert answer.status_code == 409
    error = answer.json()["error"]
    assert error["code"] == "idempotency_key_reused" and batch_id in error["message"]
    assert len(batch_records(api)) == 1


def test_a_priority_is_part_of_what_a_key_stands_for() -> None:
    api = make_api()
    file_id = uploaded(api)
    batch_id = create(api, "key-1", input_file_id=file_id, priority=9).json()["id"]
    assert create(api, "key-1", input_file_id=file_id, priority=9).json()["id"] == batch_id
    assert create(api, "key-1", input_file_id=file_id, priority=3).status_code == 409
    assert create(api, "key-1", input_file_id=file_id).status_code == 409


def test_a_create_without_priority_digests_as_before_that_field() -> None:
    """Keys claimed before ``priority`` existed still match their repeats."""
    body = BatchCreate(input_file_id="file-1", endpoint=Endpoint(CHAT), metadata={"a": "1"})
    before = {"input_file_id": "file-1", "endpoint": CHAT, "completion_window": None, "metadata": {"a": "1"}}
    before["output_expires_after"] = None
    digest = hashlib.sha256(orjson.dumps(before, option=orjson.OPT_SORT_KEYS)).hexdigest()
    assert request_digest(body) == digest
    assert request_digest(body.model_copy(update={"priority": 5})) != digest


def test_keys_are_per_tenant() -> None:
    api = make_api()
    mine = create(api, "shared", input_file_id=uploaded(api)).json()["id"]
    theirs = create(api, "shared", tenant="globex", input_file_id=uploaded(api, "globex"))
    assert theirs.status_code == 200 and theirs.json()["id"] != mine


def test_a_repeat_finishes_a_create_whose_publish_failed() -> None:
    """Without a key a failed publish removes the batch (the client makes a new one); with a key the
    batch stays claimed, and the client's retry (the SDK's, on the 503) publishes its event."""
    api = make_api()
    file_id = uploaded(api)
    api.publisher.fail = True
    failed = create(api, "key-1", input_file_id=file_id)
    assert failed.status_code == 503 and api.publisher.records == []
    api.publisher.fail = False
    api.objects.objects = {
        k: v
        for k, v in api.objects.objects.items()  # the record write was lost too
        if not k[1].startswith("acme/api/batches/")
    }
    retried = create(api, "key-1", input_file_id=file_id)
    assert retried.status_code == 200, retried.text
    (event,) = api.publisher.events()
    assert event.data.batch_id == retried.json()["id"] and len(batch_records(api)) == 1
    # the file may be gone meanwhile (an API delete refuses while the batch may read it, but an
    # operator may remove objects): the repeat does not check it again
    api.objects.objects = {k: v for k, v in api.objects.objects.items() if file_id not in k[1]}
    assert api.client.get(f"/v1/files/{file_id}", headers=api.auth()).status_code == 404
    assert create(api, "key-1", input_file_id=file_id).json()["id"] == retried.json()["id"]


class ClaimedMeanwhile(MemoryObjectStore):
    """Once ``winner`` (the objects of a concurrent create's claim) is set, every claim (``put_new``) of
    an idempotency key loses to that create, whose objects are there at the next read."""

    def __init__(self) -> None:
        super().__init__()
        self.winner: dict[tuple[str, str], bytes] = {}
        self.lost: list[str] = []

    async def put_new(self, bucket: str, key: str, data: bytes, *, content_type: str) -> bool:
        if self.winner and "/api/idempotency/" in key:
            self.lost.append(key)
            return False
        return await super().put_new(bucket, key, data, content_type=content_type)

    async def get(self, bucket: str, key: str) -> bytes:
        if self.lost and "/api/idempotency/" in key:
            self.objects.update(self.winner)
        return await super().get(bucket, key)


def test_of_two_concurrent_creates_one_batch_wins() -> None:
    """The claim is a conditional write: the create that loses it answers with the winner's batch."""
    objects = ClaimedMeanwhile()
    api = make_api(objects=objects)
    file_id = uploaded(api)
    first = create(api, "key-1", input_file_id=file_id).json()
    stored = {k: v for k, v in api.objects.objects.items() if "/api/idempotency/" in k[1]}
    api.objects.objects = {k: v for k, v in api.objects.objects.items() if k not in stored}
    objects.winner = stored  # from now on the other create's claim lands between our read and write
    answer = create(api, "key-1", input_file_id=file_id)
    assert objects.lost and answer.json()["id"] == first["id"]
    [claim] = stored.values()
    assert IdempotentCreate.model_validate_json(claim).batch.id == first["id"]


@pytest.mark.parametrize("key", ["", "has space", "x" * 256, "naïve"])
def test_a_malformed_key_is_refused_naming_the_header(key: str) -> None:
    api = make_api()
    answer = create(api, key, input_file_id=uploaded(api))
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "Idempotency-Key"


def test_the_openai_sdk_sends_the_key_as_extra_headers() -> None:
    api = make_api()
    client = openai.OpenAI(
        base_url="http://testserver/v1", api_key=KEYS["acme"], http_client=api.client, max_retries=0
    )
    file_id = uploaded(api)
    made = [
        client.batches.create(
            input_file_id=file_id,
            endpoint=CHAT,
            completion_window="24h",
            extra_headers={"Idempotency-Key": "nightly-2026-11-24"},
        )
        for _ in range(2)
    ]
    assert made[0].id == made[1].id and len(batch_records(api)) == 1
    assert api.dispatcher.hashes == {}  # nothing taken in yet: both answers are validating
    assert {b.status for b in made} == {"validating"}


def test_a_repeat_after_the_completion_window_sends_nothing() -> None:
    api = make_api()
    file_id = uploaded(api)
    api.publisher.fail = True
    assert create(api, "key-1", input_file_id=file_id, completion_window="24h").status_code == 503
    api.publisher.fail = False
    api.clock.now += 86400
    answer = create(api, "key-1", input_file_id=file_id, completion_window="24h")
    assert answer.status_code == 200 and api.publisher.records == []
