"""API keys (held hashed) -> tenants, isolation between tenants, and the per-tenant quota."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
from pydantic import ValidationError

from llmbatch.api.batches.status import error_file_id, output_file_id
from llmbatch.api.errors import InvalidApiKey, RateLimited
from llmbatch.api.settings import ApiOptions, ApiSettings
from llmbatch.api.store.records import FILE_PREFIX, Layout, RecordStore, StoredBatch, StoredFile, new_id
from llmbatch.api.tenancy.auth import Authenticator, RateLimiter, hash_api_key
from llmbatch.dispatcher.domain.events import Outcome
from llmbatch.dispatcher.domain.states import State
from tests.support.api_fakes import KEYS, ApiHarness, MemoryObjectStore, chat_line, jsonl, make_api

pytestmark = pytest.mark.unit


def test_keys_are_configured_as_sha256_hashes_only() -> None:
    digest = hashlib.sha256(b"sk-secret").hexdigest()
    assert hash_api_key("sk-secret") == digest
    options = ApiOptions(keys={digest.upper(): "acme"})
    assert options.keys == {digest: "acme"}
    with pytest.raises(ValidationError, match="hash-key"):
        ApiOptions(keys={"sk-secret": "acme"})  # a clear key is refused, naming the fix
    with pytest.raises(ValidationError):
        ApiOptions(keys={digest: "Not A Tenant"})


def test_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    digest = hash_api_key("k")
    monkeypatch.setenv("LLMBATCH_API__KEYS", f'{{"{digest}": "search"}}')
    monkeypatch.setenv("LLMBATCH_API__PORT", "9999")
    settings = ApiSettings()
    assert settings.api.keys == {digest: "search"} and settings.api.port == 9999
    assert settings.api.host == "127.0.0.1"


def test_the_authenticator_reads_bearer_keys() -> None:
    auth = Authenticator({hash_api_key("sk-a"): "acme"})
    assert auth.tenant_of("Bearer sk-a") == "acme"
    assert auth.tenant_of("bearer   sk-a ") == "acme"
    with pytest.raises(InvalidApiKey) as missing:
        auth.tenant_of(None)
    assert missing.value.code == "missing_api_key"
    for header in ("Bearer sk-b", "Basic sk-a", "sk-a", "Bearer "):
        with pytest.raises(InvalidApiKey):
            auth.tenant_of(header)


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": KEYS["acme"]}]
)
def test_a_call_without_a_valid_key_is_401(headers: dict[str, str]) -> None:
    api = make_api()
    for method, path in [
        ("GET", "/v1/files"),
        ("GET", "/v1/batches"),
        ("POST", "/v1/batches/x/cancel"),
        ("GET", "/v1/files/file-x/content"),
    ]:
        answer = api.client.request(method, path, headers=headers)
        assert answer.status_code == 401, path
        assert answer.json()["error"]["type"] == "invalid_request_error"
        assert answer.json()["error"]["code"] in {"invalid_api_key", "missing_api_key"}
    assert api.client.get("/v1/files", headers=api.auth()).status_code == 200  # a valid key works


def _completed_batch(api: ApiHarness) -> tuple[str, str]:
    file_id = api.upload(jsonl(chat_line("a"), chat_line("b"))).json()["id"]
    batch = api.client.post(
        "/v1/batches", headers=api.auth(), json={"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
    ).json()
    (batch_id,) = api.accept_all()
    out, err = (f"s3://llmbatch-results/acme/{batch_id}/l1/{k}-a1-00000.jsonl" for k in ("output", "error"))
    api.write_shard(out, b'{"id": "1"}\n')
    api.write_shard(err, b'{"id": "2"}\n')
    api.dispatcher.run(batch_id, api.clock.now)
    api.dispatcher.finish(
        batch_id,
        Outcome(
            State.COMPLETED, api.clock.now, [out], [err], counts={"total": 2, "completed": 1, "failed": 1}
        ),
    )
    assert batch["id"] == batch_id
    return file_id, batch_id


def test_another_tenants_files_and_batches_do_not_exist() -> None:
    api = make_api()
    file_id, batch_id = _completed_batch(api)
    mine, theirs = api.auth("acme"), api.auth("globex")
    for path in (
        f"/v1/files/{file_id}",
        f"/v1/files/{file_id}/content",
        f"/v1/batches/{batch_id}",
        f"/v1/files/{output_file_id(batch_id)}",
        f"/v1/files/{error_file_id(batch_id)}/content",
    ):
        assert api.client.get(path, headers=mine).status_code == 200, path
        answer = api.client.get(path, headers=theirs)
        assert answer.status_code == 404, path
        assert answer.json()["error"]["type"] == "invalid_request_error"
    assert api.client.post(f"/v1/batches/{batch_id}/cancel", headers=theirs).status_code == 404
    assert api.client.delete(f"/v1/files/{file_id}", headers=theirs).status_code == 404
    created = api.client.post(
        "/v1/batches", headers=theirs, json={"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
    )
    assert created.status_code == 404 and created.json()["error"]["param"] == "input_file_id"
    assert api.client.get("/v1/files", headers=theirs).json()["data"] == []
    assert api.client.get("/v1/batches", headers=theirs).json()["data"] == []
    assert api.client.get(f"/v1/files/{file_id}", headers=mine).status_code == 200  # still there


def test_ids_from_a_path_never_reach_storage_unless_they_are_ids() -> None:
    objects = MemoryObjectStore()
    records = RecordStore(objects, Layout("llmbatch-input"))
    for bad in ("../globex/api/files/file-x", "file-..%2f", "file-" + "0" * 29 + "/x", "batch_1"):
        assert asyncio.run(records.get("files", StoredFile, "acme", bad)) is None
        assert asyncio.run(records.get("batches", StoredBatch, "acme", bad)) is None
    assert objects.reads == []
    good = new_id(FILE_PREFIX, 1.0)
    assert asyncio.run(records.get("files", StoredFile, "acme", good)) is None
    assert objects.reads == [f"acme/api/files/{good}.json"]


def test_a_record_is_only_read_back_by_its_own_tenant() -> None:
    objects = MemoryObjectStore()
    records = RecordStore(objects, Layout("llmbatch-input"))
    stored = StoredFile(
        id=new_id(FILE_PREFIX, 1.0),
        tenant="globex",
        created_at=1.0,
        filename="f",
        bytes=1,
        sha256="0" * 64,
        endpoint="/v1/chat/completions",
        model="m",
        requests=1,
    )
    asyncio.run(records.put("files", stored))
    key = f"globex/api/files/{stored.id}.json"
    objects.objects[("llmbatch-input", f"acme/api/files/{stored.id}.json")] = objects.objects[
        ("llmbatch-input", key)
    ]  # a record copied under another tenant's prefix
    assert asyncio.run(records.get("files", StoredFile, "acme", stored.id)) is None
    assert asyncio.run(records.get("files", StoredFile, "globex", stored.id)) == stored


def test_the_rate_limiter_is_a_token_bucket_per_tenant() -> None:
    now = [0.0]
    limiter = RateLimiter(2.0, 3, clock=lambda: now[0])
    for _ in range(3):
        limiter.check("acme")
    with pytest.raises(RateLimited) as over:
        limiter.check("acme")
    assert over.value.headers == {"Retry-After": "1"}
    limiter.check("globex")  # its own bucket
    now[0] = 0.5  # one token back
    limiter.check("acme")
    with pytest.raises(RateLimited):
        limiter.check("acme")
    RateLimiter(0, 1).check("acme")  # 0 = no limit


def test_a_tenant_over_its_quota_gets_429_with_retry_after() -> None:
    api = make_api(rate_per_s=1.0, rate_burst=2)
    assert [api.client.get("/v1/batches", headers=api.auth()).status_code for _ in range(2)] == [200, 200]
    answer = api.client.get("/v1/batches", headers=api.auth())
    assert answer.status_code == 429 and answer.headers["retry-after"] == "1"
    assert answer.json()["error"]["code"] == "rate_limit_exceeded"
    assert api.client.get("/v1/batches", headers=api.auth("globex")).status_code == 200
    api.clock.now += 1.0
    assert api.client.get("/v1/batches", headers=api.auth()).status_code == 200
