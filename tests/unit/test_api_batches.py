"""The Batches endpoints: what they publish (decoded as the dispatcher decodes it), what they read
back as the dispatcher moves the batch along, pages, cancel, and every mistake named."""

from __future__ import annotations

import json
from typing import Any

import pytest

from llmbatch.api.batches.status import output_file_id
from llmbatch.api.store.records import BATCH_ID
from llmbatch.dispatcher.domain.events import Outcome
from llmbatch.dispatcher.domain.states import State
from llmbatch.schemas import BatchRequest, CancelRequest, EventType
from tests.support.api_fakes import (
    INPUT_BUCKET,
    MODEL,
    REQUESTS_TOPIC,
    ApiHarness,
    chat_line,
    jsonl,
    make_api,
)

pytestmark = pytest.mark.unit
CHAT = "/v1/chat/completions"


def uploaded(api: ApiHarness, tenant: str = "acme", n: int = 3, **line: Any) -> str:
    answer = api.upload(jsonl(*(chat_line(f"r{i}", **line) for i in range(n))), tenant=tenant)
    assert answer.status_code == 200, answer.text
    return str(answer.json()["id"])


def create(api: ApiHarness, tenant: str = "acme", **body: Any) -> Any:
    return api.client.post("/v1/batches", headers=api.auth(tenant), json=body)


def test_creating_a_batch_publishes_the_producers_batch_requested_event() -> None:
    api = make_api()
    file_id = uploaded(api)
    answer = create(
        api, input_file_id=file_id, endpoint=CHAT, completion_window="24h", metadata={"team": "search"}
    )
    assert answer.status_code == 200, answer.text
    batch = answer.json()
    assert BATCH_ID.fullmatch(batch["id"]) and batch["object"] == "batch"
    assert batch["status"] == "validating" and batch["input_file_id"] == file_id
    assert batch["request_counts"] == {"total": 3, "completed": 0, "failed": 0}
    assert batch["metadata"] == {"team": "search"} and batch["model"] == MODEL
    assert batch["expires_at"] == batch["created_at"] + 86400

    ((topic, key, _, headers),) = api.publisher.records
    assert topic == REQUESTS_TOPIC and key == batch["id"].encode()
    assert dict(headers)["ce_source"] == b"urn:test:api"
    (event,) = api.publisher.events()
    assert event.type is EventType.BATCH_REQUESTED
    request = event.data
    assert isinstance(request, BatchRequest)
    assert request.batch_id == batch["id"] and request.tenant == "acme" and request.model == MODEL
    assert request.endpoint.value == CHAT and request.completion_window == "24h"
    assert request.metadata == {"team": "search"} and request.requests is None
    # the input it names is the uploaded file, in the input bucket under the tenant
    assert request.input_uri == f"s3://{INPUT_BUCKET}/acme/files/{file_id}.jsonl"
    assert (INPUT_BUCKET, f"acme/files/{file_id}.jsonl") in api.objects.objects


def test_a_batch_reads_back_as_the_dispatcher_moves_it() -> None:
    api = make_api()
    batch_id = create(api, input_file_id=uploaded(api), endpoint=CHAT).json()["id"]
    path = f"/v1/batches/{batch_id}"
    assert api.client.get(path, headers=api.auth()).json()["status"] == "validating"
    api.clock.now += 2
    api.accept_all()
    assert api.client.get(path, headers=api.auth()).json()["status"] == "in_progress"
    api.dispatcher.run(batch_id, api.clock.now, total=3, completed=1, prompt_tokens=7, completion_tokens=2)
    got = api.client.get(path, headers=api.auth()).json()
    assert got["request_counts"] == {"total": 3, "completed": 1, "failed": 0}
    assert got["usage"]["total_tokens"] == 9
    api.dispatcher.finalize(batch_id, api.clock.now + 1)
    assert api.client.get(path, headers=api.auth()).json()["status"] == "finalizing"
    out = f"s3://llmbatch-results/acme/{batch_id}/l1/output-a1-00000.jsonl"
    api.write_shard(out, b'{"custom_id": "r0"}\n')
    api.dispatcher.finish(
        batch_id,
        Outcome(
            State.COMPLETED, api.clock.now + 3, [out], [], counts={"total": 3, "completed": 3, "failed": 0}
        ),
    )
    done = api.client.get(path, headers=api.auth()).json()
    assert done["status"] == "completed" and done["output_file_id"] == output_file_id(batch_id)
    assert done["completed_at"] == int(api.clock.now + 3) and done["error_file_id"] is None


def test_batches_list_newest_first_in_pages() -> None:
    api = make_api()
    file_id = uploaded(api)
    ids = []
    for _ in range(5):
        api.clock.now += 1
        ids.append(create(api, input_file_id=file_id, endpoint=CHAT).json()["id"])
    newest = list(reversed(ids))
    page = api.client.get("/v1/batches?limit=2", headers=api.auth()).json()
    assert page["object"] == "list" and [b["id"] for b in page["data"]] == newest[:2] and page["has_more"]
    page = api.client.get(f"/v1/batches?limit=3&after={page['last_id']}", headers=api.auth()).json()
    assert [b["id"] for b in page["data"]] == newest[2:] and not page["has_more"]
    assert [b["id"] for b in api.client.get("/v1/batches", headers=api.auth()).json()["data"]] == newest
    for query, param in (("limit=0", "limit"), ("limit=101", "limit"), ("after=file-1", "after")):
        answer = api.client.get(f"/v1/batches?{query}", headers=api.auth())
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param


def test_cancel_publishes_cancel_requested_and_reads_cancelling_then_cancelled() -> None:
    api = make_api()
    batch_id = create(api, input_file_id=uploaded(api), endpoint=CHAT).json()["id"]
    api.accept_all()
    api.dispatcher.run(batch_id, api.clock.now)
    api.clock.now += 5
    answer = api.client.post(f"/v1/batches/{batch_id}/cancel", headers=api.auth())
    assert answer.status_code == 200
    assert answer.json()["status"] == "cancelling" and answer.json()["cancelling_at"] == int(api.clock.now)
    event = api.publisher.events()[-1]
    assert event.type is EventType.CANCEL_REQUESTED and isinstance(event.data, CancelRequest)
    assert event.data.batch_id == batch_id and event.data.requested_by == "api:acme"
    assert event.data.tenant == "acme"  # the dispatcher ignores a cancel naming another tenant
    assert api.client.get(f"/v1/batches/{batch_id}", headers=api.auth()).json()["status"] == "cancelling"
    # asking again publishes nothing more
    again = api.client.post(f"/v1/batches/{batch_id}/cancel", headers=api.auth())
    assert again.json()["status"] == "cancelling"
    assert len(api.publisher.records) == 2
    api.dispatcher.finish(batch_id, Outcome(State.CANCELLED, api.clock.now + 1))
    after = api.client.post(f"/v1/batches/{batch_id}/cancel", headers=api.auth())
    assert after.status_code == 200 and after.json()["status"] == "cancelled"
    assert len(api.publisher.records) == 2


def test_a_finished_batch_cannot_be_cancelled() -> None:
    api = make_api()
    batch_id = create(api, input_file_id=uploaded(api), endpoint=CHAT).json()["id"]
    api.accept_all()
    api.dispatcher.finish(batch_id, Outcome(State.COMPLETED, api.clock.now))
    answer = api.client.post(f"/v1/batches/{batch_id}/cancel", headers=api.auth())
    assert answer.status_code == 409 and answer.json()["error"]["code"] == "batch_not_cancellable"
    assert len(api.publisher.records) == 1


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"endpoint": "/v1/embeddings"}, "endpoint"),
        ({"endpoint": "/v1/completions"}, "endpoint"),  # the file's lines are chat completions
        ({"completion_window": "2w"}, "completion_window"),
        ({"completion_window": "30d"}, "completion_window"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata.k"),
        ({"output_expires_after": {"anchor": "created_at", "seconds": 60}}, "output_expires_after.seconds"),
        (
            {"output_expires_after": {"anchor": "last_active_at", "seconds": 3600}},
            "output_expires_after.anchor",
        ),
        ({"priority": 10}, "priority"),
        ({"priority": -1}, "priority"),
        ({"priority": "high"}, "priority"),
        ({"input_file_id": "file-00000000000000000000000000000"}, "input_file_id"),
    ],
)
def test_mistakes_are_named_and_publish_nothing(body: dict[str, Any], param: str) -> None:
    api = make_api()
    answer = create(api, **{"input_file_id": uploaded(api), "endpoint": CHAT, **body})
    assert answer.status_code in {400, 404}, answer.text
    assert answer.json()["error"]["param"] == param
    assert api.publisher.records == []
    assert api.client.get("/v1/batches", headers=api.auth()).json()["data"] == []


def test_a_create_may_set_its_priority_and_the_batch_shows_it() -> None:
    api = make_api()
    urgent = create(api, input_file_id=uploaded(api), endpoint=CHAT, priority=9).json()
    default = create(api, input_file_id=uploaded(api), endpoint=CHAT).json()
    lowest = create(api, input_file_id=uploaded(api), endpoint=CHAT, priority=0).json()
    assert [e.data.priority for e in api.publisher.events()] == [9, 5, 0]
    assert [urgent["priority"], default["priority"], lowest["priority"]] == [9, 5, 0]
    api.accept_all()
    shown = api.client.get(f"/v1/batches/{urgent['id']}", headers=api.auth()).json()
    assert shown["priority"] == 9


def test_a_completion_window_other_than_24h_is_taken_within_the_limits() -> None:
    api = make_api()
    batch = create(api, input_file_id=uploaded(api), endpoint=CHAT, completion_window="90m").json()
    assert batch["completion_window"] == "90m" and batch["expires_at"] == batch["created_at"] + 5400
    assert api.publisher.events()[0].data.completion_window == "90m"
    default = create(api, input_file_id=uploaded(api), endpoint=CHAT).json()
    assert default["completion_window"] == "24h"


def test_when_kafka_is_down_the_call_is_503_and_no_batch_is_left_behind() -> None:
    api = make_api()
    file_id = uploaded(api)
    api.publisher.fail = True
    answer = create(api, input_file_id=file_id, endpoint=CHAT)
    assert answer.status_code == 503 and answer.json()["error"]["type"] == "server_error"
    assert "127.0.0.1" not in answer.json()["error"]["message"]
    assert api.client.get("/v1/batches", headers=api.auth()).json()["data"] == []
    assert not [k for k in api.objects.keys(INPUT_BUCKET) if "/api/batches/" in k]


def test_a_failed_cancel_publish_is_503_and_changes_nothing() -> None:
    api = make_api()
    batch_id = create(api, input_file_id=uploaded(api), endpoint=CHAT).json()["id"]
    api.publisher.fail = True
    assert api.client.post(f"/v1/batches/{batch_id}/cancel", headers=api.auth()).status_code == 503
    assert api.client.get(f"/v1/batches/{batch_id}", headers=api.auth()).json()["status"] == "validating"


def test_a_batch_redis_forgot_reads_from_its_manifest() -> None:
    api = make_api(state_fallback_after_s=60)
    batch_id = create(api, input_file_id=uploaded(api), endpoint=CHAT).json()["id"]
    shard = f"s3://llmbatch-results/acme/{batch_id}/l1/output-a1-00000.jsonl"
    manifest = {
        "batch_id": batch_id,
        "attempt": 1,
        "status": "completed",
        "request_counts": {"total": 3, "completed": 3, "failed": 0},
        "output_shards": [{"uri": shard, "lines": 3}],
        "timings": {"started_at": "2026-05-28T20:00:00Z", "finished_at": "2026-05-28T20:10:00Z"},
    }
    api.write_shard(f"s3://llmbatch-results/acme/{batch_id}/l1/manifest.json", json.dumps(manifest).encode())
    api.write_shard(shard, b'{"custom_id": "r0"}\n')
    path = f"/v1/batches/{batch_id}"
    assert api.client.get(path, headers=api.auth()).json()["status"] == "validating"  # too young to look
    api.clock.now += 61
    got = api.client.get(path, headers=api.auth()).json()
    assert got["status"] == "completed" and got["request_counts"]["completed"] == 3
    content = api.client.get(f"/v1/files/{got['output_file_id']}/content", headers=api.auth())
    assert content.content == b'{"custom_id": "r0"}\n'


def lost_create(api: ApiHarness, **body: Any) -> dict[str, Any]:
    """A create whose event never got out: its publish fails and so does the clean-up of its record
    (as when the API stops in between); returns the batch as the list then shows it."""
    file_id = uploaded(api)
    api.publisher.fail = True
    api.objects.failing["delete"] = OSError("MinIO went away too")
    assert create(api, input_file_id=file_id, endpoint=CHAT, **body).status_code == 503
    api.publisher.fail = False
    [batch] = api.client.get("/v1/batches", headers=api.auth()).json()["data"]
    return dict(batch)


def test_a_batch_whose_event_never_got_out_is_published_again_when_read() -> None:
    """The record is written before the event: an API that stops in between (here: the publish fails
    and so does the clean-up of the record) left a batch reading ``validating`` for ever."""
    api = make_api(republish_after_s=60)
    batch = lost_create(api, metadata={"team": "search"})
    file_id = batch["input_file_id"]
    assert batch["status"] == "validating" and api.publisher.records == []  # not yet: maybe in flight

    api.clock.now += 61
    api.app.state.services.batches.source = "urn:test:api-2"  # read by another API replica
    assert api.client.get(f"/v1/batches/{batch['id']}", headers=api.auth()).json()["status"] == "validating"
    (event,) = api.publisher.events()
    assert event.source == "urn:test:api"  # the creator's: with the id, what makes it the same event
    request = event.data
    assert isinstance(request, BatchRequest) and event.subject == batch["id"]
    assert (request.batch_id, request.tenant, request.model, request.metadata) == (
        batch["id"],
        "acme",
        MODEL,
        {"team": "search"},
    )
    assert request.input_uri is not None and request.input_uri.endswith(f"/acme/files/{file_id}.jsonl")
    # once per interval, whatever the number of reads (GET and list alike)
    api.client.get(f"/v1/batches/{batch['id']}", headers=api.auth())
    api.client.get("/v1/batches", headers=api.auth())
    assert len(api.publisher.records) == 1
    api.clock.now += 61
    api.client.get("/v1/batches", headers=api.auth())
    first, again = api.publisher.events()
    # the same event (id and source): the dispatcher drops a copy it already has
    assert (again.id, again.source) == (first.id, first.source)
    # once the dispatcher has it, reads publish nothing more and show its state
    api.accept_all()
    api.clock.now += 600
    assert api.client.get(f"/v1/batches/{batch['id']}", headers=api.auth()).json()["status"] == "in_progress"
    assert len(api.publisher.records) == 2


def test_a_published_batch_is_never_published_again() -> None:
    api = make_api(republish_after_s=60)
    batch = create(api, input_file_id=uploaded(api), endpoint=CHAT).json()
    (event,) = api.publisher.events()
    api.accept_all()
    api.clock.now += 3600
    api.client.get(f"/v1/batches/{batch['id']}", headers=api.auth())
    api.client.get("/v1/batches", headers=api.auth())
    assert api.publisher.events() == [event]


def test_a_cancel_of_a_batch_whose_event_never_got_out_is_sent_again_after_it() -> None:
    """The first cancel found no batch (the dispatcher ignores a cancel of an unknown batch): without
    a second one after the request, the batch the user cancelled would run."""
    api = make_api(republish_after_s=60)
    batch = lost_create(api)
    cancelled = api.client.post(f"/v1/batches/{batch['id']}/cancel", headers=api.auth())
    assert cancelled.json()["status"] == "cancelling"
    api.clock.now += 61
    api.client.get(f"/v1/batches/{batch['id']}", headers=api.auth())
    first_cancel, request, cancel = api.publisher.events()
    assert isinstance(first_cancel.data, CancelRequest) and isinstance(request.data, BatchRequest)
    assert isinstance(cancel.data, CancelRequest) and cancel.subject == request.subject == batch["id"]
    assert [r[1] for r in api.publisher.records] == [batch["id"].encode()] * 3  # one partition, in order


def test_a_lost_create_is_not_published_again_after_its_completion_window() -> None:
    """Redis forgets finished batches after 7 days, and a batch that failed before running has no
    manifest: published again then, a batch could run a second time."""
    api = make_api(republish_after_s=60)
    batch = lost_create(api, completion_window="24h")
    api.clock.now += 86400
    api.client.get("/v1/batches", headers=api.auth())
    api.client.get(f"/v1/batches/{batch['id']}", headers=api.auth())
    assert api.publisher.records == []


# --- the active-batch quota --------------------------------------------------------------------------


def _active_marks(api: Any, tenant: str = "acme") -> list[str]:
    return [key for (_, key) in api.objects.objects if key.startswith(f"{tenant}/api/active/")]


def test_a_create_over_the_tenants_active_batch_quota_is_429_until_one_ends() -> None:
    api = make_api(max_active_batches=2)
    file_id = uploaded(api)
    first, second = (create(api, input_file_id=file_id, endpoint=CHAT).json()["id"] for _ in range(2))
    refused = create(api, input_file_id=file_id, endpoint=CHAT)
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("insufficient_quota", "active_batch_quota_exceeded")
    assert "LLMBATCH_API__MAX_ACTIVE_BATCHES" in error["message"]
    assert len(api.publisher.events()) == 2 and len(_active_marks(api)) == 2  # nothing published, no mark
    # another tenant has its own quota
    assert create(api, "globex", input_file_id=uploaded(api, "globex"), endpoint=CHAT).status_code == 200
    # one ends (the dispatcher took both in, one was cancelled): room for one more, and its mark is gone
    api.accept_all()
    api.dispatcher.run(first, api.clock.now)
    api.dispatcher.finish(second, Outcome(State.CANCELLED, api.clock.now))
    third = create(api, input_file_id=file_id, endpoint=CHAT)
    assert third.status_code == 200, third.text
    assert sorted(_active_marks(api)) == sorted(f"acme/api/active/{b}" for b in (first, third.json()["id"]))
    assert create(api, input_file_id=file_id, endpoint=CHAT).status_code == 429


def test_a_batch_the_dispatcher_never_heard_of_stops_counting_after_the_fallback_time() -> None:
    api = make_api(max_active_batches=1, state_fallback_after_s=300)
    file_id = uploaded(api)
    assert create(api, input_file_id=file_id, endpoint=CHAT).status_code == 200  # never taken in
    assert create(api, input_file_id=file_id, endpoint=CHAT).status_code == 429
    api.clock.now += 301
    assert create(api, input_file_id=file_id, endpoint=CHAT).status_code == 200


def test_without_a_limit_nothing_is_marked() -> None:
    api = make_api()
    file_id = uploaded(api)
    for _ in range(3):
        assert create(api, input_file_id=file_id, endpoint=CHAT).status_code == 200
    assert _active_marks(api) == []


def test_a_create_whose_publish_fails_leaves_no_active_mark() -> None:
    api = make_api(max_active_batches=1)
    file_id = uploaded(api)
    api.publisher.fail = True
    assert create(api, input_file_id=file_id, endpoint=CHAT).status_code == 503
    api.publisher.fail = False
    assert _active_marks(api) == []
    assert create(api, input_file_id=file_id, endpoint=CHAT).status_code == 200


def _sent_to_kafka(api: ApiHarness, batch_id: str, tenant: str = "acme") -> None:
    """A batch a tenant's service published straight to Kafka, taken in by the dispatcher."""
    from tests.support.dispatcher_kit import batch_request, request_message

    request = batch_request(
        batch_id,
        model=MODEL,
        tenant=tenant,
        metadata={"team": "kafka"},
        requests=[chat_line(f"k{i}") for i in range(2)],
    )
    key, value, headers = request_message(request, source="urn:svc:indexer")
    assert key is not None and value is not None
    api.dispatcher.take_in((REQUESTS_TOPIC, key, value, headers), api.clock.now)


def test_the_list_pages_the_apis_and_the_kafka_batches_in_one_order() -> None:
    """Batches made by the API and sent to Kafka, some in the same millisecond, paged with every
    limit: each batch once, newest first, and the pages' concatenation is the one-page list."""
    api = make_api()
    made: list[str] = []
    for step in range(4):
        made.append(create(api, input_file_id=uploaded(api), endpoint=CHAT).json()["id"])
        _sent_to_kafka(api, f"kafka-{step}-a")
        _sent_to_kafka(api, f"kafka-{step}-b")  # the same millisecond as the API's batch before it
        api.clock.now += 0.5
    api.accept_all()
    whole = api.client.get("/v1/batches?limit=100", headers=api.auth()).json()
    ids = [b["id"] for b in whole["data"]]
    expected = []
    for step in reversed(range(4)):  # newest first; in one millisecond the API's, then ids descending
        expected += [made[step], f"kafka-{step}-b", f"kafka-{step}-a"]
    assert ids == expected and not whole["has_more"]
    for limit in range(1, 6):
        paged: list[str] = []
        after: str | None = None
        while True:
            query = f"/v1/batches?limit={limit}" + (f"&after={after}" if after else "")
            page = api.client.get(query, headers=api.auth()).json()
            paged += [b["id"] for b in page["data"]]
            if not page["has_more"]:
                break
            after = page["last_id"]
        assert paged == expected, limit


def _pages_as_the_sdk_reads_them(api: ApiHarness, limit: int) -> list[list[str]]:
    """Pages of ``GET /v1/batches`` read on as the openai SDK's auto-paging does: it stops at a page
    without ``has_more`` or without batches."""
    pages: list[list[str]] = []
    after: str | None = None
    while True:
        query = f"/v1/batches?limit={limit}" + (f"&after={after}" if after else "")
        page = api.client.get(query, headers=api.auth()).json()
        pages.append([b["id"] for b in page["data"]])
        if not page["has_more"] or not page["data"]:
            return pages
        after = page["last_id"]


def test_kafka_batches_whose_records_expired_neither_empty_nor_shorten_a_page() -> None:
    """A Kafka batch's list entry outlives its record by days: a run of such entries newer than the
    API's batches must not end the SDK's paging before those (a page of only them came back empty
    with has_more, and the SDK stops at an empty page)."""
    api = make_api()
    made = []
    for _ in range(3):
        made.append(create(api, input_file_id=uploaded(api), endpoint=CHAT).json()["id"])
        api.clock.now += 0.5
    for step in range(12):
        _sent_to_kafka(api, f"old-kafka-{step:02}")
        api.dispatcher.expire(f"old-kafka-{step:02}")
        api.clock.now += 0.5
    _sent_to_kafka(api, "live-kafka")
    newest_first = ["live-kafka", *reversed(made)]
    for limit in (1, 2, 4):
        pages = _pages_as_the_sdk_reads_them(api, limit)
        assert [i for page in pages for i in page] == newest_first, (limit, pages)
        assert all(len(page) == limit for page in pages[:-1]), (limit, pages)


def test_an_unknown_cursor_is_named() -> None:
    api = make_api()
    answer = api.client.get("/v1/batches?after=never-listed", headers=api.auth())
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "after"


def test_a_batch_sent_to_kafka_reads_back_for_its_tenant_only_with_its_result_file_and_cancel() -> None:
    api = make_api()
    _sent_to_kafka(api, "nightly-eval-7")
    got = api.client.get("/v1/batches/nightly-eval-7", headers=api.auth())
    assert got.status_code == 200, got.text
    batch = got.json()
    assert (batch["id"], batch["status"], batch["input_file_id"]) == ("nightly-eval-7", "in_progress", "")
    assert batch["request_counts"]["total"] == 2 and batch["metadata"] == {"team": "kafka"}
    assert batch["endpoint"] == CHAT and batch["model"] == MODEL
    assert batch["expires_at"] > batch["created_at"]
    from openai.types import Batch

    Batch.model_validate(batch)  # the SDK reads it as any other batch
    other = api.client.get("/v1/batches/nightly-eval-7", headers=api.auth("globex"))
    assert other.status_code == 404  # another tenant's key sees nothing
    # its tenant's list shows it (another's does not), and nothing was stored for it
    assert [b["id"] for b in api.client.get("/v1/batches", headers=api.auth()).json()["data"]] == [
        "nightly-eval-7"
    ]
    assert api.client.get("/v1/batches", headers=api.auth("globex")).json()["data"] == []
    assert not [k for k in api.objects.keys("llmbatch-input") if "nightly-eval-7" in k]

    cancelled = api.client.post("/v1/batches/nightly-eval-7/cancel", headers=api.auth())
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelling"
    (event,) = [e for e in api.publisher.events() if isinstance(e.data, CancelRequest)]
    assert (event.data.batch_id, event.data.tenant) == ("nightly-eval-7", "acme")
    assert not [k for k in api.objects.keys("llmbatch-input") if "nightly-eval-7" in k]

    out = "s3://llmbatch-results/acme/nightly-eval-7/l1/output-a1-00000.jsonl"
    api.write_shard(out, b'{"custom_id": "k0"}\n{"custom_id": "k1"}\n')
    api.dispatcher.finish(
        "nightly-eval-7",
        Outcome(
            State.COMPLETED, api.clock.now + 3, [out], [], counts={"total": 2, "completed": 2, "failed": 0}
        ),
    )
    done = api.client.get("/v1/batches/nightly-eval-7", headers=api.auth()).json()
    assert done["status"] == "completed" and done["output_file_id"] == output_file_id("nightly-eval-7")
    content = api.client.get(f"/v1/files/{done['output_file_id']}/content", headers=api.auth())
    assert content.status_code == 200 and content.content.count(b"custom_id") == 2
    assert (
        api.client.get(f"/v1/files/{done['output_file_id']}/content", headers=api.auth("globex")).status_code
        == 404
    )


def test_refused_requests_and_api_shaped_ids_are_never_read_from_kafka() -> None:
    api = make_api()
    api.dispatcher.reject("refused-1", api.clock.now, "invalid_event", "bad")
    assert api.client.get("/v1/batches/refused-1", headers=api.auth()).status_code == 404
    for api_form in ("batch_" + "1" * 13 + "a" * 16, "batch_1"):  # the API's namespace, sent to Kafka
        _sent_to_kafka(api, api_form)
        assert api.client.get(f"/v1/batches/{api_form}", headers=api.auth()).status_code == 404


def test_a_kafka_record_the_api_cannot_show_is_not_found_not_a_500() -> None:
    api = make_api()
    _sent_to_kafka(api, "old-record")
    api.dispatcher.hashes["old-record"]["endpoint"] = "/v1/retired"
    answer = api.client.get("/v1/batches/old-record", headers=api.auth())
    assert answer.status_code == 404 and answer.json()["error"]["param"] == "batch_id"


def test_a_batch_over_the_tenants_token_limit_is_refused_with_429_and_nothing_published() -> None:
    """The file's tokens (its bytes / 4) and those the tenant's batches hold, against its limit."""
    from llmbatch.dispatcher.domain.quota import estimate_file

    api = make_api(token_limits={"acme": 10_000})
    file_id = uploaded(api)
    size = api.client.get(f"/v1/files/{file_id}", headers=api.auth()).json()["bytes"]
    api.dispatcher.tokens["acme"] = 10_000 - estimate_file(size)  # exactly room for it
    assert create(api, input_file_id=file_id, endpoint=CHAT).status_code == 200
    api.dispatcher.tokens["acme"] += 1  # one token less room
    refused = create(api, input_file_id=file_id, endpoint=CHAT)
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert (error["code"], error["type"], error["param"]) == (
        "token_limit_exceeded",
        "insufficient_quota",
        "input_file_id",
    )
    assert "LLMBATCH_TENANTS__MAX_ENQUEUED_TOKENS" in error["message"]
    assert len([e for e in api.publisher.events() if isinstance(e.data, BatchRequest)]) == 1
    # another tenant has no limit ("*" unset)
    assert create(api, "globex", input_file_id=uploaded(api, "globex"), endpoint=CHAT).status_code == 200


def test_a_batch_of_a_tenant_over_its_storage_is_refused_with_429_and_nothing_published() -> None:
    """Judged by what the dispatchers last measured the tenant keeps (its inputs and results)."""
    api = make_api(storage_limits={"*": 1_000_000})
    file_id = uploaded(api)
    api.dispatcher.stored["acme"] = 999_999  # just under
    assert create(api, input_file_id=file_id, endpoint=CHAT).status_code == 200
    api.dispatcher.stored["acme"] = 1_000_000
    refused = create(api, input_file_id=file_id, endpoint=CHAT)
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert (error["code"], error["type"]) == ("storage_quota_exceeded", "insufficient_quota")
    assert "LLMBATCH_TENANTS__MAX_STORED_BYTES" in error["message"]
    assert len([e for e in api.publisher.events() if isinstance(e.data, BatchRequest)]) == 1
    # a tenant never measured is not refused
    assert create(api, "globex", input_file_id=uploaded(api, "globex"), endpoint=CHAT).status_code == 200
