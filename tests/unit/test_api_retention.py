"""Retention through the HTTP API with the official SDK: uploads take OpenAI's ``expires_after`` (else
the tenant's retention) and show ``expires_at``; past it a file reads 404 ``expired`` and leaves the
list before the collector has removed anything; a batch's ``output_expires_after`` reaches the
dispatcher in its Kafka request. (Result files' dates, the collector and its tombstones run on real
Redis and MinIO: tests/integration/test_retention.py.)"""

from __future__ import annotations

import io

import openai
import pytest

from llmbatch.dispatcher.domain.retention import file_member
from llmbatch.schemas import BatchRequest
from llmbatch.settings.retention import RetentionSettings
from tests.support.api_fakes import INPUT_BUCKET, KEYS, ApiHarness, chat_line, jsonl, make_api

DAY = 86_400


def sdk(api: ApiHarness, tenant: str = "acme") -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key=KEYS[tenant], http_client=api.client, max_retries=0
    )


def upload(client: openai.OpenAI, **extra: object) -> openai.types.FileObject:
    data = io.BytesIO(jsonl(chat_line("a")))
    return client.files.create(file=("in.jsonl", data), purpose="batch", **extra)  # type: ignore[arg-type]


def test_an_upload_expires_as_asked_else_by_its_tenants_retention() -> None:
    api = make_api(retention=RetentionSettings(default_s=7 * DAY, by_tenant={"globex": 0}))
    asked = upload(sdk(api), expires_after={"anchor": "created_at", "seconds": 3600})
    assert asked.expires_at == int(api.clock.now) + 3600
    assert api.dates is not None and api.dates.due[file_member("acme", asked.id)] == api.clock.now + 3600
    default = upload(sdk(api))
    assert default.expires_at == int(api.clock.now) + 7 * DAY
    kept = upload(sdk(api, "globex"))
    assert kept.expires_at is None and file_member("globex", kept.id) not in api.dates.due


def test_without_retention_nothing_expires() -> None:
    api = make_api()
    assert upload(sdk(api)).expires_at is None


def test_past_its_expiry_a_file_is_expired_before_anything_is_removed() -> None:
    api = make_api(retention=RetentionSettings())
    client = sdk(api)
    short = upload(client, expires_after={"anchor": "created_at", "seconds": 3600})
    long = upload(client, expires_after={"anchor": "created_at", "seconds": 7200})
    api.clock.now += 3600
    for call in (lambda: client.files.retrieve(short.id), lambda: client.files.content(short.id)):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert caught.value.code == "expired" and short.id in caught.value.message
    assert [f.id for f in client.files.list()] == [long.id]
    assert client.files.retrieve(long.id).expires_at == int(long.created_at) + 7200
    assert api.objects.keys(INPUT_BUCKET) != []  # nothing removed: that is the collector's work


def test_a_batchs_output_expires_after_reaches_the_dispatcher() -> None:
    api = make_api(retention=RetentionSettings())
    client = sdk(api)
    file = upload(client)
    client.batches.create(
        input_file_id=file.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 86_400},
    )
    [event] = api.publisher.events()
    assert isinstance(event.data, BatchRequest)
    assert event.data.output_expires_after is not None and event.data.output_expires_after.seconds == 86_400


@pytest.mark.parametrize("seconds", [3599, 2_592_001])
def test_the_sdks_out_of_range_expiry_is_refused_naming_the_field(seconds: int) -> None:
    api = make_api(retention=RetentionSettings())
    with pytest.raises(openai.BadRequestError) as caught:
        upload(sdk(api), expires_after={"anchor": "created_at", "seconds": seconds})
    assert caught.value.param == "expires_after.seconds"
    assert api.objects.keys(INPUT_BUCKET) == []
