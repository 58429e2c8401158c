"""The official ``openai`` SDK against the ASGI app (no network): files.create -> batches.create ->
retrieve / list -> cancel, and files.content of a finished batch; responses are the SDK's own models,
errors its own exception classes."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import openai
import pytest
from openai.types import Batch, FileObject

from llmbatch.api.batches.status import output_file_id
from llmbatch.dispatcher.domain.events import Outcome
from llmbatch.dispatcher.domain.states import State
from llmbatch.schemas import BatchRequest, CancelRequest
from tests.support.api_fakes import KEYS, MODEL, ApiHarness, chat_line, jsonl, make_api

pytestmark = pytest.mark.unit
M = TypeVar("M", bound=openai.BaseModel)


def sdk(api: ApiHarness, key: str = KEYS["acme"]) -> openai.OpenAI:
    # the TestClient is an httpx.Client that calls the app in process
    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=api.client, max_retries=0)


def validated(model: type[M], raw: Any) -> M:
    """The SDK builds its models without validating them: validate the JSON with them here, and check
    the SDK's own parse agrees."""
    checked = model.model_validate(raw.http_response.json())
    assert raw.parse() == checked
    return checked


def test_the_sdk_uploads_creates_retrieves_lists_and_cancels(tmp_path: Path) -> None:
    api = make_api()
    client = sdk(api)
    path = tmp_path / "requests.jsonl"
    path.write_bytes(jsonl(*(chat_line(f"req-{i}", max_tokens=8) for i in range(4))))

    with path.open("rb") as handle:
        uploaded = validated(FileObject, client.files.with_raw_response.create(file=handle, purpose="batch"))
    assert uploaded.purpose == "batch" and uploaded.bytes == path.stat().st_size
    assert uploaded.filename == "requests.jsonl"
    assert validated(FileObject, client.files.with_raw_response.retrieve(uploaded.id)) == uploaded
    files_page = client.files.with_raw_response.list().http_response.json()
    assert [FileObject.model_validate(f) for f in files_page["data"]] == [uploaded]
    assert client.files.content(uploaded.id).read() == path.read_bytes()

    batch = validated(
        Batch,
        client.batches.with_raw_response.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={"job": "nightly"},
        ),
    )
    assert batch.status == "validating" and batch.input_file_id == uploaded.id
    assert batch.request_counts is not None and batch.request_counts.total == 4
    assert batch.metadata == {"job": "nightly"} and batch.model == MODEL
    (event,) = api.publisher.events()
    assert isinstance(event.data, BatchRequest) and event.data.batch_id == batch.id

    api.accept_all()
    api.dispatcher.run(batch.id, api.clock.now, total=4, completed=1)
    retrieved = validated(Batch, client.batches.with_raw_response.retrieve(batch.id))
    assert retrieved.status == "in_progress" and retrieved.in_progress_at is not None
    assert retrieved.request_counts is not None and retrieved.request_counts.completed == 1

    listed = client.batches.list(limit=10)
    assert [b.id for b in listed.data] == [batch.id] and not listed.has_more
    page = client.batches.with_raw_response.list(limit=10).http_response.json()
    assert [Batch.model_validate(b) for b in page["data"]] == [retrieved]
    assert page["object"] == "list" and page["first_id"] == page["last_id"] == batch.id

    cancelled = validated(Batch, client.batches.with_raw_response.cancel(batch.id))
    assert cancelled.status == "cancelling" and cancelled.cancelling_at is not None
    assert isinstance(api.publisher.events()[-1].data, CancelRequest)


def test_the_sdk_reads_a_finished_batchs_output(tmp_path: Path) -> None:
    api = make_api()
    client = sdk(api)
    uploaded = client.files.create(file=("in.jsonl", jsonl(chat_line("a"), chat_line("b"))), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    api.accept_all()
    shards = [f"s3://llmbatch-results/acme/{batch.id}/l1/output-a1-0000{i}.jsonl" for i in range(2)]
    api.write_shard(shards[0], b'{"custom_id": "a"}\n')
    api.write_shard(shards[1], b'{"custom_id": "b"}\n')
    api.dispatcher.run(batch.id, api.clock.now)
    api.dispatcher.finish(
        batch.id,
        Outcome(
            State.COMPLETED, api.clock.now + 1, shards, [], counts={"total": 2, "completed": 2, "failed": 0}
        ),
    )
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed" and done.output_file_id == output_file_id(batch.id)
    assert done.error_file_id is None
    content = client.files.content(done.output_file_id)
    assert content.text.splitlines() == ['{"custom_id": "a"}', '{"custom_id": "b"}']
    target = tmp_path / "out.jsonl"
    content.write_to_file(target)
    assert target.read_bytes() == b'{"custom_id": "a"}\n{"custom_id": "b"}\n'


def test_the_sdk_raises_its_own_errors() -> None:
    api = make_api()
    with pytest.raises(openai.AuthenticationError) as denied:
        sdk(api, key="sk-wrong").batches.list()
    assert denied.value.code == "invalid_api_key"
    client = sdk(api)
    uploaded = client.files.create(file=("in.jsonl", jsonl(chat_line("a"))), purpose="batch")
    with pytest.raises(openai.NotFoundError):
        sdk(api, key=KEYS["globex"]).files.retrieve(uploaded.id)
    with pytest.raises(openai.BadRequestError) as bad:
        client.files.create(file=("in.jsonl", jsonl(chat_line("a"), b"{")), purpose="batch")
    assert bad.value.param == "file" and "line 2" in bad.value.message
    with pytest.raises(openai.BadRequestError) as wrong_endpoint:
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    assert wrong_endpoint.value.param == "endpoint"
    limited = make_api(rate_per_s=1.0, rate_burst=1)
    sdk(limited).batches.list()
    with pytest.raises(openai.RateLimitError):
        sdk(limited).batches.list()


def test_the_sdk_sets_a_batchs_priority_with_extra_body(tmp_path: Path) -> None:
    api = make_api()
    client = sdk(api)
    path = tmp_path / "requests.jsonl"
    path.write_bytes(jsonl(chat_line("req-0", max_tokens=8)))
    with path.open("rb") as handle:
        uploaded = client.files.create(file=handle, purpose="batch")
    raw = client.batches.with_raw_response.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        extra_body={"priority": 9},
    )
    batch = validated(Batch, raw)
    assert batch.model_extra == {"priority": 9}  # the SDK keeps the extension field
    (event,) = api.publisher.events()
    assert isinstance(event.data, BatchRequest) and event.data.priority == 9
